"""Prometheus metrics of one simulated engine, named and labelled as vLLM (v1 engine) names them.

Each worker owns its own ``CollectorRegistry`` so many workers can live in one process.
Labels: ``model_name`` and ``engine`` (always "0": one engine core per worker), as vLLM exports them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from splitserve.sim.config import EngineLimits

# Bucket boundaries copied from vLLM's v1 Prometheus logger, so dashboards and quantile queries
# behave the same against the simulator.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
)  # fmt: skip

PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
WAITING_REASONS = ("capacity", "deferred")
# Why a prefill engine refuses a KV pull: a puller of another KV generation, an unknown engine id,
# unknown or expired blocks, blocks of another request, computed for another LoRA adapter (or for the
# base model), or of another prompt.
PULL_REFUSALS = ("generation", "unknown_engine", "unknown_blocks", "other_request", "other_adapter", "other_prompt")


@dataclass(frozen=True)
class LiveState:
    """Callables read at scrape time for the gauges. The engine answers the queue counts from its
    per-step snapshot (as vLLM's scheduler stats) and KV usage from the pool itself."""

    running: Callable[[], float]
    waiting_for_capacity: Callable[[], float]
    deferred: Callable[[], float]
    kv_usage: Callable[[], float]


def token_count_buckets(max_model_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len, as vLLM builds its token-count buckets."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_model_len:
                return tuple(buckets)
            buckets.append(float(value))
        exponent += 1


class SimMetrics:
    def __init__(self, model_name: str, limits: EngineLimits, live: LiveState, max_loras: int | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"model_name": model_name, "engine": "0"}
        names = list(labels)
        registry = self.registry

        def gauge(name: str, doc: str, read: Callable[[], float]) -> None:
            Gauge(name, doc, names, registry=registry).labels(**labels).set_function(read)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=registry).labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=registry).labels(**labels)

        gauge("vllm:num_requests_running", "Number of requests in model execution batches.", live.running)
        gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            lambda: live.waiting_for_capacity() + live.deferred(),
        )
        gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", live.kv_usage)
        by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of requests waiting, by reason.",
            [*names, "reason"],
            registry=registry,
        )
        by_reason.labels(**labels, reason="capacity").set_function(live.waiting_for_capacity)
        by_reason.labels(**labels, reason="deferred").set_function(live.deferred)

        cache_info = {
            "block_size": str(limits.block_size),
            "num_gpu_blocks": str(limits.num_kv_blocks),
            "enable_prefix_caching": str(limits.enable_prefix_caching),
            "cache_dtype": "auto",
        }
        Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            [*names, *cache_info],
            registry=registry,
        ).labels(**labels, **cache_info).set(1)

        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        by_source = Counter(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by where their KV came from.",
            [*names, "source"],
            registry=registry,
        )
        self.prompt_tokens_by_source = {source: by_source.labels(**labels, source=source) for source in PROMPT_SOURCES}
        self.num_preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*names, "finished_reason"],
            registry=registry,
        )
        self.request_success_length = success.labels(**labels, finished_reason="length")
        self.nixl_failed_transfers = counter(
            "vllm:nixl_num_failed_transfers", "Number of failed NIXL KV cache transfers."
        )
        # Not a vLLM metric: the prefill side's refusals of KV pulls (vLLM logs them), by reason.
        refused = Counter(
            "splitserve_sim_kv_pulls_refused",
            "KV pulls this (prefill) engine refused, by reason.",
            [*names, "reason"],
            registry=registry,
        )
        self.kv_pulls_refused: Callable[[str], Counter] = lambda reason: refused.labels(**labels, reason=reason)
        for reason in PULL_REFUSALS:
            self.kv_pulls_refused(reason)  # every series from the start, at 0
        self.nixl_expired_requests = counter(
            "vllm:nixl_num_kv_expired_reqs", "Number of requests whose held KV expired before being pulled."
        )
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        # Per finished request: decode time / (generated tokens - 1), as vLLM v1 computes it. Unlike ITL
        # (one sample per step), it shows what a multi-token step (speculative decoding) gains.
        self.request_time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )

        token_buckets = token_count_buckets(limits.max_model_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self.request_inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )

        # LoRA (--enable-lora): as vLLM, labels max_lora and the adapters with requests in the engine, no
        # model_name or engine; each report sets its series to the time, so the newest series is the
        # current state (older label sets stay, with their older times).
        self._max_loras = max_loras
        self._lora_info: Gauge | None = None
        if max_loras is not None:
            self._lora_info = Gauge(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                registry=registry,
            )

        # Simulator health, not vLLM metrics: when the process is CPU-starved the step loop ends
        # steps later than modelled; benchmarks should check this lag stays small before trusting
        # latency figures.
        self.sim_steps = Counter("splitserve_sim_steps", "Engine steps simulated.", registry=registry)
        self.sim_step_lag = Counter(
            "splitserve_sim_step_lag_seconds",
            "Total time engine steps ended later than the latency model says.",
            registry=registry,
        )

    def report_loras(self, adapters: list[str]) -> None:
        """One vllm:lora_requests_info report: ``adapters`` have requests waiting or running."""
        if self._lora_info is None:
            return
        names = ",".join(adapters)
        self._lora_info.labels(
            max_lora=str(self._max_loras), waiting_lora_adapters=names, running_lora_adapters=names
        ).set_to_current_time()

    def exposition(self) -> bytes:
        # vLLM turns off the ``*_created`` series; prometheus_client can only do that process-wide,
        # so they are dropped from this registry's text instead.
        lines = generate_latest(self.registry).split(b"\n")
        return b"\n".join(line for line in lines if not _is_created_line(line))


def _is_created_line(line: bytes) -> bool:
    if line.startswith((b"# HELP ", b"# TYPE ")):
        name = line.split(b" ", 3)[2]
    else:
        name = line.split(b"{", 1)[0].split(b" ", 1)[0]
    return name.endswith(b"_created")
