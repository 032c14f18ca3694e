"""vLLM's KV-cache events as the router reads them off the wire (pure decoding, no sockets).

Each ZMQ message is three frames, ``[topic, seq, payload]``: ``seq`` is an 8-byte big-endian
sequence number and ``payload`` is msgpack of ``[timestamp, [event, ...], dp_rank]`` (vLLM's
``EventBatch``, array-like, trailing defaults omitted). Each event is a tagged map
(``{"type": "BlockStored", ...}``) in vLLM since mid-2026, and a positional array
(``["BlockStored", block_hashes, parent, token_ids, block_size, lora_id, medium, lora_name]``) in
older releases; both are accepted, as llm-d's indexer does. Unknown event types are skipped, so a
newer engine that adds one does not break routing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

REPLAY_END = -1  # the seq a replay socket sends after its last buffered batch


class MalformedEvent(ValueError):
    """A payload that is not a vLLM event batch."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = None
    lora_name: str | None = None
    # One entry per block (or None): LoRA name, multimodal (id, offset) pairs and cache salt, untagged.
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    seq: int
    timestamp: float
    events: tuple[KvEvent, ...]
    dp_rank: int | None = None


_decoder = msgspec.msgpack.Decoder()


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise MalformedEvent(f"sequence frame has {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big", signed=True)


def decode_batch(seq: int, payload: bytes) -> EventBatch:
    """One batch from its payload frame; MalformedEvent when it is not one."""
    try:
        raw = _decoder.decode(payload)
    except msgspec.DecodeError as error:
        raise MalformedEvent(f"payload is not msgpack: {error}") from None
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise MalformedEvent("payload is not [timestamp, [events], dp_rank]")
    events = tuple(e for e in (_event(item) for item in raw[1]) if e is not None)
    dp_rank = raw[2] if len(raw) > 2 and isinstance(raw[2], int) else None
    return EventBatch(seq=seq, timestamp=float(raw[0]), events=events, dp_rank=dp_rank)


_POSITIONAL_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                    "extra_keys"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}  # fmt: skip


def _event(item: object) -> KvEvent | None:
    if isinstance(item, dict):
        kind, fields = item.get("type"), item
    elif isinstance(item, list) and item and isinstance(item[0], str):
        kind = item[0]
        names = _POSITIONAL_FIELDS.get(kind, ())
        fields = dict(zip(names, item[1:], strict=False))
    else:
        raise MalformedEvent(f"event is neither a map nor a tagged array: {item!r:.80}")
    try:
        if kind == "BlockStored":
            return BlockStored(
                block_hashes=_hashes(fields["block_hashes"]),
                parent_block_hash=_hash(fields.get("parent_block_hash")),
                token_ids=tuple(int(t) for t in fields["token_ids"]),
                block_size=int(fields["block_size"]),
                medium=fields.get("medium"),
                lora_name=fields.get("lora_name"),
                extra_keys=_extra_keys(fields.get("extra_keys")),
            )
        if kind == "BlockRemoved":
            return BlockRemoved(block_hashes=_hashes(fields["block_hashes"]), medium=fields.get("medium"))
        if kind == "AllBlocksCleared":
            return AllBlocksCleared()
    except (KeyError, TypeError, ValueError) as error:
        raise MalformedEvent(f"bad {kind} event: {error!r}") from None
    return None  # an event type this router does not know


def _hash(value: object) -> int | None:
    """Engine block hashes are 64-bit ints; sha256 builds may send the raw digest bytes instead."""
    if value is None:
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, bytes):
        return int.from_bytes(value[-8:], "big")
    raise TypeError(f"block hash {value!r:.40} is not an int or bytes")


def _hashes(values: Sequence[object]) -> tuple[int, ...]:
    hashes = tuple(_hash(v) for v in values)
    if any(h is None for h in hashes):
        raise ValueError("null block hash")
    return hashes  # type: ignore[return-value]


def _extra_keys(value: object) -> tuple[tuple[Any, ...] | None, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise TypeError("extra_keys is not a list")
    return tuple(None if v is None else tuple(v) for v in value)
