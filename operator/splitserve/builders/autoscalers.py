"""Autoscaler objects for `autoscaling.backend: keda` and `autoscaling.backend: hpa` (pure builders).

Both scale each pool's Deployment of the serving KV generation (`<name>-prefill-<generation>`,
`<name>-decode-<generation>`, or `<name>-aggregated-<generation>`, see api/generation.py) and are
named after it, on the same signals and targets as the built-in loop (signals.py), mapped onto HPA
metric types:

===================  =============================  ==========================================
signal               target                         HPA/KEDA metric type
===================  =============================  ==========================================
backlog / prompts    waitingPerReplica              AverageValue (total / replicas ≤ target)
running (decode)     runningPerReplica              AverageValue
kvCacheUsage         kvCacheUsage                   Value (HPA: ceil(replicas * value/target))
ttftP90 / itlP90     ttftSloSeconds / itlSloSeconds Value
===================  =============================  ==========================================

Behaviour: `behavior.scaleUp/scaleDown.stabilizationWindowSeconds` are the spec's windows (HPA
caps them at 3600 s) and a Pods policy of `maxStep` per `intervalSeconds` is the step limit.

What only the built-in backend does: sizing decode for running + waiting when its queue is over
target (KEDA/HPA size the backlog trigger as waiting / waitingPerReplica, so a transient queue can
overshoot; the scale-down window then holds it); scaling latency and usage from ready replicas; the
flap guard; the prefill:decode ratio bounds; the per-deployment
tolerance (HPA's is the cluster-wide `--horizontal-pod-autoscaler-tolerance`, 0.1 by default);
holding on stale data (HPA/KEDA treat a failed metric as "no recommendation", KEDA's `fallback`
is not set); the 2x cap on latency-driven growth. The `hpa` backend cannot scale to zero
(minReplicas ≥ 1 without the HPAScaleToZero feature gate); KEDA can (minReplicaCount 0, with an
activation threshold of 0 on the backlog trigger). A prefill pool at zero has no backlog (the
router serves its prompts aggregated at once), so its ScaledObject also has a `prefill-fallbacks`
trigger (the `prefillFallbacks` signal clamped to 0..1, Value 1, activation 0): it activates the
pool from zero and otherwise only proposes the current size.

prometheus-adapter rules the `hpa` backend expects (`externalRules` in the adapter's config):

```yaml
externalRules:
  - seriesQuery: '{__name__=~"vllm:num_requests_(waiting|running)",deployment!="",role!=""}'
    name: {matches: "^vllm:num_requests_(.*)$", as: "splitserve_${1}"}
    metricsQuery: 'sum(<<.Series>>{<<.LabelMatchers>>}) by (namespace, deployment, role)'
    resources: {overrides: {namespace: {resource: namespace}}}
  - seriesQuery: 'vllm:kv_cache_usage_perc{deployment!="",role!=""}'
    name: {as: "splitserve_kv_cache_usage"}
    metricsQuery: 'avg(<<.Series>>{<<.LabelMatchers>>}) by (namespace, deployment, role)'
    resources: {overrides: {namespace: {resource: namespace}}}
  - seriesQuery: 'splitserve_router_queue_depth{deployment!="",pool!=""}'
    name: {as: "splitserve_router_queue"}
    metricsQuery: 'sum(<<.Series>>{<<.LabelMatchers>>}) by (namespace, deployment, pool)'
    resources: {overrides: {namespace: {resource: namespace}}}
  - seriesQuery: 'vllm:time_to_first_token_seconds_bucket{deployment!="",role!=""}'
    name: {as: "splitserve_ttft_p90"}
    metricsQuery: >-
      histogram_quantile(0.9, sum by (le, namespace, deployment, role)
      (rate(<<.Series>>{<<.LabelMatchers>>}[1m])))
    resources: {overrides: {namespace: {resource: namespace}}}
  - seriesQuery: 'vllm:inter_token_latency_seconds_bucket{deployment!="",role!=""}'
    name: {as: "splitserve_itl_p90"}
    metricsQuery: >-
      histogram_quantile(0.9, sum by (le, namespace, deployment, role)
      (rate(<<.Series>>{<<.LabelMatchers>>}[1m])))
    resources: {overrides: {namespace: {resource: namespace}}}
```

External metric names cannot contain ':', hence the `splitserve_*` names. The HPA's backlog is
separate metrics (vLLM waiting, the router queue and, for prefill, vLLM running, each against
waitingPerReplica) because an adapter rule cannot add series of different names; the HPA takes the
largest, so it reacts to a backlog later than KEDA and the built-in loop, which add them.
`spec.autoscaling.queries` overrides apply to the KEDA triggers (they are PromQL) but not to the
HPA (its PromQL lives in the adapter).
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from splitserve.api.generation import kv_generation
from splitserve.api.spec import DEFAULT_WORKER_IMAGE, InferenceDeploymentSpec, Role
from splitserve.api.topology import generation_pool_name, role_pool, worker_selector_labels
from splitserve.autoscaling.queries import Pool, autoscaled_pools, query_for, router_pool

KEDA_API_VERSION = "keda.sh/v1alpha1"
HPA_API_VERSION = "autoscaling/v2"
# The kinds autoscaler_objects emits. While a new KV generation rolls out the controller sizes both
# generations itself and leaves these out of the desired children (so they are pruned); they return
# afterwards, aimed at the new generation's Deployments.
AUTOSCALER_KINDS: frozenset[str] = frozenset({"ScaledObject", "HorizontalPodAutoscaler"})
HPA_MAX_WINDOW_SECONDS = 3600
HPA_MAX_POLICY_PERIOD_SECONDS = 1800


def quantity(value: float) -> str:
    """A Kubernetes quantity string for a target: integers as is, fractions in milli-units."""
    if float(value).is_integer():
        return str(int(value))
    milli = Decimal(str(value)) * 1000
    if milli == milli.to_integral_value():
        return f"{int(milli)}m"
    return format(Decimal(str(value)).normalize(), "f")


def quantity_text(value: float) -> str:
    """KEDA reads thresholds with strconv.ParseFloat: plain decimal text, no milli suffix."""
    return format(Decimal(str(value)).normalize(), "f")


def behavior(spec: InferenceDeploymentSpec) -> dict[str, Any]:
    autoscaling = spec.autoscaling
    period = max(1, min(autoscaling.interval_seconds, HPA_MAX_POLICY_PERIOD_SECONDS))
    policy = [{"type": "Pods", "value": autoscaling.max_step, "periodSeconds": period}]
    return {
        "scaleUp": {
            "stabilizationWindowSeconds": min(autoscaling.scale_up_stabilization_seconds, HPA_MAX_WINDOW_SECONDS),
            "selectPolicy": "Max",
            "policies": policy,
        },
        "scaleDown": {
            "stabilizationWindowSeconds": min(autoscaling.scale_down_stabilization_seconds, HPA_MAX_WINDOW_SECONDS),
            "selectPolicy": "Max",
            "policies": policy,
        },
    }


def is_autoscaler(obj: dict[str, Any]) -> bool:
    """Whether a child is a KEDA ScaledObject or an HPA (what a rollout withholds)."""
    return obj.get("kind") in AUTOSCALER_KINDS


def _metadata(
    name: str,
    namespace: str,
    pool: Pool,
    generation: str,
    labels: dict[str, str] | None,
    owner_references: list[dict[str, Any]] | None,
) -> dict[str, Any]:
    """Named after the pool's Deployment it scales, labelled like that Deployment's selector."""
    meta: dict[str, Any] = {
        "name": generation_pool_name(name, pool, generation),
        "namespace": namespace,
        "labels": worker_selector_labels(name, pool, generation) | (labels or {}),
    }
    if owner_references:
        meta["ownerReferences"] = owner_references
    return meta


def _scale_target(name: str, pool: Pool, generation: str) -> dict[str, str]:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": generation_pool_name(name, pool, generation)}


def _non_nan(promql: str) -> str:
    """NaN (no traffic for a quantile) and no series both become 0 for KEDA, which errors on NaN."""
    return f"(({promql}) >= 0) or vector(0)"


def keda_triggers(spec: InferenceDeploymentSpec, namespace: str, name: str, pool: Pool) -> list[dict[str, Any]]:
    autoscaling = spec.autoscaling

    def query(signal: str) -> str:
        return query_for(autoscaling, signal, pool, namespace, name)

    def trigger(trigger_name: str, promql: str, metric_type: str, threshold: float, **extra: str) -> dict[str, Any]:
        return {
            "type": "prometheus",
            "name": trigger_name,
            "metricType": metric_type,
            "metadata": {
                "serverAddress": autoscaling.prometheus_url,
                "query": promql,
                "threshold": quantity_text(threshold),
                "ignoreNullValues": "true",
                **extra,
            },
        }

    backlog = f"({_non_nan(query('routerQueue'))}) + ({_non_nan(query('waiting'))})"
    triggers: list[dict[str, Any]] = []
    if pool == "prefill":
        # On a prefill worker "running" prompts are still waiting for their first token (see decision.py).
        prompts = f"{backlog} + ({_non_nan(query('running'))})"
        target = autoscaling.prefill.waiting_per_replica
        triggers.append(trigger("prompts", prompts, "AverageValue", target, activationThreshold="0"))
        # At zero the router serves prompts aggregated instead of queueing them for prefill, so its
        # fallbacks are the only demand: 0 or 1 as a Value against 1 activates the pool from zero and
        # otherwise proposes the current size (never more), leaving the sizing to the other triggers.
        fallbacks = f"clamp_max({_non_nan(query('prefillFallbacks'))}, 1)"
        triggers.append(trigger("prefill-fallbacks", fallbacks, "Value", 1, activationThreshold="0"))
    else:
        decode = autoscaling.decode
        triggers.append(
            trigger("backlog", backlog, "AverageValue", decode.waiting_per_replica, activationThreshold="0")
        )
        triggers.append(trigger("running", _non_nan(query("running")), "AverageValue", decode.running_per_replica))
        triggers.append(trigger("kv-cache-usage", _non_nan(query("kvCacheUsage")), "Value", decode.kv_cache_usage))
        triggers.append(trigger("itl-p90", _non_nan(query("itlP90")), "Value", decode.itl_slo_seconds))
    if pool != "decode":
        triggers.append(trigger("ttft-p90", _non_nan(query("ttftP90")), "Value", autoscaling.prefill.ttft_slo_seconds))
    return triggers


def scaled_object(
    spec: InferenceDeploymentSpec,
    namespace: str,
    name: str,
    pool: Pool,
    *,
    worker_image: str = DEFAULT_WORKER_IMAGE,
    labels: dict[str, str] | None = None,
    owner_references: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One keda.sh/v1alpha1 ScaledObject scaling `<name>-<pool>-<generation>` (`worker_image`: the
    operator's default, which the generation hashes when engine.image is unset)."""
    autoscaling = spec.autoscaling
    pool_spec = role_pool(spec, Role(pool))
    generation = kv_generation(spec, worker_image)
    return {
        "apiVersion": KEDA_API_VERSION,
        "kind": "ScaledObject",
        "metadata": _metadata(name, namespace, pool, generation, labels, owner_references),
        "spec": {
            "scaleTargetRef": _scale_target(name, pool, generation),
            "pollingInterval": autoscaling.interval_seconds,
            # Only used for the last step to zero; the windows govern everything else.
            "cooldownPeriod": autoscaling.scale_down_stabilization_seconds,
            "minReplicaCount": pool_spec.min_replicas,
            "maxReplicaCount": pool_spec.max_replicas,
            "advanced": {
                "horizontalPodAutoscalerConfig": {
                    "name": generation_pool_name(name, pool, generation),
                    "behavior": behavior(spec),
                },
            },
            "triggers": keda_triggers(spec, namespace, name, pool),
        },
    }


def _external(metric: str, selector: dict[str, str], target_type: str, target: float) -> dict[str, Any]:
    key = "averageValue" if target_type == "AverageValue" else "value"
    return {
        "type": "External",
        "external": {
            "metric": {"name": metric, "selector": {"matchLabels": selector}},
            "target": {"type": target_type, key: quantity(target)},
        },
    }


def hpa_metrics(spec: InferenceDeploymentSpec, name: str, pool: Pool) -> list[dict[str, Any]]:
    autoscaling = spec.autoscaling
    workers = {"deployment": name, "role": pool}
    router = {"deployment": name, "pool": router_pool(pool)}
    if pool == "prefill":
        waiting_target = autoscaling.prefill.waiting_per_replica
    else:
        waiting_target = autoscaling.decode.waiting_per_replica
    metrics = [
        _external("splitserve_waiting", workers, "AverageValue", waiting_target),
        _external("splitserve_router_queue", router, "AverageValue", waiting_target),
    ]
    if pool == "prefill":
        metrics.append(_external("splitserve_running", workers, "AverageValue", waiting_target))
    if pool != "prefill":
        decode = autoscaling.decode
        metrics.append(_external("splitserve_running", workers, "AverageValue", decode.running_per_replica))
        metrics.append(_external("splitserve_kv_cache_usage", workers, "Value", decode.kv_cache_usage))
        metrics.append(_external("splitserve_itl_p90", workers, "Value", decode.itl_slo_seconds))
    if pool != "decode":
        metrics.append(_external("splitserve_ttft_p90", workers, "Value", autoscaling.prefill.ttft_slo_seconds))
    return metrics


def horizontal_pod_autoscaler(
    spec: InferenceDeploymentSpec,
    namespace: str,
    name: str,
    pool: Pool,
    *,
    worker_image: str = DEFAULT_WORKER_IMAGE,
    labels: dict[str, str] | None = None,
    owner_references: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One autoscaling/v2 HorizontalPodAutoscaler on prometheus-adapter external metrics, scaling
    `<name>-<pool>-<generation>`."""
    pool_spec = role_pool(spec, Role(pool))
    generation = kv_generation(spec, worker_image)
    return {
        "apiVersion": HPA_API_VERSION,
        "kind": "HorizontalPodAutoscaler",
        "metadata": _metadata(name, namespace, pool, generation, labels, owner_references),
        "spec": {
            "scaleTargetRef": _scale_target(name, pool, generation),
            "minReplicas": max(1, pool_spec.min_replicas),
            "maxReplicas": max(1, pool_spec.max_replicas),
            "behavior": behavior(spec),
            "metrics": hpa_metrics(spec, name, pool),
        },
    }


def autoscaler_objects(
    spec: InferenceDeploymentSpec,
    namespace: str,
    name: str,
    *,
    worker_image: str = DEFAULT_WORKER_IMAGE,
    labels: dict[str, str] | None = None,
    owner_references: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """The objects for spec.autoscaling.backend (none for `builtin` or when autoscaling is off), each
    aimed at the spec's own generation; kinds AUTOSCALER_KINDS, so a rollout can leave them out."""
    autoscaling = spec.autoscaling
    if not autoscaling.enabled or autoscaling.backend == "builtin":
        return []
    build = scaled_object if autoscaling.backend == "keda" else horizontal_pod_autoscaler
    return [
        build(spec, namespace, name, pool, worker_image=worker_image, labels=labels, owner_references=owner_references)
        for pool in autoscaled_pools(spec)
    ]
