"""KV cache block pool with a prefix cache, modelled on vLLM's block manager (pure logic, no I/O).

Blocks are reference counted. A block whose count drops to zero goes to the free queue but keeps
its content hash, so a later request with the same prefix can reuse it (a prefix cache hit) until
the block is handed out again. The free queue is evicted least-recently-freed first, and a
request's blocks are freed tail first, so the shared beginnings of prompts survive longest.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Allocation:
    block_ids: list[int]
    num_cached_tokens: int


class KVBlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._refcount = [0] * num_blocks
        self._hash_of_block: list[int | None] = [None] * num_blocks
        self._block_of_hash: dict[int, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict((block, None) for block in range(num_blocks))

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
            block = self._block_of_hash.get(block_hash)
            if block is None:
                break
            found.append(block)
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

    def register(self, block_ids: Sequence[int], hashes: Sequence[int]) -> None:
        """Record that ``block_ids`` now hold the content named by ``hashes`` (full blocks only)."""
        if not self.enable_prefix_caching:
            return
        for block, block_hash in zip(block_ids, hashes, strict=False):
            if self._hash_of_block[block] is None and block_hash not in self._block_of_hash:
                self._hash_of_block[block] = block_hash
                self._block_of_hash[block_hash] = block

    def free(self, block_ids: Sequence[int]) -> None:
        for block in reversed(block_ids):
            if self._refcount[block] <= 0:
                raise ValueError(f"block {block} freed more often than taken")
            self._refcount[block] -= 1
            if self._refcount[block] == 0:
                self._free[block] = None

    def _take(self, block: int) -> None:
        if self._refcount[block] == 0:
            del self._free[block]
        self._refcount[block] += 1

    def _pop_free(self) -> int:
        block, _ = self._free.popitem(last=False)
        evicted_hash = self._hash_of_block[block]
        if evicted_hash is not None:
            del self._block_of_hash[evicted_hash]
            self._hash_of_block[block] = None
        self._refcount[block] = 1
        return block
