from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from splitserve.sim.kv import Allocation, KVBlockPool


def register(pool: KVBlockPool, allocation: Allocation, hashes: list[int]) -> None:
    """Cache every full block the allocation's hashes name (the tokens are irrelevant here)."""
    num_full = min(len(allocation.block_ids), len(hashes))
    num_cached = min(allocation.num_cached_tokens // pool.block_size, num_full)
    tokens = list(range((num_full - num_cached) * pool.block_size))
    pool.cache_full_blocks(allocation.block_ids, hashes, tokens, num_cached, num_full)


def test_allocation_fails_cleanly_when_full() -> None:
    pool = KVBlockPool(num_blocks=4, block_size=4)
    first = pool.allocate(12)
    assert first is not None and len(first.block_ids) == 3
    assert pool.allocate(8) is None
    assert pool.num_free == 1
    pool.free(first.block_ids)
    assert pool.num_free == 4 and pool.usage == 0.0


def test_prefix_blocks_are_reused_and_shared() -> None:
    pool = KVBlockPool(num_blocks=8, block_size=4)
    hashes = [11, 22, 33]
    first = pool.allocate(12, hashes)
    assert first is not None and first.num_cached_tokens == 0
    register(pool, first, hashes)
    # While the first request runs, a second one shares its first two blocks (the last token of
    # a prompt is always computed, so the third block is never taken from the cache).
    second = pool.allocate(12, hashes)
    assert second is not None
    assert second.num_cached_tokens == 8
    assert second.block_ids[:2] == first.block_ids[:2]
    assert pool.num_used == 4
    pool.free(first.block_ids)
    pool.free(second.block_ids)
    # Freed blocks keep their content: a third request still hits.
    third = pool.allocate(13, hashes)
    assert third is not None and third.num_cached_tokens == 12


def test_eviction_forgets_cached_content() -> None:
    pool = KVBlockPool(num_blocks=2, block_size=4)
    first = pool.allocate(8, [1, 2])
    assert first is not None
    register(pool, first, [1, 2])
    pool.free(first.block_ids)
    other = pool.allocate(8, [7, 8])
    assert other is not None and other.num_cached_tokens == 0
    pool.free(other.block_ids)
    again = pool.allocate(8, [1, 2])
    assert again is not None and again.num_cached_tokens == 0


def test_prefix_caching_can_be_disabled() -> None:
    pool = KVBlockPool(num_blocks=8, block_size=4, enable_prefix_caching=False)
    first = pool.allocate(9, [1, 2])
    assert first is not None
    register(pool, first, [1, 2])
    second = pool.allocate(9, [1, 2])
    assert second is not None and second.num_cached_tokens == 0


@given(
    st.lists(
        st.tuples(st.booleans(), st.integers(1, 20), st.lists(st.integers(0, 3), max_size=5)),
        max_size=40,
    )
)
def test_blocks_are_never_lost_or_double_booked(ops: list[tuple[bool, int, list[int]]]) -> None:
    pool = KVBlockPool(num_blocks=10, block_size=4)
    live: list[list[int]] = []
    for allocate, tokens, prefix in ops:
        if allocate or not live:
            hashes = [hash(tuple(prefix[: i + 1])) for i in range(len(prefix))]
            got = pool.allocate(tokens, hashes)
            if got is not None:
                assert len(got.block_ids) == pool.blocks_for(tokens)
                assert len(set(got.block_ids)) == len(got.block_ids)
                register(pool, got, hashes)
                live.append(got.block_ids)
        else:
            pool.free(live.pop(0))
        distinct_live = {block for blocks in live for block in blocks}
        assert pool.num_used == len(distinct_live)
    for blocks in live:
        pool.free(blocks)
    assert pool.num_free == 10
