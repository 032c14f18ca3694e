"""Routing policies: pure choices, checked by examples and properties."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from splitserve.router.policies import (
    KvAware,
    LeastLoaded,
    PolicyName,
    PrefixAware,
    RoundRobin,
    RoutingRequest,
    make_policy,
)
from splitserve.router.tokens import PromptMeasurer


@dataclass
class FakeWorker:
    key: str
    inflight: int = 0
    kv_usage: float | None = None
    waiting: float | None = None


def workers(loads: list[int]) -> list[FakeWorker]:
    return [FakeWorker(f"http://w{i}", load) for i, load in enumerate(loads)]


loads_strategy = st.lists(st.integers(min_value=0, max_value=1000), min_size=1, max_size=12)
hashes_strategy = st.lists(st.integers(min_value=0, max_value=2**64 - 1), max_size=20).map(tuple)


@pytest.mark.parametrize("name", [p.value for p in PolicyName])
@given(loads=loads_strategy, hashes=hashes_strategy)
def test_every_policy_picks_one_of_the_candidates(name: str, loads: list[int], hashes: tuple[int, ...]) -> None:
    candidates = workers(loads)
    policy = make_policy(name)
    for _ in range(3):
        assert policy.choose(candidates, RoutingRequest(len(hashes) * 16, hashes)) in candidates


def test_unknown_policy_name_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="round-robin, least-loaded, prefix-aware, kv-aware"):
        make_policy("random")


@given(count=st.integers(min_value=1, max_value=10), rounds=st.integers(min_value=1, max_value=5))
def test_round_robin_is_even(count: int, rounds: int) -> None:
    candidates = workers([0] * count)
    policy = RoundRobin()
    chosen = Counter(policy.choose(candidates, RoutingRequest()).key for _ in range(count * rounds))
    assert set(chosen.values()) == {rounds}


@given(loads=st.lists(st.integers(min_value=0, max_value=100), min_size=2, max_size=10), seed=st.integers())
def test_least_loaded_never_picks_the_single_most_loaded(loads: list[int], seed: int) -> None:
    candidates = workers(loads)
    policy = LeastLoaded(random.Random(seed))
    chosen = policy.choose(candidates, RoutingRequest())
    # Power of two choices: the pick is no busier than some other candidate.
    assert sum(1 for c in candidates if c.inflight >= chosen.inflight) >= 2


def test_least_loaded_prefers_idle_workers_on_average() -> None:
    candidates = workers([50, 0, 50, 50])
    policy = LeastLoaded(random.Random(7))
    picks = Counter(policy.choose(candidates, RoutingRequest()).key for _ in range(1000))
    assert picks["http://w1"] == max(picks.values())
    assert picks["http://w1"] > 400  # it is in half of the sampled pairs and wins every one


def test_kv_aware_avoids_full_kv_and_long_queues() -> None:
    candidates = [
        FakeWorker("a", 2, kv_usage=0.95, waiting=0),
        FakeWorker("b", 2, kv_usage=0.10, waiting=5),
        FakeWorker("c", 2, kv_usage=0.20, waiting=0),
    ]
    assert KvAware().choose(candidates, RoutingRequest()).key == "c"


def test_kv_aware_without_metrics_is_least_in_flight() -> None:
    assert KvAware().choose(workers([3, 1, 2]), RoutingRequest()).key == "http://w1"


def test_prefix_aware_sends_a_shared_prefix_back_to_the_same_worker() -> None:
    measurer = PromptMeasurer(None, block_tokens=4, approx_bytes_per_token=4, want_hashes=True)
    system = "You are a helpful assistant. " * 20
    policy = PrefixAware()
    candidates = workers([0, 0, 0, 0])
    first = measurer.measure({"prompt": system + "user one asks something"})
    home = policy.choose(candidates, RoutingRequest(first.tokens, first.block_hashes))
    for user in range(10):
        shape = measurer.measure({"prompt": system + f"user {user} asks another thing"})
        assert policy.choose(candidates, RoutingRequest(shape.tokens, shape.block_hashes)) is home


def test_prefix_aware_spreads_unrelated_prompts() -> None:
    measurer = PromptMeasurer(None, block_tokens=4, approx_bytes_per_token=4, want_hashes=True)
    policy = PrefixAware()
    candidates = workers([0, 0, 0, 0])
    picks: Counter[str] = Counter()
    for i in range(40):
        shape = measurer.measure({"prompt": f"{i} completely different prompt number {i} " * 4})
        picks[policy.choose(candidates, RoutingRequest(shape.tokens, shape.block_hashes)).key] += 1
    assert len(picks) == 4 and max(picks.values()) - min(picks.values()) <= 1


@given(hot_load=st.integers(min_value=0, max_value=500), others=st.lists(st.integers(0, 500), min_size=1, max_size=6))
def test_prefix_aware_never_exceeds_the_balance_bound(hot_load: int, others: list[int]) -> None:
    # However hot a prefix is, the pick is within ratio * least + slack in-flight requests.
    policy = PrefixAware(balance_ratio=1.5, balance_slack=4)
    candidates = workers([hot_load, *others])
    hashes = (1, 2, 3, 4)
    policy.choose([candidates[0]], RoutingRequest(64, hashes))  # the prefix lives on worker 0
    chosen = policy.choose(candidates, RoutingRequest(64, hashes))
    least = min(c.inflight for c in candidates)
    assert chosen.inflight <= least * 1.5 + 4
    if hot_load <= least * 1.5 + 4:
        assert chosen is candidates[0]


def test_prefix_aware_longest_match_wins() -> None:
    policy = PrefixAware()
    a, b = FakeWorker("a"), FakeWorker("b")
    policy.choose([a], RoutingRequest(0, (1, 2)))
    policy.choose([b], RoutingRequest(0, (1, 2, 3, 4)))
    assert policy.matched_blocks("a", (1, 2, 3, 4)) == 2
    assert policy.matched_blocks("b", (1, 2, 3, 4)) == 4
    assert policy.choose([a, b], RoutingRequest(0, (1, 2, 3, 4, 5))) is b
    policy.forget_worker("b")
    assert policy.matched_blocks("b", (1, 2, 3, 4)) == 0


def test_prefix_table_is_bounded() -> None:
    policy = PrefixAware(max_entries=100)
    worker = FakeWorker("a")
    for i in range(50):
        policy.choose([worker], RoutingRequest(0, tuple(range(i * 10, i * 10 + 10))))
    assert len(policy._table) == 100
