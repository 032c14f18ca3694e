"""vLLM's KV-cache event types, field for field, so the simulator's events encode to vLLM's bytes.

These mirror ``vllm/distributed/kv_events.py`` (vLLM 0.32): the same class names (msgspec uses the
class name as the ``"type"`` tag), the same field names in the same order and the same struct
options (``omit_defaults``, ``tag=True``; ``EventBatch`` is ``array_like``). Encoded with
``msgspec.msgpack``, a batch is ``[ts, [{"type": "BlockStored", ...}, ...], data_parallel_rank]``.
Pure data: the ZMQ publisher is in ``kv_publisher.py``.
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged events (vLLM's ``KVCacheEvent``)."""


class BlockStored(KVCacheEvent):
    """Full blocks of one request entered the prefix cache (one event per caching, many blocks)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    """A cached block was evicted (vLLM emits one event per evicted hash)."""

    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was reset."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
