"""Prometheus metrics of one router (its own registry, so tests can build many routers).

Names are a contract with the dashboards and the autoscaler: see METRICS.md beside this file. The
request path's counters and histograms are fast_metrics' lock-free ones, turned into metric families
when Prometheus scrapes.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Gauge, generate_latest, multiprocess
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from splitserve.router.fast_metrics import FastCollector, FastCounter, FastHistogram, FastMetric

# Latency buckets, one list for every latency histogram (TTFT and its legs compare bucket for bucket).
# histogram_quantile only knows which bucket a quantile lies in, so a p90 is judged against an SLO only as
# finely as the bucket around it: between 10 ms and 10 s, where SLOs lie, 21 bounds a decade, at most 17%
# apart and all round, so the usual SLOs (50 ms, 0.2 s, 2 s, 2.5 s) and their doubles (the diagnosis' tail
# limit) are bounds and are judged exactly. Every bound of the lists this replaced is kept: the alert rules'
# le="2.5" and le="0.1", and a rolling upgrade sums old and new routers on those. Coarse outside: 1-7.5 ms,
# and doubling up to 640 s (long generations). Cost: 74 series per label set, ~8 label sets per router;
# observe() scans the bounds from the smallest: 0.9 us instead of 0.75 for a 30 ms ITL (per chunk), 1.75
# instead of 0.9 for a 3 s TTFT (per request). An even 10% apart would cost about as much and put hardly
# any round SLO on a bound.
_DECADE = (1.0, 1.1, 1.2, 1.3, 1.5, 1.75, 2.0, 2.25, 2.5, 2.75, 3.0, 3.5, 4.0, 4.5, 5.0, 5.5, 6.0, 7.0, 7.5, 8.0, 9.0)
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075,
    *(round(mantissa * 10.0**exponent, 6) for exponent in (-2, -1, 0) for mantissa in _DECADE),
    10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


class PoolView(Protocol):
    name: str
    inflight: int
    departing: set[Any]

    @property
    def queue_depth(self) -> int: ...

    @property
    def workers(self) -> Sequence[Any]: ...

    def kv_index_state(self) -> dict[str, tuple[int, int]]:
        """precise-prefix, per worker: (cached blocks indexed, newest event seq applied); empty otherwise."""
        ...


@dataclass(frozen=True)
class _PoolSeries:
    """One pool gauge: its name (after the prefix), help, labels, and how a ``--workers N`` router's
    processes combine it (prometheus-client's multiprocess mode)."""

    name: str
    documentation: str
    labels: tuple[str, ...]
    across_processes: str


_PREFIX = "splitserve_router_"
# Every process sees the same workers and indexes the same KV events: worker counts and index sizes
# are the same in each (the highest is reported), and the slowest process's last applied batch is
# how far the whole router has read. Requests are each in one process: those add up.
_POOL_SERIES = (
    _PoolSeries("queue_depth", "Requests waiting for a worker slot, by pool", ("pool",), "livesum"),
    _PoolSeries("inflight_requests", "Requests holding a worker slot, by pool", ("pool",), "livesum"),
    _PoolSeries("worker_inflight", "Requests in flight per worker", ("pool", "worker"), "livesum"),
    _PoolSeries("workers", "Known workers by pool and state", ("pool", "state"), "livemax"),
    _PoolSeries("kv_index_blocks", "precise-prefix: cached blocks each worker's KV events say it holds",
                ("pool", "worker"), "livemax"),
    _PoolSeries("kv_events_seq",
                "precise-prefix: sequence number of the newest KV-event batch applied from each worker (-1: none yet)",
                ("pool", "worker"), "livemin"),
)  # fmt: skip


class PoolCollector(Collector):
    """Pool gauges computed from the pools' own counters when Prometheus scrapes, so the request
    path pays nothing for them."""

    def __init__(self, pools: Sequence[PoolView]) -> None:
        self._pools = pools

    def collect(self) -> Iterable[Metric]:
        families = {
            s.name: GaugeMetricFamily(_PREFIX + s.name, s.documentation, labels=list(s.labels)) for s in _POOL_SERIES
        }
        for pool in self._pools:
            for url, (blocks, seq) in pool.kv_index_state().items():
                families["kv_index_blocks"].add_metric([pool.name, url], blocks)
                families["kv_events_seq"].add_metric([pool.name, url], seq)
            families["queue_depth"].add_metric([pool.name], pool.queue_depth)
            families["inflight_requests"].add_metric([pool.name], pool.inflight)
            counts = dict.fromkeys(("healthy", "ejected", "terminating"), 0)
            for worker in [*pool.workers, *pool.departing]:
                families["worker_inflight"].add_metric([pool.name, worker.url], worker.inflight)
                if not worker.removed:
                    counts[str(worker.state)] += 1
            for state, count in counts.items():
                families["workers"].add_metric([pool.name, state], count)
        return list(families.values())


class PoolGauges:
    """The pool gauges of one process of a multi-process router (``--workers N``).

    Scrape-time collectors only see the process that answers the scrape, so each process writes its
    own figures into prometheus-client's multiprocess files, where the scrape combines them over the
    live processes (``_POOL_SERIES`` says how). Written every second and just before a scrape, so the
    request path still pays nothing.
    """

    def __init__(self, pools: Sequence[PoolView], registry: CollectorRegistry) -> None:
        self._collector = PoolCollector(pools)
        self._gauges = {
            _PREFIX + s.name: Gauge(
                _PREFIX + s.name, s.documentation, s.labels, registry=registry,
                multiprocess_mode=s.across_processes,  # type: ignore[arg-type]
            )
            for s in _POOL_SERIES
        }  # fmt: skip
        self._written: dict[str, set[tuple[str, ...]]] = {name: set() for name in self._gauges}

    def publish(self) -> None:
        for family in self._collector.collect():
            gauge = self._gauges[family.name]
            now: set[tuple[str, ...]] = set()
            for sample in family.samples:
                values = tuple(sample.labels.values())
                gauge.labels(*values).set(sample.value)
                now.add(values)
            for gone in self._written[family.name] - now:
                gauge.labels(*gone).set(0)  # multiprocess files cannot drop a series; zero it
            self._written[family.name] = now


def multiprocess_dir() -> str | None:
    """Where the processes of a ``--workers N`` router share their metrics (set by the parent)."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, shared_dir: str | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.shared_dir = shared_dir
        self._pool_gauges: PoolGauges | None = None
        p = _PREFIX
        self.requests = FastCounter(
            p + "requests", "Finished requests by outcome and serving mode", ["outcome", "mode"]
        )
        self.ttft = FastHistogram(p + "ttft_seconds", "Time to first streamed byte", buckets=LATENCY_BUCKETS)
        # By KV generation (the decode worker's): what a rollout's analysis compares, old against new.
        self.generation_requests = FastCounter(
            p + "generation_requests",
            "Finished requests by the generation of the decode worker that served them, and outcome",
            ["generation", "outcome"],
        )
        self.generation_ttft = FastHistogram(
            p + "generation_ttft_seconds",
            "Time to first streamed byte, by the decode worker's generation",
            ["generation"],
            buckets=LATENCY_BUCKETS,
        )
        # By model name (the base model or a LoRA adapter; only with --lora): requests, TTFT and how much of
        # each model's prompts the chosen worker's prefix cache held (the diagnosis answers its prefix
        # question per adapter from these). "" counts names no worker serves.
        self.model_requests = FastCounter(
            p + "model_requests",
            "Finished requests by model name (base or LoRA adapter) and outcome",
            ["model", "outcome"],
        )
        self.model_ttft = FastHistogram(
            p + "model_ttft_seconds", "Time to first streamed byte, by model name", ["model"], buckets=LATENCY_BUCKETS
        )
        self.model_prompt_tokens = FastCounter(
            p + "model_prompt_tokens", "Prompt tokens routed, by model name", ["model"]
        )
        self.model_prefix_lookup_tokens = FastCounter(
            p + "model_prefix_lookup_tokens",
            "Prompt tokens of the requests whose prefix-cache hits were counted (the denominator of the hit share), "
            "by model name",
            ["model"],
        )
        self.model_prefix_hit_tokens = FastCounter(
            p + "model_prefix_hit_tokens",
            "Prompt tokens the chosen worker already held in its prefix cache (precise-prefix: from its KV events; "
            "prefix-aware: from its own table), by model name",
            ["model"],
        )
        self.cross_generation_pairs = FastCounter(
            p + "cross_generation_pairs",
            "Decode requests sent KV from a prefill worker of another generation (0 unless pairing is off)",
        )
        self.itl = FastHistogram(p + "itl_seconds", "Time between streamed events", buckets=LATENCY_BUCKETS)
        self.e2e = FastHistogram(p + "e2e_seconds", "Request latency, end to end", buckets=LATENCY_BUCKETS)
        self.kv_handoff = FastHistogram(
            p + "kv_handoff_seconds",
            "From the prefill answer to decode's first byte (KV pull + first token)",
            buckets=LATENCY_BUCKETS,
        )
        # With ttft and kv_handoff these split a disaggregated TTFT into its legs: waiting for a slot,
        # the prefill, the handoff (the diagnosis names the leg that takes the time).
        self.queue_wait = FastHistogram(
            p + "queue_wait_seconds",
            "Time a request waited for a worker slot, by pool",
            ["pool"],
            buckets=LATENCY_BUCKETS,
        )
        self.prefill = FastHistogram(
            p + "prefill_seconds",
            "The prefill leg: request sent to a prefill worker until its answer",
            buckets=LATENCY_BUCKETS,
        )
        self.fallbacks = FastCounter(p + "fallbacks", "Aggregated fallbacks by reason", ["reason"])
        self.retries = FastCounter(p + "retries", "Upstream attempts retried on another worker", ["pool"])
        self.ejections = FastCounter(p + "ejections", "Workers ejected after consecutive failures", ["pool"])
        self.prompt_tokens = FastHistogram(
            p + "prompt_tokens", "Prompt length in (possibly approximated) tokens", buckets=_TOKEN_BUCKETS
        )
        self.output_tokens = FastHistogram(p + "output_tokens", "Generated tokens per request", buckets=_TOKEN_BUCKETS)
        fast: list[FastMetric] = [value for value in vars(self).values() if isinstance(value, FastMetric)]
        # One process: the collector builds the families at scrape time. Several: each flushes what it
        # counted into prometheus-client's multiprocess metrics (publish()), which the scrape sums.
        self._mirrors: list[tuple[FastMetric, Any]] = []
        self._flush_pending = False
        if shared_dir is None:
            self.registry.register(FastCollector(fast))
        else:
            self._mirrors = [(metric, metric.mirror(self.registry)) for metric in fast]

    def watch_pools(self, pools: Sequence[PoolView]) -> None:
        """Publish queue depth, in-flight and worker gauges of ``pools`` (read at scrape time)."""
        if self.shared_dir is None:
            self.registry.register(PoolCollector(pools))
        else:
            self._pool_gauges = PoolGauges(pools, self.registry)

    def request_finished(self) -> None:
        """--workers N: flush soon (once per loop iteration however many requests finished in it), so a
        scrape answered by another process counts this one's requests too."""
        if self._mirrors and not self._flush_pending:
            self._flush_pending = True
            asyncio.get_running_loop().call_soon(self._flush)

    def publish(self) -> None:
        """--workers N: write this process's pool gauges and what its counters and histograms counted
        since the last call into the shared multiprocess files (called every second and per scrape)."""
        if self._pool_gauges is not None:
            self._pool_gauges.publish()
        self._flush()

    def _flush(self) -> None:
        self._flush_pending = False
        for metric, mirror in self._mirrors:
            metric.flush_into(mirror)

    def exposition(self) -> bytes:
        """The /metrics body: this router's registry, or the sum over all processes of a ``--workers N`` router."""
        if self.shared_dir is None:
            return generate_latest(self.registry)
        self.publish()
        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged, path=self.shared_dir)  # type: ignore[no-untyped-call]
        return generate_latest(merged)
