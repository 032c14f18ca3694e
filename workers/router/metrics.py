"""Prometheus metrics of one router (its own registry, so tests can build many routers).

Names are a contract with the dashboards and the autoscaler: see METRICS.md beside this file.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
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
        for pool in self._pools:
            queue.add_metric([pool.name], pool.queue_depth)
            inflight.add_metric([pool.name], pool.inflight)
            counts = dict.fromkeys(("healthy", "ejected", "terminating"), 0)
            for worker in [*pool.workers, *pool.departing]:
                per_worker.add_metric([pool.name, worker.url], worker.inflight)
                if not worker.removed:
                    counts[str(worker.state)] += 1
            for state, count in counts.items():
                states.add_metric([pool.name, state], count)
        return [queue, inflight, per_worker, states]


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
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
        self.registry.register(PoolCollector(pools))
