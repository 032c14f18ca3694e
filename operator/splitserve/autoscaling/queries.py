"""The numbers the autoscaler reads, and the PromQL that reads them.

Pools and label conventions
---------------------------
Worker pods carry `splitserve.io/deployment=<name>` and `splitserve.io/role=prefill|decode|aggregated`;
the PodMonitor relabels them into the Prometheus labels `deployment` and `role` (plus the usual
`namespace`). The router exports its own gauges with a `pool` label (`prefill` or `decode`) and its
pods carry the same `splitserve.io/deployment` label. Pools are keyed by worker role, as the
Deployments are named (`<name>-prefill`, `<name>-decode`, `<name>-aggregated`); in aggregated mode
the one pool `aggregated` is fed by the router's `decode` queue.

Default queries (signal name → PromQL)
--------------------------------------
`$workers` expands to `namespace="<ns>",deployment="<name>",role="<role>"`, `$router` to
`namespace="<ns>",deployment="<name>",pool="<pool>"`; `$namespace`, `$deployment`, `$role` and
`$pool` are also available.

==================  ==============================================================================================
signal              default PromQL
==================  ==============================================================================================
routerQueue         sum(splitserve_router_queue_depth{$router})
routerInflight      sum(splitserve_router_inflight_requests{$router})
waiting             sum(vllm:num_requests_waiting{$workers})
running             sum(vllm:num_requests_running{$workers})
kvCacheUsage        avg(vllm:kv_cache_usage_perc{$workers})
ttftP90             histogram_quantile(0.9, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket{$workers}[1m])))
itlP90              histogram_quantile(0.9, sum by (le) (rate(vllm:inter_token_latency_seconds_bucket{$workers}[1m])))
sampleAgeSeconds    time() - max(timestamp(vllm:num_requests_waiting{$workers}))
prefillFallbacks    (prefill pool only) sum(clamp_min($F - ($F offset 1m or $F * 0), 0)) with
                    $F = splitserve_router_fallbacks_total{namespace="$namespace",deployment="$deployment",
                    reason="prefill_unavailable"}: requests the router served without prefill in the last
                    minute because no prefill worker was available
==================  ==============================================================================================

`prefillFallbacks` is the prefill pool's demand while it has no worker: the router then serves every
request aggregated on decode at once instead of queueing it for prefill, so the prefill router
queue stays at 0 and only this counter says prompts wanted a prefill worker. It is computed as
"value now minus value a minute ago, a series that did not exist then counting as 0" rather than
rate()/increase(): those ignore a counter's first sample, and a router that has never fallen back
creates the series at 1 with its first fallback, which is exactly the request that should bring
the prefill pool back from zero.

Override any of them with `spec.autoscaling.queries`: the key is either a signal name (applies to
every pool) or `<pool>.<signal>` (one pool only, wins over the plain name), e.g.
`{"decode.running": "sum(my_running{$workers})"}`. A query that returns no series, NaN or Inf gives
None for that signal (the decision then holds or ignores that signal; see decision.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from string import Template
from typing import Literal

from splitserve.api.spec import AutoscalingSpec, InferenceDeploymentSpec, Mode

Pool = Literal["prefill", "decode", "aggregated"]
POOLS: tuple[Pool, ...] = ("prefill", "decode", "aggregated")

SIGNAL_NAMES = (
    "routerQueue",
    "routerInflight",
    "waiting",
    "running",
    "kvCacheUsage",
    "ttftP90",
    "itlP90",
    "sampleAgeSeconds",
    "prefillFallbacks",
)
# Signals that only mean something for one pool (and are only queried for it).
POOL_ONLY_SIGNALS: dict[str, Pool] = {"prefillFallbacks": "prefill"}

# Requests served without prefill for lack of a prefill worker, by router pod, now and a minute ago.
_PREFILL_FALLBACKS = (
    'splitserve_router_fallbacks_total{namespace="$namespace",deployment="$deployment",reason="prefill_unavailable"}'
)
FALLBACKS_WINDOW = "1m"

DEFAULT_QUERIES: dict[str, str] = {
    "routerQueue": "sum(splitserve_router_queue_depth{$router})",
    "routerInflight": "sum(splitserve_router_inflight_requests{$router})",
    "waiting": "sum(vllm:num_requests_waiting{$workers})",
    "running": "sum(vllm:num_requests_running{$workers})",
    "kvCacheUsage": "avg(vllm:kv_cache_usage_perc{$workers})",
    "ttftP90": "histogram_quantile(0.9, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket{$workers}[1m])))",
    "itlP90": "histogram_quantile(0.9, sum by (le) (rate(vllm:inter_token_latency_seconds_bucket{$workers}[1m])))",
    "sampleAgeSeconds": "time() - max(timestamp(vllm:num_requests_waiting{$workers}))",
    # clamp_min per router pod: a router restart (counter reset) counts as no fallbacks, not as minus many.
    "prefillFallbacks": (
        f"sum(clamp_min({_PREFILL_FALLBACKS} - ({_PREFILL_FALLBACKS} offset {FALLBACKS_WINDOW} "
        f"or {_PREFILL_FALLBACKS} * 0), 0))"
    ),
}


@dataclass(frozen=True)
class PoolSignals:
    """One pool's numbers at one instant; None means "no data" (absent series, NaN or Inf)."""

    router_queue: float | None = None
    router_inflight: float | None = None
    waiting: float | None = None
    running: float | None = None
    kv_cache_usage: float | None = None
    ttft_p90: float | None = None
    itl_p90: float | None = None
    sample_age_seconds: float | None = None
    prefill_fallbacks: float | None = None  # prefill pool only

    def as_dict(self, prefix: str = "") -> dict[str, float]:
        """The present numbers keyed by signal name, e.g. for status.autoscaling.signals."""
        out: dict[str, float] = {}
        for field, signal in zip(fields(self), SIGNAL_NAMES, strict=True):
            value = getattr(self, field.name)
            if value is not None:
                out[prefix + signal] = float(value)
        return out


FIELD_BY_SIGNAL: dict[str, str] = {
    signal: field.name for signal, field in zip(SIGNAL_NAMES, fields(PoolSignals), strict=True)
}


def signals_for(pool: Pool) -> tuple[str, ...]:
    """The signals read for one pool: every general one, plus those that belong to this pool."""
    return tuple(s for s in SIGNAL_NAMES if POOL_ONLY_SIGNALS.get(s, pool) == pool)


def autoscaled_pools(spec: InferenceDeploymentSpec) -> tuple[Pool, ...]:
    """The pools of this mode; each is also the worker role label and the Deployment's suffix."""
    if spec.mode == Mode.AGGREGATED:
        return ("aggregated",)
    return ("prefill", "decode")


def router_pool(pool: Pool) -> str:
    """The router's `pool` label for a worker pool (aggregated workers sit in the router's decode pool)."""
    return "prefill" if pool == "prefill" else "decode"


class QueryTemplateError(ValueError):
    """A query override uses an unknown placeholder or names an unknown signal."""


def check_query_overrides(autoscaling: AutoscalingSpec) -> list[str]:
    """Problems with spec.autoscaling.queries, one readable line each (empty when fine)."""
    problems: list[str] = []
    for key, promql in autoscaling.queries.items():
        pool, _, signal = key.rpartition(".")
        if signal not in SIGNAL_NAMES or (pool and pool not in POOLS):
            problems.append(
                f"autoscaling.queries: unknown signal {key!r}; use one of {', '.join(SIGNAL_NAMES)}, "
                "optionally prefixed by 'prefill.', 'decode.' or 'aggregated.'"
            )
            continue
        only = POOL_ONLY_SIGNALS.get(signal)
        if only is not None and pool and pool != only:
            problems.append(
                f"autoscaling.queries: {key!r}: {signal} is read for the {only} pool only; "
                f"use {signal!r} or '{only}.{signal}'"
            )
            continue
        try:
            _substitute(promql, key, "ns", "name", only or "decode")
        except QueryTemplateError as exc:
            problems.append(str(exc))
    return problems


def _substitute(template: str, key: str, namespace: str, name: str, role: Pool) -> str:
    pool = router_pool(role)
    values = {
        "namespace": namespace,
        "deployment": name,
        "role": role,
        "pool": pool,
        "workers": f'namespace="{namespace}",deployment="{name}",role="{role}"',
        "router": f'namespace="{namespace}",deployment="{name}",pool="{pool}"',
    }
    try:
        return Template(template).substitute(values)
    except (KeyError, ValueError) as exc:
        raise QueryTemplateError(
            f"autoscaling.queries[{key!r}]: bad placeholder {exc}; "
            "use $workers, $router, $namespace, $deployment, $role or $pool"
        ) from exc


def query_for(autoscaling: AutoscalingSpec, signal: str, pool: Pool, namespace: str, name: str) -> str:
    """The PromQL for one signal of one pool, overrides applied and placeholders filled in."""
    key = f"{pool}.{signal}"
    template = autoscaling.queries.get(key) or autoscaling.queries.get(signal) or DEFAULT_QUERIES[signal]
    return _substitute(template, key, namespace, name, pool)


def queries_for_pool(autoscaling: AutoscalingSpec, pool: Pool, namespace: str, name: str) -> dict[str, str]:
    return {signal: query_for(autoscaling, signal, pool, namespace, name) for signal in signals_for(pool)}
