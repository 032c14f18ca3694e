"""The autoscaling decision: pure, deterministic, no I/O, no clocks, no globals.

`decide_replicas(spec, current, signals, state, now)` → `Decision` (desired replicas per pool, a reason
string per pool, and the next `AutoscalerState`). The operator keeps the state between calls
(in memory or as JSON in an annotation); nothing else is remembered.

Pools are `prefill` and `decode` (disaggregated) or `aggregated` (which uses the decode pool spec
and targets plus the prefill TTFT SLO). How one pool's size is chosen (in this order):

1. **Hold** when its data is missing or stale: Prometheus unavailable (signals None), a required
   signal absent/NaN (prefill: `waiting`; decode/aggregated: `waiting` and `running`), or the
   newest worker sample older than `stale_after_seconds`. A held pool keeps its size (only
   clamped into [minReplicas, maxReplicas]) and adds nothing to the history.
2. **Proposals**, one per signal, each like a Kubernetes HPA metric:
   - load totals (prefill: prompts not yet answered = router queue + vLLM waiting + vLLM running,
     target `waitingPerReplica` — vLLM admits prompts into "running" and works through them by
     chunked prefill, so on a prefill worker running prompts are queued work too; decode: running,
     target `runningPerReplica`): `ceil(total / target)` — HPA's AverageValue;
   - decode's queue (router queue + waiting): above `waitingPerReplica` per replica the pool is
     saturated and is sized so running + waiting fit at `runningPerReplica` (see `_saturation`);
   - decode KV cache usage (mean over replicas), target `kvCacheUsage`: `ceil(current * usage / target)`
     — HPA's Utilization;
   - latency p90 against its SLO (prefill TTFT, decode ITL; the aggregated pool: both), like a
     utilization: `ceil(ready * latency / SLO)`, growth capped at 2x per decision (usage and
     latency scale from the ready replicas when the caller passes them, so a scale-up that is still
     starting is not compounded; without `ready`, from `current`). Below the SLO
     this proposes the size at which latency, if it scaled with load per replica, would just meet
     the SLO; real latency has a floor (prompt compute, one decode step) so that projection is
     pessimistic, and a scale-down it allows does not bounce back up. Above the SLO it grows the
     pool proportionally (it cannot help when the floor alone exceeds the SLO: prompts too long
     for the TTFT target; the pool then goes to maxReplicas and diagnosis should say why).
   A proposal whose value/target ratio is within ±tolerance proposes `current` (the tolerance
   band: a steady load sitting on a threshold never flips the size). Below the band a signal
   proposes the size at which it would sit at the band's bottom, target*(1-tolerance), not at the
   target itself (hysteresis: after a scale-down the value rises by the removed share and must
   still be inside the band, or the next evaluation would scale straight back up).
   The recommendation is the largest proposal, clamped into [minReplicas, maxReplicas].
3. **Stabilization** (HPA's algorithm): up = min of the recommendations over the scale-up window,
   down = max over the scale-down window; grow to `up` if below it, shrink to `down` if above it.
   Fast up (window 0 by default), slow down (300 s by default). Then the **flap guard** (see
   `FlapGuard`): after a load-driven scale-up from size s, the pool does not go back to s until its
   load at the new size has fallen by more than the tolerance (or fits two below s).
4. **Prefill:decode ratio bounds** (disaggregated, optional): the smaller side is raised (never
   lowered: that could drop capacity the load needs) until min ≤ prefill/decode ≤ max.
5. **Step limit**: at most `maxStep` replicas added or removed per decision.
6. **Scale from zero**: a pool at 0 with a backlog (router queue or waiting; prefill: also
   running, and `prefillFallbacks`) > 0 gets at least 1.

A prefill pool at zero has no queue to show: the router serves every request aggregated on decode
at once (fallback `prefill_unavailable`) instead of holding it for a prefill worker. Its demand is
then `prefillFallbacks` (requests served without prefill in the last minute): while the pool is at
0 any such request proposes 1 replica (it goes into the history, so the scale-down window keeps the
new replica while it starts) and counts as backlog for rule 6. Once the pool has a replica the
signal proposes nothing: fallbacks go on until the new worker is ready, and sizing on them would
overshoot; the pool's own queue takes over.
7. Final clamp into [minReplicas, maxReplicas] (bounds always hold, even over the step limit).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from splitserve.api.spec import InferenceDeploymentSpec, PoolSpec, Role
from splitserve.api.topology import role_pool
from splitserve.autoscaling.queries import Pool, PoolSignals, autoscaled_pools

STATE_VERSION = 1
# Runs of equal recommendations are stored once, so this only bounds pathological churn.
MAX_HISTORY_ENTRIES = 256
LATENCY_MAX_GROWTH = 2.0
# Absorbs float noise such as 0.1 * 3 / 0.1 = 3.0000000000000004 before a ceil.
_EPSILON = 1e-9


# --------------------------------------------------------------------------- state


@dataclass(frozen=True)
class Recommendation:
    """A run of equal recommendations, stored by the time of its last member (exact for max/min windows)."""

    time: float
    replicas: int


@dataclass(frozen=True)
class FlapGuard:
    """After a load-driven scale-up from `floor - 1`, that size is known to be too small.

    The pool stays at `floor` or above until its load *at this size* falls by more than the
    tolerance below `reference`, the load measured here once the scale-down window has passed
    since `since` (the new replicas have had time to start and the queue to drain), or until the
    recommendation falls at least two below the floor (the traffic has gone; the flap this guards
    against is the one-step swing between floor - 1 and floor). Without it a
    queue that grows faster than linearly as replicas are removed makes "scale down, overload,
    scale up" repeat every scale-down window at a perfectly steady load.
    """

    floor: int
    since: float
    reference: float | None = None


@dataclass(frozen=True)
class AutoscalerState:
    """Recommendation history and flap guards per pool: the only memory the decision has.

    Immutable; JSON-serialisable (`to_json` / `from_json`).
    """

    history: tuple[tuple[str, tuple[Recommendation, ...]], ...] = ()
    guards: tuple[tuple[str, FlapGuard], ...] = ()

    def entries(self, pool: str) -> tuple[Recommendation, ...]:
        for name, entries in self.history:
            if name == pool:
                return entries
        return ()

    def guard(self, pool: str) -> FlapGuard | None:
        for name, guard in self.guards:
            if name == pool:
                return guard
        return None

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": STATE_VERSION,
                "history": {pool: [[r.time, r.replicas] for r in entries] for pool, entries in self.history},
                "guards": {pool: [g.floor, g.since, g.reference] for pool, g in self.guards},
            },
            separators=(",", ":"),
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> AutoscalerState:
        """Parse `to_json` output; raises ValueError on anything else."""
        try:
            raw = json.loads(text)
            if raw.get("version") != STATE_VERSION:
                raise ValueError(f"unsupported autoscaler state version {raw.get('version')!r}")
            history = tuple(
                (str(pool), tuple(Recommendation(float(t), int(n)) for t, n in entries))
                for pool, entries in sorted(raw["history"].items())
            )
            guards = tuple(
                (str(pool), FlapGuard(int(floor), float(since), None if ref is None else float(ref)))
                for pool, (floor, since, ref) in sorted(raw.get("guards", {}).items())
            )
        except (AttributeError, KeyError, TypeError, ValueError, json.JSONDecodeError) as exc:
            raise ValueError(f"not an autoscaler state: {exc}") from exc
        return cls(history, guards)

    @classmethod
    def from_json_or_empty(cls, text: str | None) -> AutoscalerState:
        """For state kept in an annotation: a missing or corrupted value starts with an empty history."""
        if not text:
            return cls()
        try:
            return cls.from_json(text)
        except ValueError:
            return cls()


def _record(
    entries: tuple[Recommendation, ...], now: float, replicas: int, keep_seconds: float
) -> tuple[Recommendation, ...]:
    kept = [r for r in entries if r.time >= now - keep_seconds and r.time <= now]
    if kept and kept[-1].replicas == replicas:
        kept[-1] = Recommendation(now, replicas)
    else:
        kept.append(Recommendation(now, replicas))
    return tuple(kept[-MAX_HISTORY_ENTRIES:])


# --------------------------------------------------------------------------- output


@dataclass(frozen=True)
class PoolDecision:
    pool: str
    current: int
    desired: int
    recommendation: int | None  # before stabilization/step/ratio; None when held
    held: bool
    reason: str
    signals: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    state: AutoscalerState
    pools: tuple[PoolDecision, ...]

    @property
    def desired(self) -> dict[str, int]:
        return {p.pool: p.desired for p in self.pools}

    @property
    def reasons(self) -> dict[str, str]:
        return {p.pool: p.reason for p in self.pools}

    @property
    def changed(self) -> dict[str, int]:
        return {p.pool: p.desired for p in self.pools if p.desired != p.current}


# --------------------------------------------------------------------------- proposals


@dataclass(frozen=True)
class _Proposal:
    replicas: int
    text: str
    ratio: float  # value / (target for the current size): the load the flap guard compares
    is_load: bool = True  # latency has a floor that does not fall with load: not for the flap guard


def _ceil(x: float) -> int:
    return max(0, math.ceil(x - _EPSILON))


def _within(ratio: float, tolerance: float) -> bool:
    return abs(ratio - 1.0) <= tolerance


def _fmt(x: float) -> str:
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"


def _proportional(
    ratio: float, current: int, tolerance: float, growth_cap: float = math.inf, base: int | None = None
) -> int:
    """HPA's rule with a hysteresis band: value/target within ±tolerance keeps the size; above it
    grows to where the value would meet the target; below it shrinks only to where the value would
    sit at the bottom of the band (1 - tolerance), so the next evaluation does not grow it back.

    `base` is the number of replicas that produced the value (the ready ones). While a scale-up is
    still starting, a latency or usage measured on the old capacity must not be multiplied by the
    new size again (that compounds into an overshoot to maxReplicas); it then only keeps the size.
    """
    base = current if base is None else min(base, current)
    if _within(ratio, tolerance):
        return current
    if ratio > 1.0:
        return max(current if base < current else 0, _ceil(base * min(ratio, growth_cap)))
    return _ceil(base * ratio / (1.0 - tolerance))


def _average_value(label: str, total: float, target: float, current: int, tolerance: float) -> _Proposal:
    if current > 0:
        ratio = total / (target * current)
        replicas = _proportional(ratio, current, tolerance)
    else:
        ratio = math.inf if total > 0 else 0.0
        replicas = _ceil(total / target)
    return _Proposal(replicas, f"{label}={_fmt(total)} (target {_fmt(target)}/replica → {replicas})", ratio)


def _utilization(
    label: str, usage: float, target: float, current: int, tolerance: float, ready: int | None = None
) -> _Proposal | None:
    if current <= 0 or ready == 0:
        return None
    replicas = _proportional(usage / target, current, tolerance, base=ready)
    return _Proposal(replicas, f"{label}={_fmt(usage)} (target {_fmt(target)} → {replicas})", usage / target)


def _latency(
    label: str, seconds: float, slo: float, current: int, tolerance: float, ready: int | None = None
) -> _Proposal | None:
    if current <= 0 or ready == 0:
        return None
    replicas = _proportional(seconds / slo, current, tolerance, LATENCY_MAX_GROWTH, base=ready)
    return _Proposal(replicas, f"{label}={_fmt(seconds)}s (SLO {_fmt(slo)}s → {replicas})", seconds / slo, False)


def _saturation(
    backlog: float,
    running: float,
    waiting_target: float,
    running_target: float,
    current: int,
    tolerance: float,
    ready: int | None = None,
) -> _Proposal | None:
    """Decode's queue: above `waitingPerReplica` per replica the pool is saturated, and it is sized
    so that running + waiting fit at `runningPerReplica` (at least one more replica, unless replicas
    asked for are still starting: then the queue is expected). A queue is a backlog, not a steady
    load: sizing it at waitingPerReplica (KEDA's recipe) turns a transient queue of 100 into 50
    replicas."""
    demand = running + backlog
    if current <= 0:
        replicas = _ceil(demand / running_target)
        ratio = math.inf if backlog > 0 else 0.0
    else:
        ratio = backlog / (waiting_target * current)
        if ratio <= 1.0 + tolerance:
            return None
        starting = ready is not None and ready < current
        replicas = max(current if starting else current + 1, _ceil(demand / running_target))
    return _Proposal(
        replicas,
        f"waiting={_fmt(backlog)} over {_fmt(waiting_target)}/replica: running+waiting={_fmt(demand)} "
        f"at {_fmt(running_target)}/replica → {replicas}",
        ratio,
    )


def _backlog(signals: PoolSignals) -> float:
    return (signals.router_queue or 0.0) + (signals.waiting or 0.0)


def _prompt_backlog(signals: PoolSignals) -> float:
    """A prefill pool's unanswered prompts: a prefill worker holds a request only until its first token."""
    return _backlog(signals) + (signals.running or 0.0)


def _prefill_backlog(signals: PoolSignals, current: int) -> float:
    """Rule 6's backlog for prefill: at zero, requests served without prefill are its demand too."""
    fallbacks = (signals.prefill_fallbacks or 0.0) if current == 0 else 0.0
    return _prompt_backlog(signals) + max(0.0, fallbacks)


def _fallback_demand(signals: PoolSignals, current: int) -> _Proposal | None:
    """A prefill pool at zero whose requests went aggregated for lack of it: one replica."""
    fallbacks = signals.prefill_fallbacks
    if current > 0 or fallbacks is None or fallbacks <= 0:
        return None
    return _Proposal(
        1, f"prefill_fallbacks={_fmt(fallbacks)} (served without prefill: no prefill worker → 1)", math.inf
    )


def stale_after_seconds(spec: InferenceDeploymentSpec) -> float:
    """Worker samples older than this are stale: three scrape intervals, at least 30 s."""
    return max(30.0, 3.0 * spec.monitoring.interval_seconds)


def _missing(pool: Pool, current: int, signals: PoolSignals | None, stale_after: float) -> str | None:
    """Why this pool's data cannot be trusted, or None when it can."""
    if signals is None:
        return "no metrics"
    if current == 0:
        # No workers, so no worker series: the router's queue (or a lingering waiting) is all there is,
        # and for prefill the requests the router served without it.
        if signals.router_queue is None and signals.waiting is None and signals.prefill_fallbacks is None:
            return "no data for routerQueue or waiting" + (" or prefillFallbacks" if pool == "prefill" else "")
        return None
    required = (
        {"waiting": signals.waiting} if pool == "prefill" else {"waiting": signals.waiting, "running": signals.running}
    )
    absent = [name for name, value in required.items() if value is None]
    if absent:
        return f"no data for {', '.join(absent)}"
    if signals.sample_age_seconds is not None and signals.sample_age_seconds > stale_after:
        return f"data stale (newest sample {_fmt(signals.sample_age_seconds)}s old > {_fmt(stale_after)}s)"
    return None


def proposals(
    pool: Pool, spec: InferenceDeploymentSpec, current: int, signals: PoolSignals, ready: int | None = None
) -> list[_Proposal]:
    """Every signal's proposal for this pool (the caller has checked the data is usable).

    `ready`: replicas serving now (None: all of `current`); usage and latency are scaled from it.
    """
    autoscaling = spec.autoscaling
    tol = autoscaling.tolerance
    out: list[_Proposal | None] = []
    if pool == "prefill":
        out.append(
            _average_value("prompts", _prompt_backlog(signals), autoscaling.prefill.waiting_per_replica, current, tol)
        )
        out.append(_fallback_demand(signals, current))
    else:
        targets = autoscaling.decode
        out.append(_average_value("running", signals.running or 0.0, targets.running_per_replica, current, tol))
        out.append(
            _saturation(
                _backlog(signals),
                signals.running or 0.0,
                targets.waiting_per_replica,
                targets.running_per_replica,
                current,
                tol,
                ready,
            )
        )
        if signals.kv_cache_usage is not None:
            out.append(_utilization("kv", signals.kv_cache_usage, targets.kv_cache_usage, current, tol, ready))
        if signals.itl_p90 is not None:
            out.append(_latency("itl_p90", signals.itl_p90, targets.itl_slo_seconds, current, tol, ready))
    if pool != "decode" and signals.ttft_p90 is not None:
        slo = autoscaling.prefill.ttft_slo_seconds
        out.append(_latency("ttft_p90", signals.ttft_p90, slo, current, tol, ready))
    return [p for p in out if p is not None]


# --------------------------------------------------------------------------- decision


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))


def _pool_spec(spec: InferenceDeploymentSpec, pool: Pool) -> PoolSpec:
    return role_pool(spec, Role(pool))


@dataclass
class _Working:
    """Mutable scratch for one pool inside one decide_replicas() call (never escapes it)."""

    pool: Pool
    current: int
    low: int
    high: int
    held: bool
    recommendation: int | None
    value: int
    texts: list[str]
    notes: list[str]
    signals: dict[str, float]
    backlog: float


def decide_replicas(
    spec: InferenceDeploymentSpec,
    current: Mapping[str, int],
    signals: Mapping[Pool, PoolSignals | None] | Mapping[str, PoolSignals | None],
    state: AutoscalerState,
    now: float,
    *,
    stale_after: float | None = None,
    ready: Mapping[str, int] | None = None,
) -> Decision:
    """One autoscaling evaluation. `now` is seconds on any monotonic-enough clock (state uses the same).

    `ready` (optional): ready replicas per pool, from the Deployments' status; latency and usage
    proposals scale from it so a scale-up that is still starting is not compounded.
    """
    autoscaling = spec.autoscaling
    stale_limit = stale_after_seconds(spec) if stale_after is None else stale_after
    up_window = float(autoscaling.scale_up_stabilization_seconds)
    down_window = float(autoscaling.scale_down_stabilization_seconds)
    keep = max(up_window, down_window)
    new_history: dict[str, tuple[Recommendation, ...]] = {name: entries for name, entries in state.history}
    new_guards: dict[str, FlapGuard | None] = {name: guard for name, guard in state.guards}

    pools: list[_Working] = []
    for pool in autoscaled_pools(spec):
        pool_spec = _pool_spec(spec, pool)
        low, high = pool_spec.min_replicas, pool_spec.max_replicas
        now_replicas = max(0, current.get(pool, pool_spec.replicas))
        pool_signals = signals.get(pool)
        work = _Working(pool, now_replicas, low, high, False, None, now_replicas, [], [], {}, 0.0)
        pools.append(work)
        if pool_signals is not None:
            work.signals = pool_signals.as_dict()
        why_not = _missing(pool, now_replicas, pool_signals, stale_limit)
        if why_not is not None or pool_signals is None:
            work.held = True
            work.texts.append(f"{why_not} → hold")
            new_history[pool] = tuple(r for r in state.entries(pool) if r.time >= now - keep)
            continue
        work.backlog = _prefill_backlog(pool_signals, now_replicas) if pool == "prefill" else _backlog(pool_signals)
        pool_ready = None if ready is None or pool not in ready else max(0, ready[pool])
        props = proposals(pool, spec, now_replicas, pool_signals, pool_ready)
        work.texts.extend(p.text for p in props)
        raw = max((p.replicas for p in props), default=now_replicas)
        recommendation = _clamp(raw, low, high)
        work.recommendation = recommendation
        entries = _record(state.entries(pool), now, recommendation, keep)
        new_history[pool] = entries
        up = min(r.replicas for r in entries if r.time >= now - up_window)
        down = max(r.replicas for r in entries if r.time >= now - down_window)
        value = now_replicas
        if value < up:
            value = up
        if value > down:
            value = down
        if value > recommendation:
            work.notes.append(f"scale-down window keeps {value} (max over {down_window:.0f}s)")
        elif value < recommendation:
            work.notes.append(f"scale-up window keeps {value} (min over {up_window:.0f}s)")
        pressure = max((p.ratio for p in props if p.is_load), default=0.0)
        guard, value = _apply_guard(
            state.guard(pool), work, value, recommendation, pressure, now, down_window, autoscaling.tolerance
        )
        new_guards[pool] = guard
        work.value = value

    _apply_ratio(spec, pools)

    for work in pools:
        if not work.held:
            stepped = _clamp(work.value, work.current - autoscaling.max_step, work.current + autoscaling.max_step)
            if stepped != work.value:
                work.notes.append(f"max step {autoscaling.max_step}")
            work.value = stepped
            if work.current == 0 and work.backlog > 0 and work.value < 1:
                work.value = 1
                work.notes.append(f"scale from zero: backlog {_fmt(work.backlog)}")
        bounded = _clamp(work.value, work.low, work.high)
        if bounded != work.value:
            work.notes.append(f"bounds [{work.low}, {work.high}]")
        work.value = bounded

    decisions = tuple(
        PoolDecision(
            pool=w.pool,
            current=w.current,
            desired=w.value,
            recommendation=w.recommendation,
            held=w.held,
            reason=_reason(w),
            signals=w.signals,
        )
        for w in pools
    )
    history = tuple(sorted((name, entries) for name, entries in new_history.items() if entries))
    guards = tuple(sorted((name, g) for name, g in new_guards.items() if g is not None))
    return Decision(AutoscalerState(history, guards), decisions)


def _apply_guard(
    guard: FlapGuard | None,
    work: _Working,
    value: int,
    recommendation: int,
    pressure: float,
    now: float,
    down_window: float,
    tolerance: float,
) -> tuple[FlapGuard | None, int]:
    """Update this pool's FlapGuard and keep the stabilized size at or above its floor."""
    current = work.current
    if guard is not None and recommendation <= guard.floor - 2:
        # The load now fits well below the size that was overloaded (the one-step flap the guard
        # exists for is recommendation == floor - 1): the traffic has gone, not a queue's swing.
        work.notes.append(f"flap guard released: load fits {recommendation} < {guard.floor - 1}")
        guard = None
    if guard is not None and current >= guard.floor:
        if guard.reference is None:
            if now - guard.since >= down_window:
                guard = FlapGuard(guard.floor, guard.since, pressure)
        elif pressure < guard.reference * (1.0 - tolerance):
            work.notes.append(f"flap guard released: load {_fmt(pressure)} < {_fmt(guard.reference)} at {current}")
            guard = None
    if guard is not None and value < guard.floor and value < current:
        value = min(guard.floor, current)
        work.notes.append(f"flap guard keeps ≥ {guard.floor} ({guard.floor - 1} was overloaded)")
    if recommendation > current >= 1 and value > current:
        floor = max(current + 1, guard.floor if guard is not None else 0)
        guard = FlapGuard(floor, now)
    return guard, value


def _apply_ratio(spec: InferenceDeploymentSpec, pools: list[_Working]) -> None:
    bounds = spec.autoscaling.prefill_decode_ratio
    by_pool = {w.pool: w for w in pools}
    prefill, decode = by_pool.get("prefill"), by_pool.get("decode")
    if bounds is None or prefill is None or decode is None or decode.value == 0:
        return
    ratio = prefill.value / decode.value
    if ratio < bounds.min and not prefill.held:
        raised = _clamp(_ceil(bounds.min * decode.value), prefill.value, prefill.high)
        if raised != prefill.value:
            prefill.notes.append(f"ratio ≥ {_fmt(bounds.min)} with decode={decode.value}")
            prefill.value = raised
    elif ratio > bounds.max and not decode.held:
        raised = _clamp(_ceil(prefill.value / bounds.max), decode.value, decode.high)
        if raised != decode.value:
            decode.notes.append(f"ratio ≤ {_fmt(bounds.max)} with prefill={prefill.value}")
            decode.value = raised


def _reason(work: _Working) -> str:
    drivers = ", ".join(work.texts) if work.texts else "no signals"
    notes = f" ({'; '.join(work.notes)})" if work.notes else ""
    return f"{work.pool}: {drivers} → {work.current}→{work.value}{notes}"
