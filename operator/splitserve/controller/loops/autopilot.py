"""Dynamic optimization in the operator: one telemetry sample per run, `decide_optimization`, and apply its Action.

The decision is pure (splitserve.optimization.autopilot). This module gathers a Sample from Prometheus
(the diagnosis telemetry), keeps a bounded window of them in memory per object, rebuilds the history
of applied changes from status.optimization, and when `decide_optimization` returns an Action it writes the new
overrides and a history entry to status (never the spec: that stays the user's intent), posts an
Event and reconciles, which renders the effective spec (see controller.effective).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from splitserve.api.patch import merge_patch
from splitserve.api.spec import InferenceDeploymentSpec
from splitserve.api.status import AutopilotStatus, InferenceDeploymentStatus, OptimizationEvent
from splitserve.controller.reconcile import Reconciler, RetryLater, read_live
from splitserve.diagnosis.findings import DiagnosisInput
from splitserve.diagnosis.model_facts import model_facts
from splitserve.diagnosis.report import gpu_choices
from splitserve.diagnosis.telemetry import QuerySource, default_scope
from splitserve.io.telemetry import gather_telemetry
from splitserve.optimization.autopilot import (
    Action,
    AppliedAction,
    AutopilotPolicy,
    Decision,
    Sample,
    decide_optimization,
    from_event,
    sample_from_input,
    state_from_spec,
)
from splitserve.optimization.overrides import (
    active_overrides,
    declared,
    minimal,
    servable,
    served_spec,
)

HISTORY_LIMIT = 20  # status.optimization's maxItems


@dataclass(frozen=True)
class AutopilotSettings:
    """Timing knobs. Production defaults are minutes; tests shrink them through the environment."""

    interval_s: float = 60.0
    telemetry_window: str = "5m"
    policy: AutopilotPolicy = field(default_factory=AutopilotPolicy)

    @property
    def max_samples(self) -> int:
        """Enough samples to cover the evidence window and the evaluation after a change, with slack."""
        span = self.policy.window_s + self.policy.min_interval_s
        return max(self.policy.min_samples * 4, min(10_000, int(span / max(self.interval_s, 0.1)) + 10))

    @classmethod
    def from_environment(cls, env: Mapping[str, str] = os.environ) -> AutopilotSettings:
        """SPLITSERVE_AUTOPILOT_INTERVAL_SECONDS, _TELEMETRY_WINDOW, and _POLICY (JSON of AutopilotPolicy fields)."""
        policy_fields = json.loads(env.get("SPLITSERVE_AUTOPILOT_POLICY") or "{}")
        return cls(
            interval_s=float(env.get("SPLITSERVE_AUTOPILOT_INTERVAL_SECONDS", "60")),
            telemetry_window=env.get("SPLITSERVE_AUTOPILOT_TELEMETRY_WINDOW", "5m"),
            policy=AutopilotPolicy(**policy_fields),
        )


def new_samples(settings: AutopilotSettings) -> deque[Sample]:
    return deque(maxlen=settings.max_samples)


def rfc3339(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def history_of(status: InferenceDeploymentStatus) -> list[AppliedAction]:
    return [applied for event in status.optimization if (applied := from_event(event)) is not None]


def record(events: list[OptimizationEvent], action: Action, now: float) -> list[OptimizationEvent]:
    """History with `action` appended; an undo marks the newest matching change as undone."""
    updated = list(events)
    if action.reverts is not None:
        for index in range(len(updated) - 1, -1, -1):
            entry = updated[index]
            if (
                entry.kind == action.kind
                and not entry.reverted
                and not entry.undone
                and entry.patch == action.undo_patch
            ):
                updated[index] = entry.model_copy(update={"undone": True})
                break
    updated.append(action.to_event(rfc3339(now), now))
    return updated[-HISTORY_LIMIT:]


async def sample_now(
    spec: InferenceDeploymentSpec, namespace: str, name: str, prometheus: QuerySource, window: str, now: float
) -> Sample:
    """One Sample from Prometheus; all None when it cannot be read (which blocks any change)."""
    url = spec.autoscaling.prometheus_url or "(no prometheusUrl)"
    telemetry, note = await gather_telemetry(prometheus, default_scope(name, namespace, window), url)
    inp = DiagnosisInput(spec, model_facts(spec), gpu_choices(spec, None), telemetry, note)
    return sample_from_input(inp, now)


async def optimize_once(
    reconciler: Reconciler,
    namespace: str,
    name: str,
    prometheus: QuerySource,
    samples: deque[Sample],
    now: float,
    settings: AutopilotSettings,
) -> Decision | None:
    """One autopilot step for one InferenceDeployment; returns the decision (None: nothing to evaluate)."""
    found = read_live(reconciler.cache, namespace, name)
    if found is None:
        return None
    body, written = found
    status = InferenceDeploymentStatus.model_validate(body.get("status") or {})
    autopilot = status.autopilot or AutopilotStatus()
    overrides = active_overrides(written, autopilot.overrides)
    serving = served_spec(written, overrides)
    # A gap (dynamic was off, the operator was busy) breaks "sustained": start the window again.
    if samples and now - samples[-1].time > 3 * settings.interval_s + 5:
        samples.clear()
    samples.append(await sample_now(serving, namespace, name, prometheus, settings.telemetry_window, now))
    decision = decide_optimization(
        dynamic=written.optimization.dynamic,
        veto=written.optimization.veto,
        state=state_from_spec(serving),
        samples=list(samples),
        history=history_of(status),
        now=now,
        policy=settings.policy,
    )
    action, note = decision.action, decision.note
    new_overrides = overrides
    if action is not None:
        new_overrides = minimal(merge_patch(overrides, action.patch), declared(written))
        invalid = servable(body, written, new_overrides)
        if invalid:
            action, note, new_overrides = None, f"not applied ({decision.note}): {invalid}"[:2000], overrides

    def update(current: InferenceDeploymentStatus) -> InferenceDeploymentStatus:
        previous = current.autopilot or AutopilotStatus()
        entry = previous.model_copy(
            update={"overrides": new_overrides, "time": rfc3339(now), "note": note, "samples": len(samples)}
        )
        changes: dict[str, Any] = {"autopilot": entry}
        if action is not None:
            changes["optimization"] = record(current.optimization, action, now)
        return current.model_copy(update=changes)

    await reconciler.update_status(namespace, name, update)
    if action is None:
        return Decision(None, note)
    reason = "OptimizationReverted" if action.reverts is not None else "Optimized"
    reconciler.metrics.optimizations.labels(action.kind, "reverted" if action.reverts else "applied").inc()
    await reconciler.post(body, "Normal", reason, f"{action.what}: {action.message()}")
    with contextlib.suppress(RetryLater):  # the owner's own handler retries; this only renders the change now
        await reconciler.reconcile_by_name(namespace, name, prune=True)
    return decision
