"""Prometheus metrics of one router (its own registry, so tests can build many routers).

Names are a contract with the dashboards and the autoscaler: see METRICS.md beside this file.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# Latency buckets from 1 ms (router overhead) to minutes (long generations).
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
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


class PoolCollector(Collector):
    """Pool gauges computed from the pools' own counters when Prometheus scrapes, so the request
    path pays nothing for them."""

    def __init__(self, pools: Sequence[PoolView]) -> None:
        self._pools = pools

    def collect(self) -> Iterable[Metric]:
        p = "splitserve_router_"
        queue = GaugeMetricFamily(p + "queue_depth", "Requests waiting for a worker slot, by pool", labels=["pool"])
        inflight = GaugeMetricFamily(
            p + "inflight_requests", "Requests holding a worker slot, by pool", labels=["pool"]
        )
        per_worker = GaugeMetricFamily(
            p + "worker_inflight", "Requests in flight per worker", labels=["pool", "worker"]
        )
        states = GaugeMetricFamily(p + "workers", "Known workers by pool and state", labels=["pool", "state"])
        indexed = GaugeMetricFamily(
            p + "kv_index_blocks",
            "precise-prefix: cached blocks each worker's KV events say it holds",
            labels=["pool", "worker"],
        )
        applied = GaugeMetricFamily(
            p + "kv_events_seq",
            "precise-prefix: sequence number of the newest KV-event batch applied from each worker (-1: none yet)",
            labels=["pool", "worker"],
        )
        for pool in self._pools:
            for url, (blocks, seq) in pool.kv_index_state().items():
                indexed.add_metric([pool.name, url], blocks)
                applied.add_metric([pool.name, url], seq)
            queue.add_metric([pool.name], pool.queue_depth)
            inflight.add_metric([pool.name], pool.inflight)
            counts = dict.fromkeys(("healthy", "ejected", "terminating"), 0)
            for worker in [*pool.workers, *pool.departing]:
                per_worker.add_metric([pool.name, worker.url], worker.inflight)
                if not worker.removed:
                    counts[str(worker.state)] += 1
            for state, count in counts.items():
                states.add_metric([pool.name, state], count)
        return [queue, inflight, per_worker, states, indexed, applied]


class PoolGauges:
    """The pool gauges of one process of a multi-process router (``--workers N``).

    Scrape-time collectors only see the process that answers the scrape, so each process writes its
    own figures into prometheus-client's multiprocess files, where the scrape sums them over the live
    processes (worker counts: the highest, since every process sees the same workers). Written every
    second and just before a scrape, so the request path still pays nothing.
    """

    # Every process indexes the same events: the index size is the same in each (report the highest),
    # and the slowest process's last applied batch is how far the whole router has read.
    _MODES = {"queue_depth": "livesum", "inflight_requests": "livesum", "worker_inflight": "livesum",
              "workers": "livemax", "kv_index_blocks": "livemax", "kv_events_seq": "livemin"}  # fmt: skip

    def __init__(self, pools: Sequence[PoolView], registry: CollectorRegistry) -> None:
        self._collector = PoolCollector(pools)
        self._gauges: dict[str, Gauge] = {}
        for family in self._collector.collect():
            short = family.name.removeprefix("splitserve_router_")
            self._gauges[family.name] = Gauge(
                family.name, family.documentation, _FAMILY_LABELS[short], registry=registry,
                multiprocess_mode=self._MODES[short],  # type: ignore[arg-type]
            )  # fmt: skip
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


_FAMILY_LABELS = {"queue_depth": ["pool"], "inflight_requests": ["pool"], "worker_inflight": ["pool", "worker"],
                  "workers": ["pool", "state"], "kv_index_blocks": ["pool", "worker"],
                  "kv_events_seq": ["pool", "worker"]}  # fmt: skip


def multiprocess_dir() -> str | None:
    """Where the processes of a ``--workers N`` router share their metrics (set by the parent)."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, shared_dir: str | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.shared_dir = shared_dir
        self._pool_gauges: PoolGauges | None = None
        r = self.registry
        p = "splitserve_router_"
        self.requests = Counter(
            p + "requests", "Finished requests by outcome and serving mode", ["outcome", "mode"], registry=r
        )
        self.ttft = Histogram(p + "ttft_seconds", "Time to first streamed byte", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(p + "itl_seconds", "Time between streamed events", buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_seconds", "Request latency, end to end", buckets=_LATENCY_BUCKETS, registry=r)
        self.kv_handoff = Histogram(
            p + "kv_handoff_seconds",
            "From the prefill answer to decode's first byte (KV pull + first token)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.fallbacks = Counter(p + "fallbacks", "Aggregated fallbacks by reason", ["reason"], registry=r)
        self.retries = Counter(p + "retries", "Upstream attempts retried on another worker", ["pool"], registry=r)
        self.ejections = Counter(p + "ejections", "Workers ejected after consecutive failures", ["pool"], registry=r)
        self.prompt_tokens = Histogram(
            p + "prompt_tokens", "Prompt length in (possibly approximated) tokens", buckets=_TOKEN_BUCKETS, registry=r
        )
        self.output_tokens = Histogram(
            p + "output_tokens", "Generated tokens per request", buckets=_TOKEN_BUCKETS, registry=r
        )

    def watch_pools(self, pools: Sequence[PoolView]) -> None:
        """Publish queue depth, in-flight and worker gauges of ``pools`` (read at scrape time)."""
        if self.shared_dir is None:
            self.registry.register(PoolCollector(pools))
        else:
            self._pool_gauges = PoolGauges(pools, self.registry)

    def publish_pools(self) -> None:
        if self._pool_gauges is not None:
            self._pool_gauges.publish()

    def exposition(self) -> bytes:
        """The /metrics body: this router's registry, or the sum over all processes of a ``--workers N`` router."""
        if self.shared_dir is None:
            return generate_latest(self.registry)
        self.publish_pools()
        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged, path=self.shared_dir)  # type: ignore[no-untyped-call]
        return generate_latest(merged)
