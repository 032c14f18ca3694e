"""Router configuration: one frozen value built by the CLI (or by tests) and read everywhere."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class DiscoveryKind(enum.StrEnum):
    STATIC = "static"
    DNS = "dns"
    KUBERNETES = "kubernetes"
    # Workers with their KV generations: a JSON file (local stack, tests) or Pods and their labels.
    FILE = "file"
    PODS = "pods"


class GenerationPairing(enum.StrEnum):
    """Whether prefill and decode of one request must be of one KV generation. ``off`` exists only to
    show, in a test, the failure ``strict`` prevents: KV of other weights decoded as if it fitted."""

    STRICT = "strict"
    OFF = "off"


@dataclass(frozen=True)
class RouterConfig:
    """Everything the router needs to know; durations in seconds, sizes in bytes or tokens."""

    host: str = "0.0.0.0"
    port: int = 8000
    # The served model name clients must send; None accepts any name and asks decode for /v1/models.
    model: str | None = None

    discovery: DiscoveryKind = DiscoveryKind.STATIC
    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    namespace: str = "default"
    prefill_service: str | None = None
    decode_service: str | None = None
    worker_port: int = 8000
    kubeconfig: str | None = None
    dns_interval: float = 5.0
    # file discovery: the JSON file its writer replaces atomically, and how often it is read.
    endpoints_file: str | None = None
    endpoints_poll_interval: float = 0.2
    # pods discovery: the SplitServe deployment whose worker Pods (label splitserve.io/deployment) are followed.
    deployment: str | None = None
    # file/pods discovery: False when the deployment has no prefill pool (aggregated mode), so requests
    # are counted aggregated rather than as fallbacks from a missing prefill pool.
    prefill_pool: bool = True
    generation_pairing: GenerationPairing = GenerationPairing.STRICT
    # A gateway's decode-side sidecar: split a request only when the endpoint picker named its prefill
    # worker (x-prefiller-host-port), on that worker; otherwise serve it on the local decode worker.
    prefill_from_header: bool = False
    # LoRA adapters: learn each worker's adapters from its /v1/models and send a request for an adapter
    # only to workers that serve it (both legs), preferring those where it is already active.
    lora: bool = False
    models_poll_interval: float = 2.0

    prefill_policy: str = "round-robin"
    decode_policy: str = "least-loaded"

    # Admission: requests wait (bounded) for a worker slot; beyond queue_limit waiters -> 429.
    queue_limit: int = 1024
    queue_timeout: float = 30.0
    # Per-worker concurrency cap: what a worker is given before the router starts queueing.
    max_inflight_per_worker: int = 256

    connect_timeout: float = 5.0
    prefill_timeout: float = 120.0
    # Longest wait for decode's first byte and, while streaming, between two chunks.
    decode_timeout: float = 120.0
    request_timeout: float = 900.0

    # Prompts shorter than this many tokens skip prefill (0: always disaggregate when a prefill exists).
    disagg_threshold_tokens: int = 0
    max_body_bytes: int = 8 * 1024 * 1024
    drain_seconds: float = 30.0
    tokenizer: str | None = None
    # Without a tokenizer a token is approximated as this many bytes of UTF-8 prompt text.
    approx_bytes_per_token: int = 4
    prefix_block_tokens: int = 16
    # precise-prefix: worker URL -> ZMQ endpoint of its KV events, overriding what the worker's own
    # GET /kv_event_sources says (the default source).
    kv_event_endpoints: tuple[tuple[str, str], ...] = ()
    # Router processes sharing the port (SO_REUSEPORT); 1 serves in this process.
    workers: int = 1

    # Reliability knobs.
    max_retries: int = 2
    eject_after_failures: int = 3
    eject_min_seconds: float = 2.0
    health_interval: float = 1.0
    metrics_poll_interval: float = 1.0

    @property
    def has_prefill_source(self) -> bool:
        if self.discovery is DiscoveryKind.STATIC:
            return bool(self.prefill_urls)
        if self.discovery in (DiscoveryKind.FILE, DiscoveryKind.PODS):
            return self.prefill_pool
        return bool(self.prefill_service)
