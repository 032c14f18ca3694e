"""What each pool can serve, from what it did: saturation, per-replica capacity, and where TTFT goes.

Capacity is read from the pools' own telemetry first. A saturated pool (requests queue in its
engines, or, on decode, most "running" requests wait for their KV instead of producing tokens) is
serving all it can, so its throughput over the window *is* its capacity for this workload. A pool
that is not saturated only shows a lower bound. A GPU datasheet estimate (sizing.replica_capacity)
is used only where it applies (the pool has GPUs of a known type and the model's size is known),
and is then cross-checked against the observation. Pure functions.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

from splitserve.api.spec import Mode
from splitserve.diagnosis.findings import DiagnosisInput, pool_args
from splitserve.diagnosis.sizing import precision, replica_capacity
from splitserve.diagnosis.telemetry import PoolReadings, Telemetry

SATURATED_WAITING = 0.5  # requests queued in the engine per replica, window average
QUEUE_GROWTH = 0.05  # requests/s the engine queue grows by: still filling up at the end of the window,
# counted only when the queue did not empty in the window's last quarter (a flickering queue's deriv is noise)
STALLED_SHARE = 0.5  # decode: share of running requests that produce no token (waiting on their KV)
STALLED_MIN = 1.0  # ... and at least this many, window average per replica
MIN_THROUGHPUT = 1.0  # tokens/s per replica: a saturated pool serving less is stuck, not slow (no capacity)
DATASHEET_DISAGREEMENT = 2.0  # datasheet and observation further apart than this: say so, trust the observation

Basis = Literal["observed", "lower bound", "datasheet", "unknown"]


@dataclass(frozen=True)
class PoolLoad:
    """What one pool did over the window."""

    role: str
    replicas: float
    throughput: float | None  # tokens/s, whole pool: computed prompt tokens (prefill), generated tokens (decode)
    requests_rate: float | None
    running: float
    waiting: float  # for capacity: a batch slot or KV blocks
    growth: float
    deferred: float  # waiting on something else; on decode, the prompt's KV from prefill
    decoding: float | None  # decode: requests producing tokens (Little's law: tokens/s x seconds per token)
    signs: tuple[str, ...]  # why it counts as saturated; empty when it does not

    @property
    def saturated(self) -> bool:
        return bool(self.signs)

    @property
    def stalled(self) -> float:
        """Decode requests counted as running that produced no token (waiting on a KV pull)."""
        if self.decoding is None:
            return 0.0
        return max(0.0, self.running - self.decoding)

    @property
    def unit(self) -> str:
        return "prompt tokens/s computed" if self.role == "prefill" else "tokens/s generated"


@dataclass(frozen=True)
class PoolCapacity:
    role: str
    per_replica: float | None  # tokens/s one replica serves, in the pool's unit
    basis: Basis
    source: str  # how the figure was found, for people
    load: PoolLoad | None

    @property
    def estimated(self) -> bool:
        """A figure to size replicas on (not a lower bound, not unknown)."""
        return self.per_replica is not None and self.basis in ("observed", "datasheet")


def pool_load(
    role: str, readings: PoolReadings, kv_transfer_s: float | None = None, router_inflight: float | None = None
) -> PoolLoad | None:
    """What a pool did, and why it counts as saturated. On decode, `kv_transfer_s` (the mean NIXL transfer)
    tells requests waiting on the transfer itself from requests queued for decode's KV intake, and
    `router_inflight` (requests the router has sent to decode) shows requests its servers hold before
    their engines see them."""
    if not readings.reported:
        return None
    replicas = readings.replicas.value or 1.0
    hits = readings.prefix_hits_rate.value or 0.0
    if role == "prefill":
        prompt = readings.prompt_tokens_rate.value
        throughput = None if prompt is None else max(0.0, prompt - hits)
    else:
        throughput = readings.generation_tokens_rate.value
    running = readings.running.value or 0.0
    # Only a request waiting for a batch slot or KV blocks says the engine is full; one deferred while its
    # KV arrives from prefill says the handoff takes time (the stalled sign below and the TTFT breakdown).
    if readings.waiting_for_capacity.known:
        waiting = readings.waiting_for_capacity.value or 0.0
        growth = readings.waiting_for_capacity_growth.value or 0.0
        floor = readings.waiting_for_capacity_floor.value or 0.0
    else:
        waiting = readings.waiting.value or 0.0
        growth = readings.waiting_growth.value or 0.0
        floor = readings.waiting_floor.value or 0.0
    deferred = readings.waiting_deferred.value or 0.0
    decoding = None
    if role == "decode" and throughput is not None and readings.itl_mean.value is not None:
        decoding = throughput * readings.itl_mean.value
    signs: list[str] = []
    if waiting / replicas >= SATURATED_WAITING:
        signs.append(f"{waiting:.1f} requests wait for a batch slot in its engines on average")
    elif growth >= QUEUE_GROWTH and floor > 0:
        signs.append(f"its engine queue grows by {growth:.2f} requests/s and did not empty lately")
    load = PoolLoad(
        role, replicas, throughput, readings.requests_rate.value, running, waiting, growth, deferred, decoding, ()
    )
    intake = kv_intake_queue(load, kv_transfer_s)
    if intake is not None and kv_transfer_s is not None and intake / replicas >= SATURATED_WAITING:
        signs.append(
            f"{intake:.1f} requests wait for their KV beyond the {kv_transfer_s * 1000:.0f} ms transfer itself "
            "(its KV intake queues)"
        )
    held = server_backlog(load, router_inflight)
    if (
        held is not None
        and router_inflight
        and held / replicas >= STALLED_MIN
        and held >= STALLED_SHARE * router_inflight
    ):
        signs.append(
            f"{held:.1f} of the {router_inflight:.1f} requests the router has sent it are not in its engines yet "
            "(held in vLLM's API server before the engine)"
        )
    if role == "decode" and load.stalled / replicas >= STALLED_MIN and load.stalled >= STALLED_SHARE * running:
        signs.append(f"{load.stalled:.1f} of its {running:.1f} running requests produce no token (waiting on their KV)")
    return dataclasses.replace(load, signs=tuple(signs))


def kv_intake_queue(load: PoolLoad, kv_transfer_s: float | None) -> float | None:
    """Decode requests deferred for their KV beyond those the transfers themselves account for (Little's law:
    requests/s x seconds per transfer are in flight at any time); None when the transfer time is unknown."""
    if load.role != "decode" or kv_transfer_s is None or math.isnan(kv_transfer_s) or load.deferred <= 0:
        return None
    return max(0.0, load.deferred - (load.requests_rate or 0.0) * kv_transfer_s)


def server_backlog(load: PoolLoad, router_inflight: float | None) -> float | None:
    """Decode requests the router has in flight that its engines do not count (running or waiting): accepted
    by vLLM's API server, not yet handed to the engine. None without the router's gauge."""
    if load.role != "decode" or router_inflight is None or math.isnan(router_inflight):
        return None
    return max(0.0, router_inflight - load.running - load.waiting - load.deferred)


def datasheet_capacity(inp: DiagnosisInput, role: str, context: float) -> tuple[float, str] | None:
    """Tokens/s per replica from the GPU datasheet, or None where no datasheet applies: a CPU-only pool,
    a GPU type we only assume, an unknown model size."""
    spec, facts = inp.spec, inp.facts
    role = _serving_role(inp, role)
    pool = spec.prefill if role == "prefill" else spec.decode
    choice = inp.gpus[role]
    if pool.resources.gpus == 0 or choice.assumed:
        return None
    if facts.parameter_count is None or facts.kv_shape is None:
        return None
    prec = precision(spec, facts, pool_args(spec, pool))
    capacity = replica_capacity(
        facts.parameter_count,
        prec.weight_bytes,
        facts.kv_shape.bytes_per_token(prec.kv_bytes),
        pool.tensor_parallel_size,
        choice,
        spec.autoscaling.decode.running_per_replica,
        context,
    )
    value = capacity.prefill_tokens_per_s if role == "prefill" else capacity.decode_tokens_per_s
    return value, f"GPU {choice.gpu.name} datasheet ({choice.source}) and {facts.parameter_source}"


def _serving_role(inp: DiagnosisInput, role: str) -> str:
    """The pool that does a role's work: aggregated mode prefills on the decode pool."""
    return "decode" if inp.spec.mode is Mode.AGGREGATED else role


def why_no_datasheet(inp: DiagnosisInput, role: str) -> str:
    role = _serving_role(inp, role)
    pool = inp.spec.prefill if role == "prefill" else inp.spec.decode
    if pool.resources.gpus == 0:
        return "CPU-only pool: no GPU datasheet applies"
    if inp.gpus[role].assumed:
        return "GPU type unknown: no datasheet applied"
    return "model size unknown: no datasheet estimate"


def pool_capacity(inp: DiagnosisInput, role: str, context: float) -> PoolCapacity:
    tel = inp.telemetry
    load = None
    if tel is not None:
        load = pool_load(role, tel.pool(role), tel.kv_transfer_mean.value, tel.router.decode_inflight.value)
    sheet = datasheet_capacity(inp, role, context)
    observed = None
    if load is not None and load.throughput is not None:
        observed = load.throughput / load.replicas
    if load is not None and load.saturated and observed is not None and observed < MIN_THROUGHPUT and sheet is None:
        return PoolCapacity(
            role,
            None,
            "unknown",
            f"{role} saturated but serving {observed:.2g} {load.unit}/replica: stuck, not slow "
            f"({why_no_datasheet(inp, role)})",
            load,
        )
    if load is not None and load.saturated and observed is not None and observed >= MIN_THROUGHPUT:
        source = f"observed: {role} saturated ({'; '.join(load.signs)}), serving {observed:,.0f} {load.unit}/replica"
        if sheet is not None:
            ratio = sheet[0] / observed
            agree = "agrees" if 1 / DATASHEET_DISAGREEMENT <= ratio <= DATASHEET_DISAGREEMENT else "disagrees"
            source += f"; the {sheet[1]} estimate of {sheet[0]:,.0f} {agree} ({ratio:.1f}x)"
        return PoolCapacity(role, observed, "observed", source, load)
    if sheet is not None:
        source = f"datasheet: {sheet[1]}"
        if observed is not None and observed > sheet[0] * DATASHEET_DISAGREEMENT:
            # The pool already serves more than the datasheet says it could: the estimate is wrong here.
            return PoolCapacity(
                role,
                observed,
                "lower bound",
                f"observed {observed:,.0f} {load.unit if load else ''}/replica unsaturated, above the datasheet's "
                f"{sheet[0]:,.0f} ({sheet[1]}): the datasheet does not fit this pool",
                load,
            )
        if observed is not None:
            source += f"; observed {observed:,.0f} per replica, not saturated (consistent)"
        return PoolCapacity(role, sheet[0], "datasheet", source, load)
    if observed is not None and load is not None:
        return PoolCapacity(
            role,
            observed,
            "lower bound",
            f"at least {observed:,.0f} {load.unit}/replica: observed, not saturated ({why_no_datasheet(inp, role)})",
            load,
        )
    return PoolCapacity(role, None, "unknown", f"no throughput observed; {why_no_datasheet(inp, role)}", load)


@dataclass(frozen=True)
class Offered:
    """The work the traffic brings, per pool, in the pools' units."""

    requests_rate: float
    prefill_tokens: float  # prompt tokens to compute / s (cached prefixes cost nothing)
    decode_tokens: float  # tokens to generate / s
    mean_prompt: float
    mean_output: float


def offered_load(tel: Telemetry) -> Offered | None:
    """What the clients ask for: arrivals at the router (or the engines' counters without a router)."""
    arrivals = tel.router.arrival_rate.value or tel.request_rate.value
    prompt, generated = tel.prompt_tokens_rate.value, tel.generation_tokens_rate.value
    finished = tel.output_tokens_count_rate.value or tel.request_rate.value
    if not arrivals or prompt is None or generated is None:
        return None
    hit_share = 0.0
    if tel.prefix_hits_rate.value is not None and tel.prefix_queries_rate.value:
        hit_share = min(1.0, tel.prefix_hits_rate.value / tel.prefix_queries_rate.value)
    served = tel.request_rate.value or arrivals
    mean_prompt = prompt / served
    mean_output = generated / (finished or served)
    return Offered(arrivals, arrivals * mean_prompt * (1 - hit_share), arrivals * mean_output, mean_prompt, mean_output)


def needed_replicas(capacity: PoolCapacity, tokens: float, headroom: float) -> float | None:
    """Replicas that serve `tokens`/s at `headroom` of their capacity; None when capacity is not estimated."""
    if not capacity.estimated or not capacity.per_replica:
        return None
    return tokens / (capacity.per_replica * headroom)


def roles_in_use(inp: DiagnosisInput) -> tuple[str, ...]:
    return ("decode",) if inp.spec.mode is Mode.AGGREGATED else ("prefill", "decode")


@dataclass(frozen=True)
class TtftLeg:
    name: str
    seconds: float


@dataclass(frozen=True)
class TtftBreakdown:
    """Mean TTFT as clients see it, split into the legs of a request (means add up, quantiles do not)."""

    total: float
    legs: tuple[TtftLeg, ...]

    @property
    def largest(self) -> TtftLeg:
        return max(self.legs, key=lambda leg: leg.seconds)

    def share(self, leg: TtftLeg) -> float:
        return leg.seconds / self.total if self.total > 0 else 0.0

    def text(self) -> str:
        parts = ", ".join(f"{leg.name} {leg.seconds:.2f} s ({self.share(leg):.0%})" for leg in self.legs)
        return f"mean TTFT {self.total:.2f} s = {parts}"


def ttft_breakdown(tel: Telemetry) -> TtftBreakdown | None:
    """From the router's histograms: slot waits, the prefill leg, the KV handoff; the rest is decode's first token
    in aggregated requests and the router itself. None without the router's TTFT."""
    router = tel.router
    total = router.ttft_mean.value
    if total is None or math.isnan(total) or total <= 0:
        return None
    legs = [
        TtftLeg("router queue", router.queue_wait_mean.value or 0.0),
        TtftLeg("prefill", router.prefill_leg_mean.value or 0.0),
        TtftLeg("KV handoff", router.kv_handoff_mean.value or 0.0),
    ]
    rest = total - sum(leg.seconds for leg in legs)
    if rest > 0.05 * total:
        legs.append(TtftLeg("other", rest))
    return TtftBreakdown(total, tuple(leg for leg in legs if leg.seconds > 0))
