"""InferenceDeployment status: observation only, following Kubernetes API conventions.

Conditions are a list keyed by `type`; `Ready` is rolled up from PrefillReady, DecodeReady and
RouterReady the way KServe rolls its per-workload conditions. There is no `phase` enum.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from pydantic import Field

from splitserve.api.base import ApiModel
from splitserve.api.spec import MAX_ADAPTERS, MODEL_NAME_MAX_LENGTH, Opaque


class ConditionType(StrEnum):
    READY = "Ready"
    PREFILL_READY = "PrefillReady"
    DECODE_READY = "DecodeReady"
    ROUTER_READY = "RouterReady"
    PROGRESSING = "Progressing"
    DEGRADED = "Degraded"
    AUTOSCALING_ACTIVE = "AutoscalingActive"
    # Only while spec.adapters declares any: whether every worker serves every adapter.
    ADAPTERS_READY = "AdaptersReady"


ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(ApiModel):
    type: str = Field(min_length=1, max_length=316)
    status: ConditionStatus
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", max_length=1024)
    message: str = Field("", max_length=32768)
    last_transition_time: str = Field(description="RFC 3339 time of the last status change.")
    observed_generation: int = Field(0, ge=0)


class PoolStatus(ApiModel):
    replicas: int = 0
    ready_replicas: int = 0
    desired_replicas: int = 0
    summary: str = Field("0/0", description="ready/desired, for kubectl columns.")


class AutoscalingDecision(ApiModel):
    pool: str
    from_replicas: int
    to_replicas: int
    reason: str
    time: str


class AutoscalingStatus(ApiModel):
    last_decision_time: str | None = None
    last_decisions: list[AutoscalingDecision] = Field(default_factory=list, max_length=10)
    signals: dict[str, float] = Field(default_factory=dict, description="Numbers behind the last decision.")


class Finding(ApiModel):
    question: str
    verdict: str
    evidence: str = ""
    recommendation: str = ""
    patch: Opaque | None = None


class DiagnosisStatus(ApiModel):
    time: str | None = Field(
        None, description="Since when this is the diagnosis (RFC 3339): it changes with the findings."
    )
    summary: str = ""
    findings: list[Finding] = Field(default_factory=list, max_length=12)


class OptimizationEvent(ApiModel):
    """One change dynamic optimization made (or undid), with what the autopilot needs to judge it later."""

    time: str
    action: str
    reason: str
    reverted: bool = Field(False, description="This entry undoes an earlier change.")
    kind: str = Field("", description="mode, speculativeDecoding or ratio.")
    patch: Opaque | None = Field(None, description="The merge patch this change applied over the spec.")
    undo_patch: Opaque | None = Field(None, description="The merge patch that undoes it.")
    target_metric: str = Field("", description="The metric that decides whether the change is kept.")
    baseline: float | None = Field(None, description="The target metric's mean before the change.")
    numbers: dict[str, float] = Field(default_factory=dict, description="The evidence behind the change.")
    timestamp: float = Field(0.0, description="Unix time of the change (the autopilot's clock).")
    undone: bool = Field(False, description="This change was later undone because its target metric got worse.")


class AutopilotStatus(ApiModel):
    """Dynamic optimization's state. The spec stays the user's intent; what the operator serves is the
    spec deep-merged with `overrides` (minus vetoed kinds; nothing when spec.optimization.dynamic is off)."""

    overrides: Opaque = Field(
        default_factory=dict, description="Merge patch over the spec currently in effect (the applied changes)."
    )
    time: str | None = Field(None, description="RFC 3339 time of the last evaluation.")
    note: str = Field("", description="What the last evaluation decided, or why it changed nothing.")
    samples: int = Field(0, ge=0, description="Telemetry samples the autopilot holds in memory.")


class GenerationPool(ApiModel):
    role: str
    ready: int = 0
    desired: int = 0


class GenerationState(StrEnum):
    SERVING = "Serving"
    ROLLING_OUT = "RollingOut"
    DRAINING = "Draining"
    PAUSED = "Paused"


class GenerationStatus(ApiModel):
    """One KV generation of worker pools (api/generation.py) that exists in the cluster."""

    id: str
    state: GenerationState
    changed: list[str] = Field(
        default_factory=list, description="The KV-generation fields that differ from the generation it replaces."
    )
    pools: list[GenerationPool] = Field(default_factory=list)
    traffic_share: float = Field(0.0, ge=0, le=1, description="Share of decode capacity the router sends to it.")
    analysis: str = Field("", description="The rollout analysis' verdict on this generation, with its numbers.")
    since: str | None = Field(None, description="RFC 3339 time it took its current state.")


class RolloutStatus(ApiModel):
    """A rollout in progress (absent when one generation serves alone)."""

    generation: str = Field(description="The generation being rolled out (the spec's).")
    replacing: list[str] = Field(default_factory=list, description="The generations it replaces.")
    paused: bool = False
    reason: str = ""
    message: str = ""
    started: str | None = None
    summary: str = Field("", description="One line for kubectl columns, e.g. 3f2a9c01d4 1/2 (67% traffic).")


class AdapterStatus(ApiModel):
    """One declared LoRA adapter, as the serving workers report it (their splitserve.io/AdaptersReady
    pod conditions)."""

    name: str = Field(max_length=MODEL_NAME_MAX_LENGTH)
    ready_workers: int = Field(0, ge=0, description="Serving workers that have loaded the adapter.")
    workers: int = Field(0, ge=0, description="Serving workers (ready pods of every worker pool).")
    reason: str = Field(
        "",
        description="AdapterLoaded, AdapterLoading, AdapterLoadFailed, MissingVolumeClaim or NoWorkers.",
    )
    message: str = Field("", max_length=4096, description="Why it is not loaded everywhere, in words.")


class InferenceDeploymentStatus(ApiModel):
    observed_generation: int = 0
    conditions: list[Condition] = Field(default_factory=list)
    prefill: PoolStatus = Field(default_factory=PoolStatus)
    decode: PoolStatus = Field(default_factory=PoolStatus)
    router: PoolStatus = Field(default_factory=PoolStatus)
    endpoint: str = Field("", description="In-cluster URL of the router's OpenAI endpoint.")
    ready: str = Field("Unknown", description="The Ready condition's status, for kubectl columns.")
    mode: str = Field("", description="The mode being served (may differ from spec under dynamic optimization).")
    autoscaling: AutoscalingStatus | None = None
    diagnosis: DiagnosisStatus | None = None
    optimization: list[OptimizationEvent] = Field(default_factory=list, max_length=20)
    autopilot: AutopilotStatus | None = None
    kv_generation: str = Field("", description="The KV generation the spec asks for (api/generation.py).")
    generations: list[GenerationStatus] = Field(default_factory=list, max_length=8)
    rollout: RolloutStatus | None = None
    adapters: list[AdapterStatus] = Field(
        default_factory=list, max_length=MAX_ADAPTERS, description="Each adapter of spec.adapters on the workers."
    )

    def with_condition(
        self,
        kind: ConditionType | str,
        status: ConditionStatus,
        reason: str,
        message: str,
        *,
        now: str,
        generation: int,
    ) -> InferenceDeploymentStatus:
        """A copy with one condition set (like KServe's lifecycle helpers): the one of the same type is
        replaced, its lastTransitionTime kept while its status does not change."""
        condition = Condition(
            type=str(kind),
            status=status,
            reason=reason,
            message=message,
            last_transition_time=now,
            observed_generation=generation,
        )
        return self.model_copy(update={"conditions": merge_condition(self.conditions, condition)})

    def without_condition(self, kind: ConditionType | str) -> InferenceDeploymentStatus:
        """A copy without the condition of type `kind` (a part that no longer exists, e.g. adapters)."""
        return self.model_copy(update={"conditions": [c for c in self.conditions if c.type != str(kind)]})


@dataclass(frozen=True)
class Problem:
    """Why the spec cannot be realised right now (sets Degraded=True)."""

    reason: str  # CamelCase, e.g. MissingSecret
    message: str


def merge_condition(existing: Sequence[Condition], new: Condition) -> list[Condition]:
    """Replace the condition of the same type, keeping lastTransitionTime if status is unchanged."""
    result = []
    for condition in existing:
        if condition.type == new.type:
            if condition.status == new.status:
                new = new.model_copy(update={"last_transition_time": condition.last_transition_time})
            continue
        result.append(condition)
    result.append(new)
    order = {str(kind): index for index, kind in enumerate(ConditionType)}
    return sorted(result, key=lambda c: order.get(c.type, len(order)))
