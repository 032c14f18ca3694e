"""Prometheus metrics of one router (its own registry, so tests can build many routers).

Names are a contract with the dashboards and the autoscaler: see METRICS.md beside this file.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Latency buckets from 1 ms (router overhead) to minutes (long generations).
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        p = "splitserve_router_"
        self.queue_depth = Gauge(p + "queue_depth", "Requests waiting for a worker slot, by pool", ["pool"], registry=r)
        self.inflight = Gauge(p + "inflight_requests", "Requests holding a worker slot, by pool", ["pool"], registry=r)
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
        self.worker_inflight = Gauge(
            p + "worker_inflight", "Requests in flight per worker", ["pool", "worker"], registry=r
        )
        self.prompt_tokens = Histogram(
            p + "prompt_tokens", "Prompt length in (possibly approximated) tokens", buckets=_TOKEN_BUCKETS, registry=r
        )
        self.output_tokens = Histogram(
            p + "output_tokens", "Generated tokens per request", buckets=_TOKEN_BUCKETS, registry=r
        )
        self.workers = Gauge(p + "workers", "Known workers by pool and state", ["pool", "state"], registry=r)
        self.admission_rejections = Counter(
            p + "admission_rejections", "Requests refused at admission", ["reason"], registry=r
        )
