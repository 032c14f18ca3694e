"""One autoscaling evaluation with I/O: read Prometheus, decide, say what happened.

The controller calls `evaluate` from a timer per InferenceDeployment, applies `desired`, keeps
`state` for the next call and writes `condition` (type AutoscalingActive) and `status_for(...)`
into the object's status.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from splitserve.api.spec import InferenceDeploymentSpec
from splitserve.api.status import AutoscalingDecision, AutoscalingStatus
from splitserve.autoscaling.decision import AutoscalerState, Decision, decide
from splitserve.autoscaling.prometheus import PrometheusClient, PrometheusUnavailable
from splitserve.autoscaling.signals import Pool, PoolSignals, QueryTemplateError, read_signals

CONDITION_TYPE = "AutoscalingActive"


@dataclass(frozen=True)
class ConditionValue:
    """The AutoscalingActive condition's content; the controller adds times and generation."""

    status: Literal["True", "False"]
    reason: str
    message: str
    type: str = CONDITION_TYPE


@dataclass(frozen=True)
class Evaluation:
    state: AutoscalerState
    desired: dict[str, int]
    reasons: dict[str, str]
    condition: ConditionValue
    decision: Decision
    signals: dict[str, float]


async def evaluate(
    spec: InferenceDeploymentSpec,
    namespace: str,
    name: str,
    current: Mapping[str, int],
    state: AutoscalerState,
    now: float,
    client: PrometheusClient,
    *,
    ready: Mapping[str, int] | None = None,
) -> Evaluation:
    """Read every pool's signals and decide. Never raises for Prometheus trouble: it holds sizes instead.

    `current`: each pool's Deployment spec.replicas; `ready` (optional, recommended): its
    status.readyReplicas, so a scale-up that is still starting is not compounded.
    """
    signals: Mapping[Pool, PoolSignals | None]
    try:
        signals = await read_signals(client, spec, namespace, name)
    except (PrometheusUnavailable, QueryTemplateError) as exc:
        # Both hold the sizes; a bad override is the user's to fix (validation reports it too), so it
        # gets its own reason instead of looking like an outage.
        reason = "InvalidQuery" if isinstance(exc, QueryTemplateError) else "PrometheusUnavailable"
        decision = decide(spec, current, {}, state, now, ready=ready)
        return Evaluation(
            state=decision.state,
            desired=decision.desired,
            reasons=decision.reasons,
            condition=ConditionValue("False", reason, f"holding current sizes: {exc}"[:1024]),
            decision=decision,
            signals={},
        )
    decision = decide(spec, current, signals, state, now, ready=ready)
    flat: dict[str, float] = {}
    for pool, pool_signals in signals.items():
        if pool_signals is not None:
            flat.update(pool_signals.as_dict(prefix=f"{pool}."))
    held = [p.pool for p in decision.pools if p.held]
    message = "; ".join(decision.reasons.values())
    if held:
        condition = ConditionValue("True", "MetricsIncomplete", f"holding {', '.join(held)}: {message}"[:1024])
    else:
        condition = ConditionValue("True", "MetricsAvailable", message[:1024])
    return Evaluation(decision.state, decision.desired, decision.reasons, condition, decision, flat)


def status_for(evaluation: Evaluation, time: str, previous: AutoscalingStatus | None = None) -> AutoscalingStatus:
    """status.autoscaling after an evaluation: the signals, and the last 10 size changes (newest first)."""
    changes = [
        AutoscalingDecision(pool=p.pool, from_replicas=p.current, to_replicas=p.desired, reason=p.reason, time=time)
        for p in evaluation.decision.pools
        if p.desired != p.current
    ]
    earlier = previous.last_decisions if previous is not None else []
    return AutoscalingStatus(
        last_decision_time=time,
        last_decisions=(changes + list(earlier))[:10],
        signals=evaluation.signals,
    )
