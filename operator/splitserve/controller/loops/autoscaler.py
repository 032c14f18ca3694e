"""The operator's periodic work for one InferenceDeployment: the built-in autoscaler and the
diagnosis (dynamic optimization is in autopilot_loop), both on the served (effective) spec. The
decisions are pure (splitserve.autoscaling, splitserve.diagnosis); this module reads the object and
Prometheus, scales through /scale and writes the status parts it owns.
"""

from __future__ import annotations

import time
from typing import Any

from splitserve.api.spec import InferenceDeploymentSpec
from splitserve.api.status import InferenceDeploymentStatus
from splitserve.api.topology import Owner, generation_pool_name, worker_roles
from splitserve.autoscaling.decision import AutoscalerState
from splitserve.autoscaling.evaluation import status_for
from splitserve.builders.target import Target
from splitserve.controller.children import generations_present
from splitserve.controller.reconcile import Reconciler, read_live, scaled, utc_now
from splitserve.io.prometheus import PrometheusClient
from splitserve.io.signals import evaluate
from splitserve.optimization.overrides import served_spec

AUTOSCALER_FIELD_MANAGER = "splitserve-autoscaler"


def builtin_autoscaling(spec: dict[str, Any]) -> bool:
    autoscaling = spec.get("autoscaling") or {}
    return bool(autoscaling.get("enabled")) and autoscaling.get("backend", "builtin") == "builtin"


def spec_of(reconciler: Reconciler, namespace: str, name: str) -> tuple[dict[str, Any], InferenceDeploymentSpec] | None:
    """The object and the spec being served, from the cache."""
    found = read_live(reconciler.cache, namespace, name)
    if found is None:
        return None
    body, written = found
    # The spec being served: dynamic optimization may have switched the mode (other pools) or more.
    overrides = ((body.get("status") or {}).get("autopilot") or {}).get("overrides") or {}
    return body, served_spec(written, overrides)


async def autoscale_once(
    reconciler: Reconciler,
    namespace: str,
    name: str,
    state: AutoscalerState,
    prometheus: PrometheusClient,
    now: float | None = None,
) -> AutoscalerState:
    """One evaluation: read sizes and signals, scale pools that should change, write status."""
    found = spec_of(reconciler, namespace, name)
    if found is None:
        return state
    body, spec = found
    if not spec.autoscaling.enabled or spec.autoscaling.backend != "builtin":
        return state
    # Only the serving generation's pools are sized here; during a rollout (another generation's pools
    # exist) the rollout sizes every pool, step by step, and the autoscaler stands aside.
    serving = Target(Owner(name, namespace), spec, reconciler.images).generation
    if generations_present(reconciler.cache.owned(namespace, name)) - {serving}:
        return state
    current: dict[str, int] = {}
    ready: dict[str, int] = {}
    for role in worker_roles(spec):
        deployment = reconciler.cache.child(
            namespace, name, "apps/v1", "Deployment", generation_pool_name(name, role, serving)
        )
        if deployment is None:
            return state  # not created yet: the reconciler creates it at its declared size
        current[str(role)] = int(deployment.get("spec", {}).get("replicas", 1))
        ready[str(role)] = int((deployment.get("status") or {}).get("readyReplicas", 0))
    # Ready counts let latency and usage scale from the replicas really serving, so a scale-up
    # still loading its engines is not compounded on the next evaluation.
    evaluation = await evaluate(spec, namespace, name, current, state, now or time.time(), prometheus, ready=ready)
    metrics = reconciler.metrics
    metrics.prometheus_up.labels(namespace, name).set(
        0 if evaluation.condition.reason == "PrometheusUnavailable" else 1
    )
    for pool, desired in evaluation.desired.items():
        metrics.desired_replicas.labels(namespace, name, pool).set(desired)
    for pool, desired in evaluation.desired.items():
        if desired != current.get(pool):
            deployment_name = generation_pool_name(name, pool, serving)
            answer = await reconciler.kube.scale(
                "apps/v1", "Deployment", namespace, deployment_name, desired, field_manager=AUTOSCALER_FIELD_MANAGER
            )
            observed = reconciler.cache.child(namespace, name, "apps/v1", "Deployment", deployment_name)
            if observed is not None:
                reconciler.cache.wrote(scaled(observed, desired, answer))
            reason = evaluation.reasons.get(pool, "")
            await reconciler.post(
                body, "Normal", "Scaled", f"autoscaler: {pool} {current.get(pool)}→{desired}: {reason}"
            )
    stamp = utc_now()
    generation = int(body["metadata"].get("generation", 0))

    def update(status: InferenceDeploymentStatus) -> InferenceDeploymentStatus:
        value = evaluation.condition
        status = status.with_condition(
            value.type, value.status, value.reason, value.message, now=stamp, generation=generation
        )
        return status.model_copy(update={"autoscaling": status_for(evaluation, stamp, status.autoscaling)})

    await reconciler.update_status(namespace, name, update)
    return evaluation.state
