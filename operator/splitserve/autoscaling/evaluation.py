"""One autoscaling evaluation, pure: signals in, desired sizes and what to say about them out.

`splitserve.io.signals.evaluate` reads Prometheus and calls `evaluated` (or `held` when it cannot);
the controller applies `desired`, keeps `state` for the next call and writes `condition` (type
AutoscalingActive) and `status_for(...)` into the object's status.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from splitserve.api.spec import InferenceDeploymentSpec
from splitserve.api.status import AutoscalingDecision, AutoscalingStatus
from splitserve.autoscaling.decision import AutoscalerState, Decision, decide_replicas
from splitserve.autoscaling.queries import Pool, PoolSignals

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


def held(
    spec: InferenceDeploymentSpec,
    current: Mapping[str, int],
    state: AutoscalerState,
    now: float,
    reason: str,
    why: str,
    *,
    ready: Mapping[str, int] | None = None,
) -> Evaluation:
    """No signals could be read (`reason` PrometheusUnavailable or InvalidQuery): hold the sizes, say why."""
    decision = decide_replicas(spec, current, {}, state, now, ready=ready)
    return Evaluation(
        state=decision.state,
        desired=decision.desired,
        reasons=decision.reasons,
        condition=ConditionValue("False", reason, f"holding current sizes: {why}"[:1024]),
        decision=decision,
        signals={},
    )


def evaluated(
    spec: InferenceDeploymentSpec,
    current: Mapping[str, int],
    signals: Mapping[Pool, PoolSignals | None],
    state: AutoscalerState,
    now: float,
    *,
    ready: Mapping[str, int] | None = None,
) -> Evaluation:
    """Decide from the pools' signals; the condition says whether any pool was held for missing data.

    `current`: each pool's Deployment spec.replicas; `ready` (optional, recommended): its
    status.readyReplicas, so a scale-up that is still starting is not compounded.
    """
    decision = decide_replicas(spec, current, signals, state, now, ready=ready)
    flat: dict[str, float] = {}
    for pool, pool_signals in signals.items():
        if pool_signals is not None:
            flat.update(pool_signals.as_dict(prefix=f"{pool}."))
    held_pools = [p.pool for p in decision.pools if p.held]
    message = "; ".join(decision.reasons.values())
    if held_pools:
        condition = ConditionValue("True", "MetricsIncomplete", f"holding {', '.join(held_pools)}: {message}"[:1024])
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
