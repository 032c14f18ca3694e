"""The router's side of vLLM's KV events: wire decoding, the block index, and the precise-prefix policy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import pytest

from splitserve.router.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    MalformedEvent,
    decode_batch,
    decode_seq,
)
from splitserve.router.kv_index import KvBlockIndex, request_keys
from splitserve.router.policies import PrecisePrefix, RoutingRequest

# The simulator's event structs are vLLM 0.32's field for field (tests/sim checks the bytes), so
# these are the bytes a real engine sends: tagged maps in an array-like batch, defaults omitted.
from splitserve.sim.kv_events import AllBlocksCleared as _Cleared
from splitserve.sim.kv_events import BlockRemoved as _Removed
from splitserve.sim.kv_events import BlockStored as _Stored
from splitserve.sim.kv_events import EventBatch as _Batch


def wire(*events: Any) -> bytes:
    return msgspec.msgpack.encode(_Batch(ts=1.5, events=list(events)))


def stored(hashes: list[int], tokens: list[int], parent: int | None = None, size: int = 4, **extra: Any) -> _Stored:
    fields = {"lora_id": None, "medium": "GPU", "lora_name": None, **extra}
    return _Stored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=size, **fields)


PROMPT = list(range(100, 116))  # four blocks of four tokens


# ---- wire -----------------------------------------------------------------------------------


def test_decodes_the_map_form_vllm_sends_today() -> None:
    batch = decode_batch(7, wire(stored([11, 12], PROMPT[:8]), _Removed(block_hashes=[11], medium="GPU"), _Cleared()))
    assert batch.seq == 7 and batch.timestamp == 1.5 and batch.dp_rank is None
    first, second, third = batch.events
    assert isinstance(first, BlockStored) and first.block_hashes == (11, 12) and first.token_ids == tuple(PROMPT[:8])
    assert first.block_size == 4 and first.parent_block_hash is None and first.medium == "GPU"
    assert second == BlockRemoved((11,), "GPU")
    assert third == AllBlocksCleared()


def test_decodes_the_positional_form_of_older_vllm() -> None:
    payload = msgspec.msgpack.encode(
        [2.0, [["BlockStored", [5], None, [1, 2, 3, 4], 4, None, "CPU", None], ["BlockRemoved", [5], "CPU"]], 0]
    )
    batch = decode_batch(0, payload)
    assert batch.dp_rank == 0
    assert batch.events == (BlockStored((5,), None, (1, 2, 3, 4), 4, "CPU", None, None), BlockRemoved((5,), "CPU"))


def test_unknown_event_types_are_skipped_and_garbage_is_refused() -> None:
    assert decode_batch(1, msgspec.msgpack.encode([0.0, [{"type": "SomethingNew", "x": 1}]])).events == ()
    with pytest.raises(MalformedEvent, match="not msgpack"):
        decode_batch(1, b"\xc1")
    with pytest.raises(MalformedEvent, match="timestamp"):
        decode_batch(1, msgspec.msgpack.encode({"ts": 1}))
    with pytest.raises(MalformedEvent, match="bad BlockStored"):
        decode_batch(1, msgspec.msgpack.encode([0.0, [{"type": "BlockStored", "block_hashes": [1]}]]))
    assert decode_seq((41).to_bytes(8, "big")) == 41
    with pytest.raises(MalformedEvent):
        decode_seq(b"\x00")


# ---- index ----------------------------------------------------------------------------------


def index_with(*events: Any, worker: str = "a") -> KvBlockIndex:
    index = KvBlockIndex()
    index.apply(worker, decode_batch(0, wire(*events)).events)
    return index


def test_stored_blocks_match_the_request_side_keys_of_the_same_tokens() -> None:
    index = index_with(stored([1, 2, 3], PROMPT[:12]))
    keys = request_keys(PROMPT, 4)
    assert len(keys) == 4
    assert index.matched_blocks("a", keys) == 3
    assert index.has_events("a") and index.block_size("a") == 4
    # A different token in block 2 breaks the chain from there on.
    other = [*PROMPT[:5], 999, *PROMPT[6:]]
    assert index.matched_blocks("a", request_keys(other, 4)) == 1
    assert index.matched_blocks("b", keys) == 0 and not index.has_events("b")


def test_a_stored_event_continues_its_parents_chain() -> None:
    index = index_with(stored([1], PROMPT[:4]), stored([2, 3], PROMPT[4:12], parent=1))
    assert index.matched_blocks("a", request_keys(PROMPT, 4)) == 3


def test_a_block_whose_parent_was_never_seen_is_not_indexed() -> None:
    # Its key would need the parent's; guessing would attract requests to blocks that do not match.
    index = index_with(stored([2, 3], PROMPT[4:12], parent=1))
    assert index.blocks_held("a") == 0 and index.skipped_orphans == 1


def test_removal_and_clear_follow_the_engine() -> None:
    index = index_with(stored([1, 2, 3], PROMPT[:12]), _Removed(block_hashes=[2], medium="GPU"))
    assert index.matched_blocks("a", request_keys(PROMPT, 4)) == 1
    index.apply("a", decode_batch(1, wire(_Cleared())).events)
    assert index.blocks_held("a") == 0


def test_a_block_on_two_media_stays_until_both_drop_it() -> None:
    index = index_with(stored([1], PROMPT[:4]), stored([1], PROMPT[:4], medium="CPU"))
    index.apply("a", decode_batch(1, wire(_Removed(block_hashes=[1], medium="GPU"))).events)
    assert index.matched_blocks("a", request_keys(PROMPT, 4)) == 1
    index.apply("a", decode_batch(2, wire(_Removed(block_hashes=[1], medium="CPU"))).events)
    assert index.matched_blocks("a", request_keys(PROMPT, 4)) == 0


def test_lora_and_cache_salt_keys_separate_blocks_as_the_engine_does() -> None:
    # vLLM hashes the LoRA name into every block and the cache salt into the first (extra_keys).
    extra = [("adapter", "s1"), ("adapter",), ("adapter",)]
    index = index_with(stored([1, 2, 3], PROMPT[:12], lora_name="adapter", extra_keys=extra))
    assert index.matched_blocks("a", request_keys(PROMPT, 4, lora_name="adapter", cache_salt="s1")) == 3
    assert index.matched_blocks("a", request_keys(PROMPT, 4, lora_name="adapter", cache_salt="s2")) == 0
    assert index.matched_blocks("a", request_keys(PROMPT, 4)) == 0
    # Older engines sent no extra_keys, but always hashed the LoRA name.
    old = index_with(stored([1, 2], PROMPT[:8], lora_name="adapter"))
    assert old.matched_blocks("a", request_keys(PROMPT, 4, lora_name="adapter")) == 2


def test_forget_drops_one_worker_only() -> None:
    index = index_with(stored([1], PROMPT[:4]))
    index.apply("b", decode_batch(0, wire(stored([1], PROMPT[:4]))).events)
    index.forget("a")
    assert index.workers == ["b"]


# ---- policy ---------------------------------------------------------------------------------


@dataclass
class View:
    key: str
    inflight: int = 0
    kv_usage: float | None = None
    waiting: float | None = None


def test_precise_prefix_picks_the_worker_holding_the_longest_prefix() -> None:
    index = KvBlockIndex()
    index.apply("a", decode_batch(0, wire(stored([1], PROMPT[:4]))).events)
    index.apply("b", decode_batch(0, wire(stored([7, 8, 9], PROMPT[:12]))).events)
    policy = PrecisePrefix(index)
    workers = [View("a"), View("b", inflight=3), View("c")]
    assert policy.choose(workers, RoutingRequest(16, token_ids=tuple(PROMPT))).key == "b"
    # Past the load bound (1.5 x least + 4) the cached worker is skipped and the next best wins.
    workers[1].inflight = 5
    assert policy.choose(workers, RoutingRequest(16, token_ids=tuple(PROMPT))).key == "a"


def test_precise_prefix_without_events_or_tokens_routes_by_load() -> None:
    policy = PrecisePrefix(KvBlockIndex())
    workers = [View("a", inflight=2), View("b", inflight=1), View("c", inflight=2)]
    assert policy.choose(workers, RoutingRequest(16, token_ids=tuple(PROMPT))).key == "b"
    index = index_with(stored([1, 2], PROMPT[:8]))
    assert PrecisePrefix(index).choose(workers, RoutingRequest(16)).key == "b"  # no token ids: no match


def test_precise_prefix_uses_each_workers_own_block_size() -> None:
    index = KvBlockIndex()
    index.apply("small", decode_batch(0, wire(stored([1], PROMPT[:4]))).events)
    index.apply("big", decode_batch(0, wire(stored([2], PROMPT[:8], size=8))).events)
    policy = PrecisePrefix(index)
    request = RoutingRequest(16, token_ids=tuple(PROMPT))
    # 8 cached tokens beat 4, though "small" holds one block and "big" one block too.
    assert policy.choose([View("small"), View("big")], request).key == "big"
