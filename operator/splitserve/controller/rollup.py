"""Pure status roll-up: observed child Deployments in, InferenceDeployment status out.

Per-part conditions (PrefillReady, DecodeReady, RouterReady) roll into Ready the way KServe
does it; Progressing and Degraded follow Kubernetes API conventions. lastTransitionTime moves
only when a condition's status changes, so watchers (Argo CD, `kubectl wait`) see real edges.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from splitserve.api.spec import Mode
from splitserve.api.status import (
    ConditionStatus,
    ConditionType,
    InferenceDeploymentStatus,
    PoolStatus,
    Problem,
)


@dataclass(frozen=True)
class PoolObservation:
    desired: int
    replicas: int
    ready: int
    updated: int
    up_to_date: bool  # the Deployment controller has seen the latest template
    # The Deployment's own Progressing condition: still within its progress deadline.
    in_progress: bool = False

    @classmethod
    def from_deployment(cls, deployment: Mapping[str, Any] | None) -> PoolObservation | None:
        if deployment is None:
            return None
        spec, status = deployment.get("spec", {}), deployment.get("status", {})
        generation = deployment.get("metadata", {}).get("generation", 0)
        return cls(
            desired=int(spec.get("replicas", 1)),
            replicas=int(status.get("replicas", 0)),
            ready=int(status.get("readyReplicas", 0)),
            updated=int(status.get("updatedReplicas", 0)),
            up_to_date=int(status.get("observedGeneration", 0)) >= int(generation),
            in_progress=any(
                c.get("type") == "Progressing"
                and c.get("status") == "True"
                and c.get("reason") != "NewReplicaSetAvailable"
                for c in status.get("conditions", [])
            ),
        )

    @classmethod
    def combined(cls, deployments: Iterable[Mapping[str, Any]]) -> PoolObservation | None:
        """One role's pools of every KV generation as one pool (None: there is none): during a
        rollout the old and the new generation serve together, so the role's counts are their sums."""
        observed = [pool for pool in map(cls.from_deployment, deployments) if pool is not None]
        if not observed:
            return None
        return cls(
            desired=sum(pool.desired for pool in observed),
            replicas=sum(pool.replicas for pool in observed),
            ready=sum(pool.ready for pool in observed),
            updated=sum(pool.updated for pool in observed),
            up_to_date=all(pool.up_to_date for pool in observed),
            in_progress=any(pool.in_progress for pool in observed),
        )

    @property
    def rolling(self) -> bool:
        return not self.up_to_date or self.updated < self.desired or self.replicas > self.desired

    def to_status(self) -> PoolStatus:
        return PoolStatus(
            replicas=self.replicas,
            ready_replicas=self.ready,
            desired_replicas=self.desired,
            summary=f"{self.ready}/{self.desired}",
        )


def _still_progressing(condition: Mapping[str, Any]) -> bool:
    """A Deployment condition saying a rollout is under way and within its progress deadline."""
    return (
        condition.get("type") == "Progressing"
        and condition.get("status") == "True"
        and condition.get("reason") != "NewReplicaSetAvailable"
    )


# (type, status, reason, message) of one condition before it gets its timestamps.
ConditionValue = tuple[ConditionType, ConditionStatus, str, str]


def _pool_condition(kind: ConditionType, label: str, pool: PoolObservation | None) -> ConditionValue:
    if pool is None:
        return kind, "False", "NotCreated", f"the {label} Deployment does not exist yet"
    counts = f"{pool.ready}/{pool.desired} {label} replicas ready"
    if pool.desired == 0:
        return kind, "True", "ScaledToZero", f"{label} is scaled to zero; the router holds requests until it scales up"
    if pool.ready == 0 and (pool.in_progress or not pool.up_to_date):
        # Engines take minutes to load: not a failure until the Deployment's progress deadline.
        return kind, "Unknown", "RollingOut", f"{counts}; waiting for the engines to load"
    if pool.ready == 0:
        return kind, "False", "NoReplicasReady", counts
    if pool.ready < pool.desired:
        return kind, "True", "MinimumReplicasReady", counts
    return kind, "True", "AllReplicasReady", counts


def roll_up(
    *,
    mode: Mode,
    generation: int,
    previous: InferenceDeploymentStatus,
    prefill: PoolObservation | None,
    decode: PoolObservation | None,
    router: PoolObservation | None,
    endpoint: str,
    problem: Problem | None,
    now: str,
) -> InferenceDeploymentStatus:
    aggregated = mode == Mode.AGGREGATED
    parts: list[ConditionValue] = [
        (
            (ConditionType.PREFILL_READY, "True", "NotUsed", "aggregated mode has no prefill pool")
            if aggregated
            else _pool_condition(ConditionType.PREFILL_READY, "prefill", prefill)
        ),
        _pool_condition(ConditionType.DECODE_READY, "aggregated" if aggregated else "decode", decode),
        _pool_condition(ConditionType.ROUTER_READY, "router", router),
    ]
    failing = [kind for kind, status, _, _ in parts if status != "True"]
    ready: ConditionValue
    if problem is not None:
        ready = (ConditionType.READY, "False", problem.reason, problem.message)
    elif failing:
        messages = "; ".join(f"{kind}: {message}" for kind, status, _, message in parts if status != "True")
        # Unknown while every failing part is still rolling out (Argo CD shows Progressing, not Degraded).
        unknown = all(status == "Unknown" for _, status, _, _ in parts if status != "True")
        ready = (
            ConditionType.READY,
            "Unknown" if unknown else "False",
            f"{failing[0].removesuffix('Ready')}NotReady",
            messages,
        )
    else:
        ready = (ConditionType.READY, "True", "AllComponentsReady", "prefill, decode and router are serving")
    rolling = [pool for pool in (prefill, decode, router) if pool is not None and pool.rolling]
    progressing: ConditionValue = (
        (ConditionType.PROGRESSING, "True", "RollingOut", "replicas are being created or updated")
        if rolling or failing
        else (ConditionType.PROGRESSING, "False", "Stable", "every pool matches the spec")
    )
    degraded: ConditionValue = (
        (ConditionType.DEGRADED, "True", problem.reason, problem.message)
        if problem is not None
        else (ConditionType.DEGRADED, "False", "AsExpected", "the spec is realised")
    )
    status = previous
    for kind, value, reason, message in [ready, *parts, progressing, degraded]:
        status = status.with_condition(kind, value, reason, message, now=now, generation=generation)
    empty = PoolStatus()
    return status.model_copy(
        update={
            "observed_generation": generation,
            "prefill": prefill.to_status() if prefill and not aggregated else empty,
            "decode": decode.to_status() if decode else empty,
            "router": router.to_status() if router else empty,
            "endpoint": endpoint,
            "ready": ready[1],
            "mode": str(mode),
        }
    )
