"""The operator's periodic work for one InferenceDeployment: the built-in autoscaler and the
diagnosis (dynamic optimization is in autopilot_loop), both on the served (effective) spec. The
decisions are pure (splitserve.autoscaling, splitserve.diagnosis); this module reads the object and
Prometheus, scales through /scale and writes the status parts it owns.
"""

from __future__ import annotations

import time
from typing import Any

from splitserve.api.spec import InferenceDeploymentSpec
from splitserve.api.status import Condition, InferenceDeploymentStatus
from splitserve.autoscaling.decision import AutoscalerState
from splitserve.autoscaling.evaluate import evaluate, status_for
from splitserve.autoscaling.prometheus import PrometheusClient
from splitserve.builders.naming import pool_name, worker_roles
from splitserve.controller.effective import served_spec
from splitserve.controller.reconcile import Reconciler, read_live, utc_now
from splitserve.controller.rollup import merge_condition
from splitserve.diagnosis.service import run_diagnosis

AUTOSCALER_FIELD_MANAGER = "splitserve-autoscaler"


def builtin_autoscaling(spec: dict[str, Any]) -> bool:
    autoscaling = spec.get("autoscaling") or {}
    return bool(autoscaling.get("enabled")) and autoscaling.get("backend", "builtin") == "builtin"


async def _spec_of(
    reconciler: Reconciler, namespace: str, name: str
) -> tuple[dict[str, Any], InferenceDeploymentSpec] | None:
    found = await read_live(reconciler.kube, namespace, name)
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
    found = await _spec_of(reconciler, namespace, name)
    if found is None:
        return state
    body, spec = found
    if not spec.autoscaling.enabled or spec.autoscaling.backend != "builtin":
        return state
    current: dict[str, int] = {}
    ready: dict[str, int] = {}
    for role in worker_roles(spec):
        deployment = await reconciler.kube.get("apps/v1", "Deployment", namespace, pool_name(name, role))
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
            await reconciler.kube.scale(
                "apps/v1",
                "Deployment",
                namespace,
                pool_name(name, pool),
                desired,
                field_manager=AUTOSCALER_FIELD_MANAGER,
            )
            reason = evaluation.reasons.get(pool, "")
            await reconciler.post(
                body, "Normal", "Scaled", f"autoscaler: {pool} {current.get(pool)}→{desired}: {reason}"
            )
    stamp = utc_now()
    generation = int(body["metadata"].get("generation", 0))

    def update(status: InferenceDeploymentStatus) -> InferenceDeploymentStatus:
        condition = Condition(
            type=evaluation.condition.type,
            status=evaluation.condition.status,
            reason=evaluation.condition.reason,
            message=evaluation.condition.message,
            last_transition_time=stamp,
            observed_generation=generation,
        )
        return status.model_copy(
            update={
                "autoscaling": status_for(evaluation, stamp, status.autoscaling),
                "conditions": merge_condition(status.conditions, condition),
            }
        )

    await reconciler.update_status(namespace, name, update)
    return evaluation.state


async def diagnose_once(reconciler: Reconciler, namespace: str, name: str, prometheus: PrometheusClient | None) -> None:
    """Write the six-question diagnosis to status.diagnosis (telemetry when Prometheus answers)."""
    found = await _spec_of(reconciler, namespace, name)
    if found is None:
        return
    _, spec = found
    url = spec.autoscaling.prometheus_url if prometheus is not None else None
    report = await run_diagnosis(spec, name=name, namespace=namespace, prometheus_url=url, source=prometheus)
    diagnosis = report.status()
    await reconciler.update_status(namespace, name, lambda status: status.model_copy(update={"diagnosis": diagnosis}))
