"""Which worker's prefix cache holds which block, rebuilt from the engines' own KV events (pure).

Keys: the router recomputes its own chained block keys from the ``token_ids`` each ``BlockStored``
carries (as llm-d's indexer does) instead of trusting the engine's block hashes, because
- the engine's hashes depend on its hash algorithm, its seed and its exact encoding of extra keys,
  all of which vary across vLLM versions and settings; recomputing from tokens makes the router
  independent of them (and of the simulator's own hash);
- the request side then needs only the token ids and a cheap blake2b chain, no CBOR or sha256.
A per-worker map from engine hash to router key resolves ``BlockRemoved`` (which carries only
engine hashes) and a ``BlockStored``'s ``parent_block_hash``.

The key of block *i* covers its tokens, the key of block *i-1*, and the block's extra keys as vLLM
hashes them: the LoRA name on every block and the cache salt on the first. So a request can only
match blocks computed for the same adapter and salt, exactly as in the engine (the router keys every
request as a base-model prompt today: it does not know which model names are adapters).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from splitserve.router.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

ROOT_KEY = 0
_encode = msgspec.msgpack.Encoder().encode


def chain_key(previous: int, tokens: Sequence[int], extra: Sequence[Any] | None) -> int:
    data = array("I", tokens).tobytes()
    if extra:
        data += _encode(list(extra))  # tuples and lists encode alike, so events and requests agree
    digest = hashlib.blake2b(data, digest_size=8, key=previous.to_bytes(8, "little")).digest()
    return int.from_bytes(digest, "little")


def request_keys(
    token_ids: Sequence[int], block_size: int, *, lora_name: str | None = None, cache_salt: str | None = None
) -> tuple[int, ...]:
    """Keys of every full block of a prompt, as the index derives them from the engine's events."""
    keys: list[int] = []
    previous = ROOT_KEY
    for index, start in enumerate(range(0, len(token_ids) - block_size + 1, block_size)):
        extra = [lora_name] if lora_name else []
        if index == 0 and cache_salt:
            extra.append(cache_salt)
        previous = chain_key(previous, token_ids[start : start + block_size], extra)
        keys.append(previous)
    return tuple(keys)


@dataclass
class WorkerBlocks:
    """What one worker's cache holds: router key -> media, and the engine hashes that name them."""

    block_size: int | None = None
    media: dict[int, set[str]] = field(default_factory=dict)
    key_of_engine_hash: dict[int, int] = field(default_factory=dict)


class KvBlockIndex:
    """Worker -> cached blocks, fed by :meth:`apply` and read by the precise-prefix policy."""

    def __init__(self) -> None:
        self._workers: dict[str, WorkerBlocks] = {}
        self.skipped_orphans = 0  # BlockStored whose parent this index never saw (missed events)

    # ---- reading ---------------------------------------------------------------------------

    def has_events(self, worker: str) -> bool:
        """Whether routing may trust this worker's entries (its events have started arriving)."""
        blocks = self._workers.get(worker)
        return blocks is not None and blocks.block_size is not None

    def block_size(self, worker: str) -> int | None:
        blocks = self._workers.get(worker)
        return None if blocks is None else blocks.block_size

    def matched_blocks(self, worker: str, keys: Sequence[int]) -> int:
        """How many leading ``keys`` the worker holds."""
        blocks = self._workers.get(worker)
        if blocks is None:
            return 0
        media = blocks.media
        count = 0
        for key in keys:
            if key not in media:
                break
            count += 1
        return count

    def engine_hashes(self, worker: str) -> set[int]:
        """The engine's own hashes of the blocks the index says the worker holds."""
        blocks = self._workers.get(worker)
        return set() if blocks is None else set(blocks.key_of_engine_hash)

    def blocks_held(self, worker: str) -> int:
        blocks = self._workers.get(worker)
        return 0 if blocks is None else len(blocks.media)

    @property
    def workers(self) -> list[str]:
        return sorted(self._workers)

    # ---- writing ---------------------------------------------------------------------------

    def apply(self, worker: str, events: Iterable[KvEvent]) -> None:
        blocks = self._workers.setdefault(worker, WorkerBlocks())
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(blocks, event)
            elif isinstance(event, BlockRemoved):
                self._removed(blocks, event)
            elif isinstance(event, AllBlocksCleared):
                blocks.media.clear()
                blocks.key_of_engine_hash.clear()

    def mark_live(self, worker: str, block_size: int | None = None) -> None:
        """A worker whose publisher answers but has stored nothing yet is still trustworthy: empty."""
        blocks = self._workers.setdefault(worker, WorkerBlocks())
        if block_size is not None:
            blocks.block_size = block_size

    def forget(self, worker: str) -> None:
        """Drop everything known about a worker (it left, restarted, or its event stream broke)."""
        self._workers.pop(worker, None)

    def _stored(self, blocks: WorkerBlocks, event: BlockStored) -> None:
        size = event.block_size
        blocks.block_size = size
        if event.parent_block_hash is None:
            previous = ROOT_KEY
        else:
            parent = blocks.key_of_engine_hash.get(event.parent_block_hash)
            if parent is None:
                # The parent was stored before we listened (or in a lost batch): without its key the
                # chain cannot be continued, and a wrong key would attract requests for nothing.
                self.skipped_orphans += 1
                return
            previous = parent
        medium = event.medium or "GPU"
        tokens = event.token_ids
        for i, engine_hash in enumerate(event.block_hashes):
            chunk = tokens[i * size : (i + 1) * size]
            if len(chunk) < size:
                break  # vLLM only publishes full blocks; a short tail would never match a request
            extra: tuple[Any, ...] | None = None
            if event.extra_keys is not None and i < len(event.extra_keys):
                extra = event.extra_keys[i]
            elif event.lora_name:
                extra = (event.lora_name,)  # older vLLM sent no extra_keys; LoRA was always hashed
            previous = chain_key(previous, chunk, extra)
            blocks.key_of_engine_hash[engine_hash] = previous
            blocks.media.setdefault(previous, set()).add(medium)

    def _removed(self, blocks: WorkerBlocks, event: BlockRemoved) -> None:
        medium = event.medium or "GPU"
        for engine_hash in event.block_hashes:
            key = blocks.key_of_engine_hash.get(engine_hash)
            if key is None:
                continue
            media = blocks.media.get(key)
            if media is None:
                blocks.key_of_engine_hash.pop(engine_hash, None)
                continue
            media.discard(medium)
            if not media:
                del blocks.media[key]
                del blocks.key_of_engine_hash[engine_hash]
