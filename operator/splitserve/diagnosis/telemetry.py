"""Collect the numbers the diagnosis needs from Prometheus, each with the query that produced it.

This is the only I/O in the diagnosis besides reading files. Every query is an instant query over a
rate window (`[5m]` by default); histograms are read as p90 via `histogram_quantile`, the output-length
histogram as its raw buckets so the (pure) questions can compute a coefficient of variation. The bucket
bounds (`le`) of every histogram read as a quantile come first, in one query: a quantile is only known to
lie in its bucket, and a verdict against an SLO must know how wide that is (buckets.py).

Which series belong to the deployment: the operator's PodMonitor/ServiceMonitor copy the pods'
`splitserve.io/deployment` and `splitserve.io/role` labels into `deployment` and `role` (as the
autoscaler expects), so queries match `namespace="<ns>",deployment="<name>"`; per-pool numbers
(inter-token latency and batch size on decode, prefill time on prefill) add `role=~"..."` and fall
back to all workers when no series carries a role (a Prometheus without that relabelling). Override
the matchers with the CLI's --engine-selector / --router-selector.

Per model name (the base model and each LoRA adapter; routers run with --lora only), the router's
`splitserve_router_model_*` series are read as one `sum by (model)` vector each: vLLM counts its prefix
cache for all adapters together, so the prefix question per adapter can only be answered from them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol


class QuerySource(Protocol):
    """What the diagnosis needs from a Prometheus client (splitserve.io.prometheus)."""

    async def query_scalar(self, promql: str) -> float | None: ...

    async def query_vector(self, promql: str) -> Mapping[frozenset[tuple[str, str]], float]: ...


@dataclass(frozen=True)
class Reading:
    """One number and where it came from; value None means Prometheus had no data for it."""

    value: float | None
    query: str
    # A histogram quantile: the upper bounds (`le`) of the histogram's buckets, ascending, +Inf last; empty
    # when not read. The quantile is interpolated inside one of them (buckets.judge says what it can tell).
    buckets: tuple[float, ...] = ()

    @property
    def known(self) -> bool:
        return self.value is not None

    def evidence(self, label: str, fmt: str = "{:.3g}") -> str:
        shown = "no data" if self.value is None else fmt.format(self.value)
        return f"{label} {shown} (prometheus: {self.query})"


NO_DATA = Reading(None, "")


@dataclass(frozen=True)
class PoolReadings:
    """What one pool's engines did over the window, summed over its workers (per replica = / replicas)."""

    replicas: Reading = NO_DATA  # workers that reported in the window
    running: Reading = NO_DATA  # window average of vllm:num_requests_running, summed over workers
    waiting: Reading = NO_DATA  # the same for vllm:num_requests_waiting (queued in the engine)
    waiting_growth: Reading = NO_DATA  # requests/s the engine queue grew by over the window (deriv)
    # The fewest requests waiting at any scrape of the window's last quarter (summed over workers). An engine
    # with a free batch slot admits its queue at the next step, so above zero means the queue did not empty
    # lately: what tells a queue that grows from one that flickers (deriv of a 0/1 gauge is noise).
    waiting_floor: Reading = NO_DATA
    # vLLM splits `waiting` by reason: "capacity" (no batch slot or KV blocks: the engine is full) and
    # "deferred" (held by a transient constraint; on decode, chiefly the pull of a prompt's remote KV).
    waiting_for_capacity: Reading = NO_DATA
    waiting_for_capacity_growth: Reading = NO_DATA
    waiting_for_capacity_floor: Reading = NO_DATA
    waiting_deferred: Reading = NO_DATA
    kv_fetching: Reading = NO_DATA  # requests waiting on a KV pull (vLLM's kv_fetch_by_stage, all stages)
    prompt_tokens_rate: Reading = NO_DATA
    prefix_hits_rate: Reading = NO_DATA
    generation_tokens_rate: Reading = NO_DATA
    requests_rate: Reading = NO_DATA  # finished requests / s
    itl_mean: Reading = NO_DATA  # mean seconds between two tokens of a request (one engine step)
    queue_time_mean: Reading = NO_DATA  # mean seconds a request waited in the engine before it ran
    ttft_mean: Reading = NO_DATA  # engine-side: arrival at this engine to its first token
    ttft_p90: Reading = NO_DATA

    @property
    def reported(self) -> bool:
        return bool(self.replicas.value)


@dataclass(frozen=True)
class RouterReadings:
    """The router's view: what clients see, and the legs of a disaggregated request."""

    arrival_rate: Reading = NO_DATA  # requests received / s
    completion_rate: Reading = NO_DATA  # requests finished / s, whatever the outcome
    error_rate: Reading = NO_DATA  # requests finished with a 5xx-type outcome / s
    ttft_mean: Reading = NO_DATA
    ttft_p90: Reading = NO_DATA
    ttft_p99: Reading = NO_DATA
    itl_p90: Reading = NO_DATA
    itl_p99: Reading = NO_DATA
    queue_wait_mean: Reading = NO_DATA  # waiting for a worker slot, summed over the pools a request visits
    prefill_leg_mean: Reading = NO_DATA
    kv_handoff_mean: Reading = NO_DATA
    kv_handoff_p90: Reading = NO_DATA
    queue_depth: Reading = NO_DATA  # window average, all pools
    decode_inflight: Reading = NO_DATA  # window average of requests the router has sent to decode workers


@dataclass(frozen=True)
class ModelReadings:
    """One model name's traffic at the router (the base model or a LoRA adapter), summed over routers.

    Each reading's query selects this model alone: it gives the value read from the `sum by (model)` vector.
    """

    model: str
    requests_rate: Reading = NO_DATA  # finished requests / s, whatever the outcome
    prompt_tokens_rate: Reading = NO_DATA  # prompt tokens / s routed
    # Tokens / s the chosen worker already held in its prefix cache (where the prompt is computed: prefill
    # when split). Counted only under a policy that knows it (precise-prefix, prefix-aware).
    prefix_hit_tokens_rate: Reading = NO_DATA
    # Prompt tokens / s of the requests whose hits were counted: the share's denominator (a request routed
    # by a policy that knows no prefixes, or by a fallback, is no miss).
    prefix_lookup_tokens_rate: Reading = NO_DATA

    @property
    def prefix_hit_share(self) -> float | None:
        """Share of this model's looked-up prompt tokens found cached; None when its hits are not counted."""
        hits, looked_up = self.prefix_hit_tokens_rate.value, self.prefix_lookup_tokens_rate.value
        return None if hits is None or not looked_up else min(1.0, hits / looked_up)


@dataclass(frozen=True)
class Telemetry:
    window: str = "5m"
    # Cached prompt tokens / s and prompt tokens looked up / s, where prompts are computed: the prefill pool
    # (role prefill or aggregated) when it took prompts in the window, otherwise every engine.
    prefix_hits_rate: Reading = NO_DATA
    prefix_queries_rate: Reading = NO_DATA
    output_tokens_sum_rate: Reading = NO_DATA
    output_tokens_count_rate: Reading = NO_DATA
    # Cumulative buckets of the router's output-length histogram: (upper bound, rate); +Inf last.
    output_tokens_buckets: tuple[tuple[float, float], ...] = ()
    output_tokens_buckets_query: str = ""
    preemptions_rate: Reading = NO_DATA
    kv_usage_max: Reading = NO_DATA  # busiest worker's average over the window
    waiting_for_capacity: Reading = NO_DATA  # window average, summed over workers
    itl_p90: Reading = NO_DATA  # per request per engine step, whatever the tokens the step produced
    tpot_p90: Reading = NO_DATA  # per request: decode time / (output tokens - 1); speculative steps count
    running_per_replica: Reading = NO_DATA  # batch size: busiest worker's average over the window
    ttft_p90: Reading = NO_DATA
    prefill_time_p90: Reading = NO_DATA
    request_rate: Reading = NO_DATA
    prompt_tokens_rate: Reading = NO_DATA
    generation_tokens_rate: Reading = NO_DATA
    itl_p99: Reading = NO_DATA  # decode engines
    ttft_p99: Reading = NO_DATA  # engines
    kv_transfer_mean: Reading = NO_DATA  # NIXL: mean seconds of one KV transfer on decode
    prefill: PoolReadings = PoolReadings()
    decode: PoolReadings = PoolReadings()
    router: RouterReadings = RouterReadings()
    # Per model name the router saw traffic for (not "": names no worker serves), most requests first.
    models: tuple[ModelReadings, ...] = ()
    # Share of Prometheus' scrapes each role's targets answered in the window (`up`), lowest first. A target
    # too busy to answer its /metrics in time leaves gaps, and rates over a gappy window are partial.
    scrape_coverage: tuple[tuple[str, float], ...] = ()
    scrape_coverage_query: str = ""
    # The bucket bounds of each histogram read as a quantile (+Inf last), by metric name, and the query.
    histogram_buckets: tuple[tuple[str, tuple[float, ...]], ...] = ()
    histogram_buckets_query: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)

    def pool(self, role: str) -> PoolReadings:
        return self.prefill if role == "prefill" else self.decode


SCRAPE_COVERAGE_WARNING = 0.9


def coverage_note(tel: Telemetry) -> str | None:
    """What a person should know before trusting the rates: the targets that missed scrapes in the window."""
    gappy = [f"{role} answered {share:.0%}" for role, share in tel.scrape_coverage if share < SCRAPE_COVERAGE_WARNING]
    if not gappy:
        return None
    return (
        f"scrapes missed: {', '.join(gappy)} of its scrapes in the window, so its rates are partial "
        f"(a target too busy to answer /metrics in time; prometheus: {tel.scrape_coverage_query})"
    )


@dataclass(frozen=True)
class TelemetryScope:
    engine_selector: str
    router_selector: str
    window: str = "5m"


def default_scope(name: str, namespace: str | None, window: str = "5m") -> TelemetryScope:
    matchers = _join(f'namespace="{namespace}"' if namespace else "", f'deployment="{name}"')
    return TelemetryScope(matchers, matchers, window)


DECODE_ROLES = 'role=~"decode|aggregated"'
PREFILL_ROLES = 'role=~"prefill|aggregated"'


def _p90(metric: str, selector: str, window: str) -> str:
    return _quantile(0.9, metric, selector, window)


def _quantile(q: float, metric: str, selector: str, window: str) -> str:
    return f"histogram_quantile({q:g}, sum by (le) (rate({metric}_bucket{{{selector}}}[{window}])))"


# The histograms read as quantiles, by the selector their series are read with.
ROUTER_QUANTILE_HISTOGRAMS = (
    "splitserve_router_ttft_seconds",
    "splitserve_router_itl_seconds",
    "splitserve_router_kv_handoff_seconds",
)
ENGINE_QUANTILE_HISTOGRAMS = (
    "vllm:inter_token_latency_seconds",
    "vllm:time_to_first_token_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_time_per_output_token_seconds",
)
_QUANTILE_OF = re.compile(r"^histogram_quantile\([^,]+, sum by \(le\) \(rate\(([\w:]+)_bucket\{")


def bounds_query(router: str, engines: str) -> str:
    """How many series of each histogram have each bucket bound: one query for every histogram read."""

    def count(metrics: tuple[str, ...], selector: str) -> str:
        names = "|".join(f"{metric}_bucket" for metric in metrics)
        series = "{" + _join(f'__name__=~"{names}"', selector) + "}"
        return f'count by (histogram, le) (label_replace({series}, "histogram", "$1", "__name__", "(.+)_bucket"))'

    return f"{count(ROUTER_QUANTILE_HISTOGRAMS, router)} or {count(ENGINE_QUANTILE_HISTOGRAMS, engines)}"


def read_bounds(counts: Mapping[frozenset[tuple[str, str]], float]) -> dict[str, tuple[float, ...]]:
    """Each histogram's bounds from `bounds_query`'s answer: the bounds every series has.

    Series with other buckets (routers of two versions during an upgrade) are summed by `le` before the
    quantile, and a bound only some series have holds a partial count there. The quantile still lies within
    the bounds all of them share (their counts are whole), so those are the buckets it is known to.
    """
    by_histogram: dict[str, dict[float, float]] = {}
    for labels, count in counts.items():
        named = dict(labels)
        if "histogram" in named and "le" in named:
            by_histogram.setdefault(named["histogram"], {})[_parse_le(named["le"])] = count
    return {
        name: tuple(sorted(le for le, count in les.items() if count >= max(les.values())))
        for name, les in sorted(by_histogram.items())
    }


def _mean(metric: str, selector: str, window: str) -> str:
    """A histogram's mean over the window: means add up along a request's legs, quantiles do not."""
    return f"sum(rate({metric}_sum{{{selector}}}[{window}])) / sum(rate({metric}_count{{{selector}}}[{window}]))"


POOL_ROLES = {"prefill": 'role="prefill"', "decode": DECODE_ROLES}

# The router's per-model counters, in the order of ModelReadings' fields.
MODEL_COUNTERS = (
    ("requests_rate", "splitserve_router_model_requests_total"),
    ("prompt_tokens_rate", "splitserve_router_model_prompt_tokens_total"),
    ("prefix_hit_tokens_rate", "splitserve_router_model_prefix_hit_tokens_total"),
    ("prefix_lookup_tokens_rate", "splitserve_router_model_prefix_lookup_tokens_total"),
)


def _label_value(value: str) -> str:
    """A PromQL string literal's contents (model names are validated, but a name is a label value)."""
    return value.replace("\\", "\\\\").replace('"', '\\"')


async def read_models(source: QuerySource, selector: str, window: str) -> tuple[ModelReadings, ...]:
    """Every model name's request, prompt-token and prefix-hit rates: one `sum by (model)` query per counter."""
    values: dict[str, dict[str, float]] = {}
    for name, metric in MODEL_COUNTERS:
        answer = await source.query_vector(f"sum by (model) (rate({metric}{{{selector}}}[{window}]))")
        for labels, value in answer.items():
            model = dict(labels).get("model")
            if model:  # "" counts names no worker serves: no model's traffic
                values.setdefault(model, {})[name] = value

    def reading(model: str, counter: int) -> Reading:
        name, metric = MODEL_COUNTERS[counter]
        one = _join(selector, f'model="{_label_value(model)}"')
        return Reading(values[model].get(name), f"sum(rate({metric}{{{one}}}[{window}]))")

    models = [ModelReadings(model, *(reading(model, i) for i in range(len(MODEL_COUNTERS)))) for model in values]
    return tuple(sorted(models, key=lambda m: (-(m.requests_rate.value or 0.0), m.model)))


_DURATION = re.compile(r"(\d+)(ms|s|m|h|d|w|y)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


def window_seconds(window: str) -> float | None:
    """A Prometheus duration ("20s", "5m", "1h30m") in seconds; None when it is not one."""
    parts = _DURATION.findall(window)
    if not parts or "".join(n + u for n, u in parts) != window:
        return None
    return sum(int(number) * _UNIT_SECONDS[unit] for number, unit in parts)


def tail_of(window: str) -> str:
    """The last quarter of a window, as a Prometheus duration (at least 1 s): where "lately" is judged."""
    seconds = window_seconds(window)
    return window if seconds is None else f"{max(1, round(seconds / 4))}s"


def _join(*matchers: str) -> str:
    return ",".join(m for m in matchers if m)


def _parse_le(value: str) -> float:
    return math.inf if value in ("+Inf", "Inf", "inf") else float(value)


async def collect(source: QuerySource, scope: TelemetryScope) -> Telemetry:
    """Run every query; a query with no data gives a Reading with value None, never an exception.

    Errors from the source (Prometheus unreachable) propagate: the caller decides to run without telemetry.
    """
    e, r, w = scope.engine_selector, scope.router_selector, scope.window
    tail = tail_of(w)
    histograms_query = bounds_query(r, e)
    histogram_buckets = read_bounds(await source.query_vector(histograms_query))

    async def scalar(promql: str) -> Reading:
        histogram = _QUANTILE_OF.match(promql)
        buckets = histogram_buckets.get(histogram.group(1), ()) if histogram else ()
        return Reading(await source.query_scalar(promql), promql, buckets)

    async def first_of(*queries: str) -> Reading:
        """The first query that has data (router metrics first, engine counters as the fallback)."""
        reading = NO_DATA
        for promql in queries:
            reading = await scalar(promql)
            if reading.known:
                return reading
        return reading

    capacity = _join(e, 'reason="capacity"')
    decode, prefill = _join(e, DECODE_ROLES), _join(e, PREFILL_ROLES)
    buckets_query = f"sum by (le) (rate(splitserve_router_output_tokens_bucket{{{r}}}[{w}]))"
    raw_buckets = await source.query_vector(buckets_query)
    buckets = sorted(
        (_parse_le(dict(labels)["le"]), value) for labels, value in raw_buckets.items() if "le" in dict(labels)
    )

    async def pool(role: str) -> PoolReadings:
        sel = _join(e, POOL_ROLES[role])
        for_capacity, deferred = _join(sel, 'reason="capacity"'), _join(sel, 'reason="deferred"')
        return PoolReadings(
            replicas=await scalar(f"count(max_over_time(vllm:num_requests_running{{{sel}}}[{w}]))"),
            running=await scalar(f"sum(avg_over_time(vllm:num_requests_running{{{sel}}}[{w}]))"),
            waiting=await scalar(f"sum(avg_over_time(vllm:num_requests_waiting{{{sel}}}[{w}]))"),
            waiting_growth=await scalar(f"sum(deriv(vllm:num_requests_waiting{{{sel}}}[{w}]))"),
            waiting_floor=await scalar(f"sum(min_over_time(vllm:num_requests_waiting{{{sel}}}[{tail}]))"),
            waiting_for_capacity=await scalar(
                f"sum(avg_over_time(vllm:num_requests_waiting_by_reason{{{for_capacity}}}[{w}]))"
            ),
            waiting_for_capacity_growth=await scalar(
                f"sum(deriv(vllm:num_requests_waiting_by_reason{{{for_capacity}}}[{w}]))"
            ),
            waiting_for_capacity_floor=await scalar(
                f"sum(min_over_time(vllm:num_requests_waiting_by_reason{{{for_capacity}}}[{tail}]))"
            ),
            waiting_deferred=await scalar(
                f"sum(avg_over_time(vllm:num_requests_waiting_by_reason{{{deferred}}}[{w}]))"
            ),
            kv_fetching=await scalar(f"sum(avg_over_time(vllm:num_requests_kv_fetch_by_stage{{{sel}}}[{w}]))"),
            prompt_tokens_rate=await scalar(f"sum(rate(vllm:prompt_tokens_total{{{sel}}}[{w}]))"),
            prefix_hits_rate=await scalar(f"sum(rate(vllm:prefix_cache_hits_total{{{sel}}}[{w}]))"),
            generation_tokens_rate=await scalar(f"sum(rate(vllm:generation_tokens_total{{{sel}}}[{w}]))"),
            requests_rate=await scalar(f"sum(rate(vllm:request_success_total{{{sel}}}[{w}]))"),
            itl_mean=await scalar(_mean("vllm:inter_token_latency_seconds", sel, w)),
            queue_time_mean=await scalar(_mean("vllm:request_queue_time_seconds", sel, w)),
            ttft_mean=await scalar(_mean("vllm:time_to_first_token_seconds", sel, w)),
            ttft_p90=await scalar(_p90("vllm:time_to_first_token_seconds", sel, w)),
        )

    # Where prompts are computed: the prefill pool when it took any in the window. Decode looks up a prompt
    # whose KV it pulls as well, and misses while the pull is under way, which counted beside prefill's
    # lookups would halve the share and count every disaggregated prompt twice.
    computed = prefill
    prompt_lookups = await scalar(f"sum(rate(vllm:prefix_cache_queries_total{{{prefill}}}[{w}]))")
    if not prompt_lookups.value:
        computed = e
        prompt_lookups = await scalar(f"sum(rate(vllm:prefix_cache_queries_total{{{e}}}[{w}]))")
    failed = _join(r, 'outcome=~"upstream_error|stream_error|no_capacity"')
    decode_waits = _join(r, 'pool="decode"')
    router = RouterReadings(
        arrival_rate=await scalar(f"sum(rate(splitserve_router_prompt_tokens_count{{{r}}}[{w}]))"),
        completion_rate=await scalar(f"sum(rate(splitserve_router_requests_total{{{r}}}[{w}]))"),
        error_rate=await scalar(f"sum(rate(splitserve_router_requests_total{{{failed}}}[{w}]))"),
        ttft_mean=await scalar(_mean("splitserve_router_ttft_seconds", r, w)),
        ttft_p90=await scalar(_quantile(0.9, "splitserve_router_ttft_seconds", r, w)),
        ttft_p99=await scalar(_quantile(0.99, "splitserve_router_ttft_seconds", r, w)),
        itl_p90=await scalar(_quantile(0.9, "splitserve_router_itl_seconds", r, w)),
        itl_p99=await scalar(_quantile(0.99, "splitserve_router_itl_seconds", r, w)),
        # Per request, the waits of both pools add up: sum of the waits / requests that waited for decode.
        queue_wait_mean=await scalar(
            f"sum(rate(splitserve_router_queue_wait_seconds_sum{{{r}}}[{w}])) / "
            f"sum(rate(splitserve_router_queue_wait_seconds_count{{{decode_waits}}}[{w}]))"
        ),
        prefill_leg_mean=await scalar(_mean("splitserve_router_prefill_seconds", r, w)),
        kv_handoff_mean=await scalar(_mean("splitserve_router_kv_handoff_seconds", r, w)),
        kv_handoff_p90=await scalar(_p90("splitserve_router_kv_handoff_seconds", r, w)),
        queue_depth=await scalar(f"sum(avg_over_time(splitserve_router_queue_depth{{{r}}}[{w}]))"),
        decode_inflight=await scalar(f"sum(avg_over_time(splitserve_router_inflight_requests{{{decode_waits}}}[{w}]))"),
    )
    models = await read_models(source, r, w)
    coverage_query = f"avg by (role) (avg_over_time(up{{{e}}}[{w}]))"
    coverage = await source.query_vector(coverage_query)
    scrape_coverage = sorted(
        ((dict(labels).get("role", "target"), value) for labels, value in coverage.items()), key=lambda c: c[1]
    )
    return Telemetry(
        window=w,
        scrape_coverage=tuple(scrape_coverage),
        scrape_coverage_query=coverage_query,
        histogram_buckets=tuple(histogram_buckets.items()),
        histogram_buckets_query=histograms_query,
        prefill=await pool("prefill"),
        decode=await pool("decode"),
        router=router,
        models=models,
        itl_p99=await first_of(
            _quantile(0.99, "vllm:inter_token_latency_seconds", decode, w),
            _quantile(0.99, "vllm:inter_token_latency_seconds", e, w),
        ),
        ttft_p99=await scalar(_quantile(0.99, "vllm:time_to_first_token_seconds", e, w)),
        kv_transfer_mean=await scalar(_mean("vllm:nixl_xfer_time_seconds", decode, w)),
        prefix_hits_rate=await scalar(f"sum(rate(vllm:prefix_cache_hits_total{{{computed}}}[{w}]))"),
        prefix_queries_rate=prompt_lookups,
        output_tokens_sum_rate=await scalar(f"sum(rate(splitserve_router_output_tokens_sum{{{r}}}[{w}]))"),
        output_tokens_count_rate=await scalar(f"sum(rate(splitserve_router_output_tokens_count{{{r}}}[{w}]))"),
        output_tokens_buckets=tuple(buckets),
        output_tokens_buckets_query=buckets_query,
        preemptions_rate=await scalar(f"sum(rate(vllm:num_preemptions_total{{{e}}}[{w}]))"),
        kv_usage_max=await scalar(f"max(avg_over_time(vllm:kv_cache_usage_perc{{{e}}}[{w}]))"),
        waiting_for_capacity=await scalar(
            f"sum(avg_over_time(vllm:num_requests_waiting_by_reason{{{capacity}}}[{w}]))"
        ),
        itl_p90=await first_of(
            _p90("vllm:inter_token_latency_seconds", decode, w), _p90("vllm:inter_token_latency_seconds", e, w)
        ),
        tpot_p90=await first_of(
            _p90("vllm:request_time_per_output_token_seconds", decode, w),
            _p90("vllm:request_time_per_output_token_seconds", e, w),
        ),
        running_per_replica=await first_of(
            f"max(avg_over_time(vllm:num_requests_running{{{decode}}}[{w}]))",
            f"max(avg_over_time(vllm:num_requests_running{{{e}}}[{w}]))",
        ),
        ttft_p90=await scalar(_p90("vllm:time_to_first_token_seconds", e, w)),
        prefill_time_p90=await first_of(
            _p90("vllm:request_prefill_time_seconds", prefill, w), _p90("vllm:request_prefill_time_seconds", e, w)
        ),
        request_rate=await first_of(
            f"sum(rate(splitserve_router_prompt_tokens_count{{{r}}}[{w}]))",
            f"sum(rate(vllm:request_success_total{{{e}}}[{w}]))",
        ),
        prompt_tokens_rate=await first_of(
            f"sum(rate(splitserve_router_prompt_tokens_sum{{{r}}}[{w}]))",
            f"sum(rate(vllm:prompt_tokens_total{{{e}}}[{w}]))",
        ),
        generation_tokens_rate=await first_of(
            f"sum(rate(splitserve_router_output_tokens_sum{{{r}}}[{w}]))",
            f"sum(rate(vllm:generation_tokens_total{{{e}}}[{w}]))",
        ),
    )
