"""Dynamic optimization (spec.optimization.dynamic): decide at most one change at a time.

Pure decision logic; the operator feeds it telemetry samples over time, the state being served and the
history of changes it applied, and applies the returned `Action` (a merge patch) itself.

Rules, in the order they are checked:
1. Nothing happens unless `dynamic` is on; a kind named in `veto` is never changed (not even undone).
2. Undo: once a change has run for `evaluation_s`, its target metric (mean over the samples taken after
   `settle_s`: new replicas starting and a telemetry rate window still full of the old state say nothing
   about the new one) is compared with the baseline recorded when it was decided; worse by more than
   `worse_tolerance` -> revert it. A reverted change is not tried again for `retry_after_revert_s`.
3. Rate limit: no new change within `min_interval_s` of the last one (a change that has not been
   evaluated yet blocks everything but its own undo).
4. Sustained evidence: a change is made only when every sample in the last `window_s` (at least
   `min_samples`, all taken after the last change, observed for the whole window) supports it.
5. Hysteresis: the thresholds that turn something on and off are apart (e.g. speculative decoding on
   at batch <= 8, off at batch >= 32), so noise around one threshold cannot flap the setting.
6. Prefill-bound guard: while the window shows prompts waiting for prefill (mean TTFT inflation >=
   `disaggregate_above_inflation`, a needed prefill:decode ratio above the current one by `ratio_band`,
   or TTFT p90 over the declared TTFT SLO), speculative decoding is not turned on and the mode is not
   switched to aggregated: a decode pool starved by prefill looks idle (small batches), but neither
   change adds prefill capacity. The ratio change (or disaggregation) is the lever then.
Priority when several changes are supported: mode, then speculative decoding, then the ratio.

Target metrics: mode and ratio changes are judged on TTFT p90; speculative decoding on the p90 of each
request's time per output token (`vllm:request_time_per_output_token_seconds`), falling back to ITL p90
when that is missing. vLLM v1's `vllm:inter_token_latency_seconds` is one observation per request per
engine step whatever the number of tokens the step produced, so a speculative step looks slightly slower
on it while the time per token halves.

Note on speculative decoding: it is turned on at LOW load, unlike the source article's example of
enabling it "during peak traffic": draft-and-verify pays only while decode is memory-bandwidth-bound
(small batches); at large batches the verification work costs throughput and latency.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from splitserve.api.spec import InferenceDeploymentSpec, Mode
from splitserve.api.status import OptimizationEvent
from splitserve.diagnosis.findings import DiagnosisInput
from splitserve.diagnosis.scale import traffic_needs

ActionKind = Literal["mode", "speculativeDecoding", "ratio"]
TargetMetric = Literal["itl_p90", "tpot_p90", "ttft_p90"]


@dataclass(frozen=True)
class Sample:
    """One observation of the deployment (from the diagnosis telemetry); None means no data."""

    time: float  # seconds, any monotonic clock shared with `now`
    batch_per_replica: float | None = None  # running sequences on a decode worker
    itl_p90: float | None = None
    ttft_p90: float | None = None
    ttft_inflation: float | None = None  # TTFT p90 / prefill time p90
    needed_ratio: float | None = None  # prefill:decode replicas the traffic needs
    tpot_p90: float | None = None  # per request: decode time / (output tokens - 1)
    ttft_slo: float | None = None  # TTFT p90 the spec declares, when it declares one


@dataclass(frozen=True)
class ServingState:
    mode: Mode
    speculative_method: str  # "off", "ngram" or "draft"
    prefill_replicas: int
    decode_replicas: int
    speculative_method_when_on: str = "ngram"  # "draft" when the spec names a draft model
    # An autoscaler owns the pool sizes: the spec's replicas are not what serves, so the ratio lever
    # is the built-in autoscaler's prefill:decode bounds (None: no bounds, or a backend without them).
    autoscaled: bool = False
    ratio_bounds: tuple[float, float] | None = None

    @property
    def ratio(self) -> float:
        return self.prefill_replicas / max(1, self.decode_replicas)

    @property
    def highest_ratio(self) -> float | None:
        """The most prefill per decode replica the pools can reach now (None: no limit)."""
        if not self.autoscaled:
            return self.ratio
        return self.ratio_bounds[1] if self.ratio_bounds is not None else None


@dataclass(frozen=True)
class AutopilotPolicy:
    window_s: float = 600.0
    min_samples: int = 3
    min_interval_s: float = 1800.0
    evaluation_s: float = 900.0
    settle_s: float = 420.0  # after a change: start-up (~90 s) + one 5 m telemetry window
    worse_tolerance: float = 0.10
    retry_after_revert_s: float = 4 * 3600.0
    speculative_on_below_batch: float = 8.0
    speculative_off_above_batch: float = 32.0
    disaggregate_above_inflation: float = 2.0
    disaggregate_above_batch: float = 16.0
    aggregate_below_batch: float = 4.0
    ratio_band: float = 1.5  # change the ratio only when the need is off by more than this factor

    def __post_init__(self) -> None:
        if self.evaluation_s >= self.min_interval_s:
            raise ValueError("evaluation_s must be below min_interval_s (a change is judged before the next)")
        if self.settle_s < 0 or self.evaluation_s <= self.settle_s:
            raise ValueError("evaluation_s must exceed settle_s (samples after settling decide an undo)")
        if self.speculative_on_below_batch >= self.speculative_off_above_batch:
            raise ValueError("speculative decoding thresholds need a hysteresis gap (on below < off above)")
        if self.aggregate_below_batch >= self.disaggregate_above_batch:
            raise ValueError("mode thresholds need a hysteresis gap (aggregate below < disaggregate above)")


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    what: str
    why: str
    patch: dict[str, Any]
    undo_patch: dict[str, Any]
    target_metric: TargetMetric
    baseline: float | None  # mean of the target metric over the evidence window
    numbers: dict[str, float] = field(default_factory=dict)
    reverts: Action | None = None

    def message(self) -> str:
        """`why (numbers)`: the reason with the evidence behind it, for status and Events."""
        numbers = ", ".join(f"{key}={value:.3g}" for key, value in sorted(self.numbers.items()))
        return f"{self.why} ({numbers})" if numbers else self.why

    def to_event(self, time: str, timestamp: float = 0.0) -> OptimizationEvent:
        """The status entry; it carries everything `from_event` needs to rebuild the history."""
        return OptimizationEvent(
            time=time,
            action=self.what,
            reason=self.message(),
            reverted=self.reverts is not None,
            kind=self.kind,
            patch=self.patch,
            undo_patch=self.undo_patch,
            target_metric=self.target_metric,
            baseline=self.baseline,
            numbers=dict(self.numbers),
            timestamp=timestamp,
        )


def from_event(event: OptimizationEvent) -> AppliedAction | None:
    """A status entry back as history for `decide_optimization` (None for an entry that lacks the fields)."""
    if event.kind not in ("mode", "speculativeDecoding", "ratio") or event.patch is None or event.undo_patch is None:
        return None
    kind: ActionKind = event.kind  # type: ignore[assignment]  # checked just above
    metric: TargetMetric = (
        event.target_metric if event.target_metric in ("itl_p90", "tpot_p90") else "ttft_p90"  # type: ignore[assignment]
    )
    action = Action(
        kind=kind,
        what=event.action,
        why=event.reason,
        patch=dict(event.patch),
        undo_patch=dict(event.undo_patch),
        target_metric=metric,
        baseline=event.baseline,
        numbers=dict(event.numbers),
    )
    if event.reverted:
        # `decide_optimization` only asks whether an entry is an undo; what it undid is the same change reversed.
        undone = Action(kind, event.action, event.reason, action.undo_patch, action.patch, metric, None)
        action = replace(action, reverts=undone)
    return AppliedAction(action, event.timestamp, reverted=event.undone)


@dataclass(frozen=True)
class AppliedAction:
    action: Action
    time: float
    # The caller sets this on the original entry when it applies the undo (and appends the undo itself).
    reverted: bool = False


@dataclass(frozen=True)
class Decision:
    action: Action | None
    note: str  # why nothing was done, or what was done


def _mean(values: Sequence[float | None]) -> float | None:
    known = [value for value in values if value is not None]
    return statistics.fmean(known) if known else None


def _metric(sample: Sample, metric: TargetMetric) -> float | None:
    if metric == "tpot_p90":
        return sample.tpot_p90
    return sample.itl_p90 if metric == "itl_p90" else sample.ttft_p90


def _revert(applied: AppliedAction, post: float) -> Action:
    original = applied.action
    return Action(
        kind=original.kind,
        what=f"undo: {original.what}",
        why=f"{original.target_metric} got worse after the change",
        patch=original.undo_patch,
        undo_patch=original.patch,
        target_metric=original.target_metric,
        baseline=post,
        numbers={"before": original.baseline or 0.0, "after": post},
        reverts=original,
    )


def _recently_reverted(
    history: Sequence[AppliedAction], kind: ActionKind, patch: dict[str, Any], now: float, policy: AutopilotPolicy
) -> bool:
    return any(
        entry.reverted
        and entry.action.kind == kind
        and entry.action.patch == patch
        and now - entry.time < policy.retry_after_revert_s
        for entry in history
    )


def decide_optimization(
    *,
    dynamic: bool,
    veto: Sequence[str],
    state: ServingState,
    samples: Sequence[Sample],
    history: Sequence[AppliedAction],
    now: float,
    policy: AutopilotPolicy | None = None,
) -> Decision:
    """At most one change, or None with the reason. `history` is oldest first."""
    policy = policy or AutopilotPolicy()
    if not dynamic:
        return Decision(None, "dynamic optimization is off")
    last = history[-1] if history else None

    if last is not None and last.action.reverts is None and not last.reverted:
        age = now - last.time
        if age < policy.evaluation_s:
            return Decision(None, f"waiting {policy.evaluation_s - age:.0f}s more to evaluate: {last.action.what}")
        if age < policy.min_interval_s:
            settled = last.time + policy.settle_s
            after = [s for s in samples if settled < s.time <= now]
            post = _mean([_metric(s, last.action.target_metric) for s in after])
            baseline = last.action.baseline
            worse = (
                baseline is not None
                and post is not None
                and len(after) >= policy.min_samples
                and post > baseline * (1 + policy.worse_tolerance)
            )
            if worse and post is not None:
                if last.action.kind in veto:
                    return Decision(None, f"{last.action.what} made things worse but {last.action.kind} is vetoed")
                return Decision(_revert(last, post), f"undo {last.action.what}")
            if len(after) < policy.min_samples:
                return Decision(
                    None,
                    f"only {len(after)} samples since {last.action.what} settled (need {policy.min_samples})",
                )
            return Decision(None, f"rate limited: last change {age:.0f}s ago (min {policy.min_interval_s:.0f}s)")
    if last is not None and now - last.time < policy.min_interval_s:
        return Decision(
            None, f"rate limited: last change {now - last.time:.0f}s ago (min {policy.min_interval_s:.0f}s)"
        )

    since = last.time if last is not None else float("-inf")
    observed = [s for s in samples if since < s.time <= now]
    if not observed or now - min(s.time for s in observed) < policy.window_s:
        return Decision(None, f"not enough history: need {policy.window_s:.0f}s of samples since the last change")
    window = [s for s in observed if s.time >= now - policy.window_s]
    if len(window) < policy.min_samples:
        return Decision(None, f"only {len(window)} samples in the window (need {policy.min_samples})")

    notes: list[str] = []
    bound = prefill_bound(state, window, policy)
    for kind, propose in _PROPOSALS:
        action = propose(state, window, policy)
        if action is None:
            continue
        if bound and _starves_prefill(action):
            notes.append(f"{action.what} held back: prefill-bound ({bound})")
            continue
        if kind in veto:
            notes.append(f"{action.what} vetoed")
            continue
        if _recently_reverted(history, kind, action.patch, now, policy):
            notes.append(f"{action.what} was undone recently")
            continue
        return Decision(action, action.what)
    return Decision(None, "; ".join(notes) or "no sustained evidence for a change")


def prefill_bound(state: ServingState, window: Sequence[Sample], policy: AutopilotPolicy) -> str:
    """Why the window looks prefill-bound ("" when it does not): prompts wait for prefill capacity."""
    inflation = _mean([s.ttft_inflation for s in window])
    if inflation is not None and inflation >= policy.disaggregate_above_inflation:
        return f"TTFT inflation {inflation:.3g} >= {policy.disaggregate_above_inflation:g}"
    needs = [s.needed_ratio for s in window if s.needed_ratio is not None]
    highest = state.highest_ratio
    needed = statistics.median(needs) if needs else None
    disaggregated = state.mode is Mode.DISAGGREGATED
    if disaggregated and needed is not None and highest is not None and needed > highest * policy.ratio_band:
        return f"needed prefill:decode {needed:.3g} > {highest:.3g} x {policy.ratio_band:g}"
    ttft = _mean([s.ttft_p90 for s in window])
    slos = [s.ttft_slo for s in window if s.ttft_slo is not None]
    if ttft is not None and slos and ttft > min(slos):
        return f"TTFT p90 {ttft:.3g}s over the {min(slos):.3g}s SLO"
    return ""


def _starves_prefill(action: Action) -> bool:
    """Changes that a small decode batch suggests but that add no prefill capacity."""
    if action.kind == "speculativeDecoding":
        return bool(action.patch["engine"]["speculativeDecoding"]["method"] != "off")
    return action.kind == "mode" and action.patch.get("mode") == Mode.AGGREGATED.value


def _all(window: Sequence[Sample], test: Callable[[Sample], bool]) -> bool:
    return all(test(sample) for sample in window)


def _batch(sample: Sample) -> float:
    return sample.batch_per_replica if sample.batch_per_replica is not None else float("nan")


def _propose_mode(state: ServingState, window: Sequence[Sample], policy: AutopilotPolicy) -> Action | None:
    batch = _mean([s.batch_per_replica for s in window]) or 0.0
    inflation = _mean([s.ttft_inflation for s in window])
    to_disagg: dict[str, Any] = {"mode": Mode.DISAGGREGATED.value}
    to_agg: dict[str, Any] = {"mode": Mode.AGGREGATED.value}
    if state.mode is Mode.AGGREGATED and _all(
        window,
        lambda s: (
            s.ttft_inflation is not None
            and s.ttft_inflation >= policy.disaggregate_above_inflation
            and _batch(s) >= policy.disaggregate_above_batch
        ),
    ):
        return Action(
            "mode",
            "switch to disaggregated",
            f"TTFT inflated by prefill/decode interference under load for {policy.window_s:.0f}s",
            to_disagg,
            to_agg,
            "ttft_p90",
            _mean([s.ttft_p90 for s in window]),
            {"batch": batch, "ttft_inflation": inflation or 0.0},
        )
    if state.mode is Mode.DISAGGREGATED and _all(window, lambda s: _batch(s) <= policy.aggregate_below_batch):
        return Action(
            "mode",
            "switch to aggregated",
            f"load low for {policy.window_s:.0f}s: one pool serves it without a KV hop",
            to_agg,
            to_disagg,
            "ttft_p90",
            _mean([s.ttft_p90 for s in window]),
            {"batch": batch},
        )
    return None


def _propose_speculative(state: ServingState, window: Sequence[Sample], policy: AutopilotPolicy) -> Action | None:
    batch = _mean([s.batch_per_replica for s in window]) or 0.0
    itl = _mean([s.itl_p90 for s in window])
    tpot = _mean([s.tpot_p90 for s in window])
    # Judged on the time per output token when the engines export it (see the module docstring).
    metric: TargetMetric = "tpot_p90" if tpot is not None else "itl_p90"
    baseline = tpot if tpot is not None else itl

    def patch(method: str) -> dict[str, Any]:
        return {"engine": {"speculativeDecoding": {"method": method}}}

    numbers = {
        "batch": batch,
        **({"itl_p90": itl} if itl is not None else {}),
        **({"tpot_p90": tpot} if tpot is not None else {}),
    }
    if state.speculative_method == "off" and _all(window, lambda s: _batch(s) <= policy.speculative_on_below_batch):
        method = state.speculative_method_when_on
        return Action(
            "speculativeDecoding",
            f"turn speculative decoding on ({method})",
            f"batch <= {policy.speculative_on_below_batch:g} for {policy.window_s:.0f}s: decode is bandwidth-bound",
            patch(method),
            patch("off"),
            metric,
            baseline,
            numbers,
        )
    if state.speculative_method != "off" and _all(window, lambda s: _batch(s) >= policy.speculative_off_above_batch):
        return Action(
            "speculativeDecoding",
            "turn speculative decoding off",
            f"batch >= {policy.speculative_off_above_batch:g} for {policy.window_s:.0f}s: "
            "verification work costs throughput",
            patch("off"),
            patch(state.speculative_method),
            metric,
            baseline,
            numbers,
        )
    return None


def _propose_ratio(state: ServingState, window: Sequence[Sample], policy: AutopilotPolicy) -> Action | None:
    if state.mode is not Mode.DISAGGREGATED:
        return None
    needs = [s.needed_ratio for s in window]
    if any(need is None or need <= 0 for need in needs):
        return None
    known = [need for need in needs if need is not None]
    if state.autoscaled:
        return _propose_ratio_bounds(state, window, known, policy)
    current = state.ratio
    higher = all(need > current * policy.ratio_band for need in known)
    lower = all(need < current / policy.ratio_band for need in known)
    if not (higher or lower):
        return None
    target = statistics.median(known)
    prefill = max(1, round(state.decode_replicas * target))
    if prefill == state.prefill_replicas:
        return None
    return Action(
        "ratio",
        f"set prefill replicas {state.prefill_replicas} -> {prefill}",
        f"traffic needed prefill:decode {target:.2f} (now {current:.2f}) for {policy.window_s:.0f}s",
        {"prefill": {"replicas": prefill}},
        {"prefill": {"replicas": state.prefill_replicas}},
        "ttft_p90",
        _mean([s.ttft_p90 for s in window]),
        {"needed_ratio": target, "current_ratio": current},
    )


def _propose_ratio_bounds(
    state: ServingState, window: Sequence[Sample], needs: Sequence[float], policy: AutopilotPolicy
) -> Action | None:
    """With an autoscaler on, each pool already follows its own queue; only the ratio bounds can hold
    the ratio away from what the traffic needs. Widen the bound that does, with the band as headroom.
    """
    if state.ratio_bounds is None:
        return None
    low, high = state.ratio_bounds
    target = statistics.median(needs)
    if all(need > high * policy.ratio_band for need in needs):
        widened = (low, _round3(target * policy.ratio_band))
    elif all(need < low / policy.ratio_band for need in needs):
        widened = (_round3(target / policy.ratio_band), high)
    else:
        return None

    def bounds(pair: tuple[float, float]) -> dict[str, Any]:
        return {"autoscaling": {"prefillDecodeRatio": {"min": pair[0], "max": pair[1]}}}

    return Action(
        "ratio",
        f"widen autoscaling.prefillDecodeRatio [{low:g}, {high:g}] -> [{widened[0]:g}, {widened[1]:g}]",
        f"traffic needed prefill:decode {target:.2f}, outside the autoscaler's bounds, for {policy.window_s:.0f}s",
        bounds(widened),
        bounds((low, high)),
        "ttft_p90",
        _mean([s.ttft_p90 for s in window]),
        {"needed_ratio": target, "bound_min": low, "bound_max": high},
    )


def _round3(value: float) -> float:
    return float(f"{value:.3g}")


_PROPOSALS: tuple[
    tuple[ActionKind, Callable[[ServingState, Sequence[Sample], AutopilotPolicy], Action | None]], ...
] = (
    ("mode", _propose_mode),
    ("speculativeDecoding", _propose_speculative),
    ("ratio", _propose_ratio),
)


def state_from_spec(spec: InferenceDeploymentSpec) -> ServingState:
    """What is being served, read from the (possibly already optimized) spec."""
    speculative = spec.engine.speculative_decoding
    return ServingState(
        mode=spec.mode,
        speculative_method=speculative.method,
        prefill_replicas=spec.prefill.replicas,
        decode_replicas=spec.decode.replicas,
        speculative_method_when_on="draft" if speculative.draft_model else "ngram",
        autoscaled=spec.autoscaling.enabled,
        ratio_bounds=_builtin_ratio_bounds(spec),
    )


def _builtin_ratio_bounds(spec: InferenceDeploymentSpec) -> tuple[float, float] | None:
    """The bounds the built-in autoscaler enforces (KEDA and HPA scale each pool on its own)."""
    autoscaling = spec.autoscaling
    bounds = autoscaling.prefill_decode_ratio
    if not autoscaling.enabled or autoscaling.backend != "builtin" or bounds is None:
        return None
    return bounds.min, bounds.max


def sample_from_input(inp: DiagnosisInput, time: float) -> Sample:
    """One autopilot sample from a diagnosis input's telemetry (all None without telemetry)."""
    tel = inp.telemetry
    if tel is None:
        return Sample(time)
    ttft, prefill = tel.ttft_p90.value, tel.prefill_time_p90.value
    needs = traffic_needs(inp)
    return Sample(
        time=time,
        batch_per_replica=tel.running_per_replica.value,
        itl_p90=tel.itl_p90.value,
        tpot_p90=tel.tpot_p90.value,
        ttft_slo=_declared_ttft_slo(inp.spec),
        ttft_p90=ttft,
        ttft_inflation=ttft / prefill if ttft is not None and prefill else None,
        needed_ratio=needs[0] / needs[1] if needs is not None and needs[1] > 0 else None,
    )


def _declared_ttft_slo(spec: InferenceDeploymentSpec) -> float | None:
    """The TTFT SLO when the spec sets one (the field's default is an autoscaling target, not a promise)."""
    targets = spec.autoscaling.prefill
    return targets.ttft_slo_seconds if "ttft_slo_seconds" in targets.model_fields_set else None
