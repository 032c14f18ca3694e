"""KV cache block pool with a prefix cache, modelled on vLLM's block pool (pure logic, no I/O).

Blocks are reference counted. A block whose count drops to zero goes to the free queue but keeps
its content hash, so a later request with the same prefix can reuse it (a prefix cache hit) until
the block is handed out again. As in vLLM's ``BlockPool.free_blocks``, freed blocks without a hash
go to the front of the free queue (nothing to lose by reusing them) and cached ones to the back, so
eviction is least-recently-freed first among cached blocks; a request's blocks are freed tail
first, so the shared beginnings of prompts survive longest.

With ``enable_kv_cache_events`` the pool records vLLM's KV events as ``BlockPool`` does, and the
engine drains them once per step with ``take_events``:

* ``BlockStored`` when full blocks of one request enter the prefix cache (``cache_full_blocks``):
  one event for the run of newly cached blocks, its parent the hash of the block before them
  (None when they start the sequence), with exactly those blocks' token ids; for a LoRA request its
  ``lora_id``, ``lora_name`` and ``extra_keys``, the adapter's name once per block (vLLM's untagged
  form of the ``("lora", name, path)`` key it hashes).
* ``BlockRemoved`` for each cached block evicted when the free queue hands it out again.
* ``AllBlocksCleared`` when the prefix cache is reset.

Like vLLM, two blocks may hold the same hash (two requests that computed the same prefix at the
same time): both are cached, both emit ``BlockStored``, lookups use the first, and each eviction
emits its own ``BlockRemoved``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from splitserve.sim.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

KV_CACHE_GROUP = 0
"""vLLM's kv_cache_group_id of a model with one attention type; published as ``group_idx``."""


@dataclass(frozen=True)
class Allocation:
    block_ids: list[int]
    num_cached_tokens: int


class KVBlockPool:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        enable_kv_cache_events: bool = False,
        medium: str = MEDIUM_GPU,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.medium = medium
        self._refcount = [0] * num_blocks
        self._hash_of_block: list[int | None] = [None] * num_blocks
        # hash -> the blocks holding it, first cached first (an ordered set: lookups take the first).
        self._blocks_of_hash: dict[int, dict[int, None]] = {}
        self._free: OrderedDict[int, None] = OrderedDict((block, None) for block in range(num_blocks))
        self._events: list[KVEvent] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cached_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Blocks holding the longest cached prefix of ``hashes``."""
        found: list[int] = []
        if not self.enable_prefix_caching:
            return found
        for block_hash in hashes:
            holders = self._blocks_of_hash.get(block_hash)
            if not holders:
                break
            found.append(next(iter(holders)))
        return found

    def allocate(self, num_tokens: int, hashes: Sequence[int] = ()) -> Allocation | None:
        """Blocks for ``num_tokens`` tokens, reusing cached prefix blocks; None when KV is full.

        At least one token is always left to compute (as in vLLM: the last prompt token must run
        through the model to produce logits), so a fully cached prompt reuses one block fewer.
        """
        cached = self.cached_prefix(hashes[: (num_tokens - 1) // self.block_size])
        fresh_needed = self.blocks_for(num_tokens) - len(cached)
        cached_but_free = sum(1 for block in cached if self._refcount[block] == 0)
        if fresh_needed > self.num_free - cached_but_free:
            return None
        for block in cached:
            self._take(block)
        fresh = [self._pop_free() for _ in range(fresh_needed)]
        return Allocation(block_ids=cached + fresh, num_cached_tokens=len(cached) * self.block_size)

    def grow(self, block_ids: list[int], num_tokens: int) -> bool:
        """Append blocks to ``block_ids`` until they hold ``num_tokens``; False (unchanged) if KV is full."""
        missing = self.blocks_for(num_tokens) - len(block_ids)
        if missing > self.num_free:
            return False
        block_ids.extend(self._pop_free() for _ in range(max(0, missing)))
        return True

    def cache_full_blocks(
        self,
        block_ids: Sequence[int],
        hashes: Sequence[int],
        token_ids: Sequence[int],
        num_cached_blocks: int,
        num_full_blocks: int,
        lora_id: int | None = None,
        lora_name: str | None = None,
    ) -> None:
        """Put blocks ``num_cached_blocks`` to ``num_full_blocks`` of a request into the prefix cache.

        As vLLM's ``BlockPool.cache_full_blocks``: ``block_ids`` are the request's blocks, ``hashes``
        its chained block hashes (at least ``num_full_blocks``), ``token_ids`` the tokens of the newly
        full blocks only (prompt then output: vLLM passes the whole request, a slice is cheaper);
        blocks before ``num_cached_blocks`` are cached already (prefix hits or earlier steps) and are
        not announced again. ``lora_id`` and ``lora_name``: the request's adapter (None: the base model).
        """
        if not self.enable_prefix_caching or num_cached_blocks >= num_full_blocks:
            return
        for index in range(num_cached_blocks, num_full_blocks):
            self._insert(block_ids[index], hashes[index])
        if self.enable_kv_cache_events:
            if len(token_ids) != (num_full_blocks - num_cached_blocks) * self.block_size:
                raise ValueError("token_ids must be exactly the tokens of the newly cached blocks")
            self._events.append(
                BlockStored(
                    block_hashes=list(hashes[num_cached_blocks:num_full_blocks]),
                    parent_block_hash=hashes[num_cached_blocks - 1] if num_cached_blocks else None,
                    token_ids=list(token_ids),
                    block_size=self.block_size,
                    lora_id=lora_id,
                    medium=self.medium,
                    lora_name=lora_name,
                    extra_keys=[(lora_name,)] * (num_full_blocks - num_cached_blocks) if lora_name else None,
                    group_idx=KV_CACHE_GROUP,
                )
            )

    def free(self, block_ids: Sequence[int]) -> None:
        """Release one reference to each block, tail first (the order vLLM frees a request's blocks)."""
        reuse_first: list[int] = []
        for block in reversed(block_ids):
            if self._refcount[block] <= 0:
                raise ValueError(f"block {block} freed more often than taken")
            self._refcount[block] -= 1
            if self._refcount[block] == 0:
                if self._hash_of_block[block] is None:
                    reuse_first.append(block)
                else:
                    self._free[block] = None  # cached: evicted last (LRU)
        for block in reversed(reuse_first):
            self._free[block] = None
            self._free.move_to_end(block, last=False)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (vLLM's ``reset_prefix_cache``); False while any block is in use."""
        if self.num_used:
            return False
        self._blocks_of_hash.clear()
        self._hash_of_block = [None] * self.num_blocks
        if self.enable_kv_cache_events:
            self._events.append(AllBlocksCleared())
        return True

    def cached_hashes(self) -> set[int]:
        """The hashes of every block the prefix cache holds (what a subscriber's index should mirror)."""
        return set(self._blocks_of_hash)

    def take_events(self) -> list[KVEvent]:
        """The events recorded since the last call, oldest first (vLLM's ``BlockPool.take_events``)."""
        events, self._events = self._events, []
        return events

    def _insert(self, block: int, block_hash: int) -> None:
        if self._hash_of_block[block] is not None:
            return  # already holds content (cannot happen for a freshly filled block; kept defensive)
        self._hash_of_block[block] = block_hash
        self._blocks_of_hash.setdefault(block_hash, {})[block] = None

    def _take(self, block: int) -> None:
        if self._refcount[block] == 0:
            del self._free[block]
        self._refcount[block] += 1

    def _pop_free(self) -> int:
        block, _ = self._free.popitem(last=False)
        evicted_hash = self._hash_of_block[block]
        if evicted_hash is not None:
            holders = self._blocks_of_hash[evicted_hash]
            del holders[block]
            if not holders:
                del self._blocks_of_hash[evicted_hash]
            self._hash_of_block[block] = None
            if self.enable_kv_cache_events:
                self._events.append(
                    BlockRemoved(block_hashes=[evicted_hash], medium=self.medium, group_idx=KV_CACHE_GROUP)
                )
        self._refcount[block] = 1
        return block
