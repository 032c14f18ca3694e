"""KEDA ScaledObjects and HPA v2 objects built from the same signals and targets as the built-in loop."""

from __future__ import annotations

from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from splitserve.api.generation import kv_generation
from splitserve.api.spec import DEFAULT_WORKER_IMAGE, InferenceDeploymentSpec
from splitserve.autoscaling.queries import query_for
from splitserve.builders.autoscalers import autoscaler_objects, horizontal_pod_autoscaler, quantity, scaled_object

POLICY = {
    "type": "object",
    "required": ["type", "value", "periodSeconds"],
    "additionalProperties": False,
    "properties": {
        "type": {"enum": ["Pods", "Percent"]},
        "value": {"type": "integer", "minimum": 1},
        "periodSeconds": {"type": "integer", "minimum": 1, "maximum": 1800},
    },
}
RULES = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "stabilizationWindowSeconds": {"type": "integer", "minimum": 0, "maximum": 3600},
        "selectPolicy": {"enum": ["Max", "Min", "Disabled"]},
        "policies": {"type": "array", "minItems": 1, "items": POLICY},
    },
}
# The ScaledObject fields these builders use, as KEDA v2 documents them (keda.sh/v1alpha1).
SCALED_OBJECT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {
            "type": "object",
            "required": ["name", "namespace"],
            "properties": {"name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63}},
        },
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "name": {"type": "string"},
                    },
                },
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 0},
                "advanced": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "horizontalPodAutoscalerConfig": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "name": {"type": "string"},
                                "behavior": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "properties": {"scaleUp": RULES, "scaleDown": RULES},
                                },
                            },
                        }
                    },
                },
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["type", "metadata"],
                        "additionalProperties": False,
                        "properties": {
                            "type": {"const": "prometheus"},
                            "name": {"type": "string"},
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            "metadata": {
                                "type": "object",
                                "required": ["serverAddress", "query", "threshold"],
                                "additionalProperties": {"type": "string"},
                                "properties": {
                                    "threshold": {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?$"},
                                    "activationThreshold": {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?$"},
                                    "ignoreNullValues": {"enum": ["true", "false"]},
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


def make_spec(backend: str = "keda", mode: str = "disaggregated", **autoscaling: Any) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.model_validate(
        {
            "model": {"name": "m", "source": {"uri": "/m"}},
            "mode": mode,
            "prefill": {"minReplicas": 0, "maxReplicas": 6, "replicas": 1},
            "decode": {"minReplicas": 1, "maxReplicas": 12, "replicas": 2},
            "autoscaling": {
                "enabled": True,
                "backend": backend,
                "scaleDownStabilizationSeconds": 600,
                "maxStep": 3,
                **autoscaling,
            },
        }
    )


def by_name(triggers: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {t["name"]: t for t in triggers}


def test_scaled_objects_per_pool_validate_and_carry_targets() -> None:
    spec = make_spec()
    objects = autoscaler_objects(spec, "serving", "llama")
    # The worker Deployments of the spec's KV generation (`<name>-<role>-<generation>`).
    generation = kv_generation(spec, DEFAULT_WORKER_IMAGE)
    names = [o["spec"]["scaleTargetRef"]["name"] for o in objects]
    assert names == [f"llama-prefill-{generation}", f"llama-decode-{generation}"]
    for obj in objects:
        jsonschema.validate(obj, SCALED_OBJECT_SCHEMA)
        assert obj["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": obj["metadata"]["name"],
        }
        behavior = obj["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 600
        assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 0
        assert behavior["scaleUp"]["policies"] == [{"type": "Pods", "value": 3, "periodSeconds": 15}]
    prefill, decode = objects
    assert (prefill["spec"]["minReplicaCount"], prefill["spec"]["maxReplicaCount"]) == (0, 6)
    assert (decode["spec"]["minReplicaCount"], decode["spec"]["maxReplicaCount"]) == (1, 12)
    decode_triggers = by_name(decode["spec"]["triggers"])
    assert set(decode_triggers) == {"backlog", "running", "kv-cache-usage", "itl-p90"}
    assert decode_triggers["running"]["metadata"]["threshold"] == "32"
    assert decode_triggers["running"]["metricType"] == "AverageValue"
    assert decode_triggers["kv-cache-usage"]["metadata"]["threshold"] == "0.8"
    assert decode_triggers["itl-p90"]["metricType"] == "Value"
    assert 'role="decode"' in decode_triggers["running"]["metadata"]["query"]
    prefill_triggers = by_name(prefill["spec"]["triggers"])
    assert set(prefill_triggers) == {"prompts", "prefill-fallbacks", "ttft-p90"}
    # Scale from zero: the prompts trigger activates on anything above 0.
    assert prefill_triggers["prompts"]["metadata"]["activationThreshold"] == "0"
    # ... and so does the router serving prompts without prefill (no queue while prefill is at 0),
    # as a 0..1 Value against 1: it can activate the pool but never asks for more than the current size.
    fallbacks = prefill_triggers["prefill-fallbacks"]
    assert (fallbacks["metricType"], fallbacks["metadata"]["threshold"]) == ("Value", "1")
    assert fallbacks["metadata"]["activationThreshold"] == "0"
    assert fallbacks["metadata"]["query"].startswith("clamp_max(")
    assert 'reason="prefill_unavailable"' in fallbacks["metadata"]["query"]
    assert 'pool="prefill"' in prefill_triggers["prompts"]["metadata"]["query"]
    assert (
        'vllm:num_requests_running{namespace="serving",deployment="llama",role="prefill"}'
        in (prefill_triggers["prompts"]["metadata"]["query"])
    )


def test_keda_uses_the_same_promql_as_the_builtin_loop_including_overrides() -> None:
    spec = make_spec(queries={"decode.running": "sum(custom_running{$workers})"})
    decode = scaled_object(spec, "serving", "llama", "decode")
    running = by_name(decode["spec"]["triggers"])["running"]["metadata"]["query"]
    assert query_for(spec.autoscaling, "running", "decode", "serving", "llama") in running
    assert 'custom_running{namespace="serving",deployment="llama",role="decode"}' in running


def test_aggregated_mode_has_one_object_with_both_latencies() -> None:
    spec = make_spec(mode="aggregated", backend="keda")
    (obj,) = autoscaler_objects(spec, "serving", "llama")
    assert obj["spec"]["scaleTargetRef"]["name"] == f"llama-aggregated-{kv_generation(spec, DEFAULT_WORKER_IMAGE)}"
    assert {"ttft-p90", "itl-p90", "running"} <= set(by_name(obj["spec"]["triggers"]))


@pytest.mark.parametrize("mode", ["disaggregated", "aggregated"])
def test_hpa_validates_strictly_against_the_kubernetes_schema(mode: str) -> None:
    spec = make_spec(backend="hpa", mode=mode, scaleDownStabilizationSeconds=7200)
    objects = autoscaler_objects(spec, "serving", "llama")
    assert objects
    for obj in objects:
        kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)
        assert obj["spec"]["minReplicas"] >= 1  # HPA cannot scale to zero
        assert obj["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 3600  # HPA's cap


def test_hpa_metrics_match_the_adapter_rules() -> None:
    spec = make_spec(backend="hpa")
    hpa = horizontal_pod_autoscaler(spec, "serving", "llama", "decode")
    metrics = {m["external"]["metric"]["name"]: m["external"] for m in hpa["spec"]["metrics"]}
    assert set(metrics) == {
        "splitserve_waiting",
        "splitserve_router_queue",
        "splitserve_running",
        "splitserve_kv_cache_usage",
        "splitserve_itl_p90",
    }
    assert metrics["splitserve_running"]["target"] == {"type": "AverageValue", "averageValue": "32"}
    assert metrics["splitserve_kv_cache_usage"]["target"] == {"type": "Value", "value": "800m"}
    assert metrics["splitserve_itl_p90"]["target"] == {"type": "Value", "value": "50m"}
    assert metrics["splitserve_router_queue"]["metric"]["selector"]["matchLabels"] == {
        "deployment": "llama",
        "pool": "decode",
    }


def test_a_broken_hpa_is_rejected_by_the_validator() -> None:
    # The validation above can fail: a misspelt field is caught in strict mode.
    hpa = horizontal_pod_autoscaler(make_spec(backend="hpa"), "serving", "llama", "decode")
    hpa["spec"]["maxReplica"] = hpa["spec"].pop("maxReplicas")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(hpa, kubernetes_validate.latest_version(), strict=True)


def test_builtin_or_disabled_builds_nothing() -> None:
    assert autoscaler_objects(make_spec(backend="builtin"), "ns", "x") == []
    disabled = make_spec().model_copy(
        update={"autoscaling": make_spec().autoscaling.model_copy(update={"enabled": False})}
    )
    assert autoscaler_objects(disabled, "ns", "x") == []


@pytest.mark.parametrize(
    ("value", "text"), [(4, "4"), (0.8, "800m"), (0.05, "50m"), (1.5, "1500m"), (0.0005, "0.0005")]
)
def test_quantities(value: float, text: str) -> None:
    assert quantity(value) == text
