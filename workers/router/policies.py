"""Routing policies: pure choices of one worker among candidates, behind one interface.

A policy sees only :class:`WorkerView` values (a key, in-flight count, and the load figures polled
from the worker's /metrics) and a :class:`RoutingRequest`; it never does I/O. Policies may keep
state (a round-robin cursor, a prefix table), so each pool gets its own instance.
"""

from __future__ import annotations

import enum
import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from splitserve.router.kv_index import KvBlockIndex, request_keys


class WorkerView(Protocol):
    @property
    def key(self) -> str: ...

    @property
    def inflight(self) -> int: ...

    @property
    def kv_usage(self) -> float | None:
        """KV-cache usage in [0, 1] from vllm:kv_cache_usage_perc, None when unknown."""
        ...

    @property
    def waiting(self) -> float | None:
        """Requests waiting in the engine, from vllm:num_requests_waiting, None when unknown."""
        ...


W = TypeVar("W", bound=WorkerView)


@dataclass(frozen=True)
class RoutingRequest:
    prompt_tokens: int = 0
    # Router-side chained hashes of the prompt's blocks, for prefix-aware.
    block_hashes: tuple[int, ...] = ()
    # The prompt's token ids as the engine will see them, and the cache salt vLLM hashes into its
    # first block, for precise-prefix (which derives its keys per engine block size).
    token_ids: tuple[int, ...] = ()
    cache_salt: str | None = None
    # The LoRA adapter the request names (None: the base model). vLLM hashes it into every block, so
    # only blocks computed under the same adapter match.
    lora_name: str | None = None


class WorkerChooser(Protocol):
    """What each routing policy is: it picks one worker of a pool for a request. (The spec's choice of
    policy by name is api.spec.RoutingPolicy; make_policy turns that name into one of these.)"""

    name: str

    def choose(self, candidates: Sequence[W], request: RoutingRequest) -> W:
        """Pick one of ``candidates`` (never empty)."""
        ...


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._cursor = 0

    def choose(self, candidates: Sequence[W], request: RoutingRequest) -> W:
        # Candidates are given in a stable order (by key), so the cursor walks them evenly.
        chosen = candidates[self._cursor % len(candidates)]
        self._cursor += 1
        return chosen


class LeastLoaded:
    """Power of two choices on in-flight requests: near-best balance at O(1) cost."""

    name = "least-loaded"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[W], request: RoutingRequest) -> W:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(range(len(candidates)), 2)
        first, second = candidates[a], candidates[b]
        return first if first.inflight <= second.inflight else second


class KvAware:
    """Lowest engine pressure: KV usage and waiting queue from the worker's /metrics, plus the
    router's own in-flight count (which is fresher than a one-second-old poll)."""

    name = "kv-aware"

    def __init__(self, waiting_weight: float = 1.0, kv_weight: float = 4.0) -> None:
        self._waiting_weight = waiting_weight
        self._kv_weight = kv_weight
        self._cursor = 0

    def score(self, worker: WorkerView) -> float:
        kv = worker.kv_usage if worker.kv_usage is not None else 0.0
        waiting = worker.waiting if worker.waiting is not None else 0.0
        # KV usage near 1.0 means preemptions are coming: weight it like several queued requests.
        return worker.inflight + self._waiting_weight * waiting + self._kv_weight * kv * 10.0

    def choose(self, candidates: Sequence[W], request: RoutingRequest) -> W:
        best = min(self.score(c) for c in candidates)
        ties = [c for c in candidates if self.score(c) == best]
        chosen = ties[self._cursor % len(ties)]
        self._cursor += 1
        return chosen


def load_limit(candidates: Sequence[W], balance_ratio: float, balance_slack: int) -> float:
    """In-flight count above which a candidate is overloaded: ``least * balance_ratio + balance_slack``."""
    return min(c.inflight for c in candidates) * balance_ratio + balance_slack


def longest_match_within_load(
    candidates: Sequence[W], match: Callable[[W], int], balance_ratio: float, balance_slack: int
) -> tuple[list[W], int]:
    """The candidates with the longest ``match`` among those not overloaded (load_limit), then the fewest
    in flight, and that match: a hot prefix spills onto more workers (which then cache it too) instead of
    piling onto one.
    """
    limit = load_limit(candidates, balance_ratio, balance_slack)
    best_match = -1
    best: list[W] = []
    for candidate in candidates:
        if candidate.inflight > limit:
            continue
        length = match(candidate)
        if length > best_match:
            best_match, best = length, [candidate]
        elif length == best_match:
            best.append(candidate)
    fewest = min(c.inflight for c in best)
    return [c for c in best if c.inflight == fewest], best_match


class PrefixAware:
    """Send a prompt where its longest prefix went before, unless that worker is overloaded.

    A table maps each chained block hash to the few workers that were sent that prefix (LRU-bounded).
    Candidates whose in-flight count exceeds ``min_inflight * balance_ratio + balance_slack`` are not
    eligible, so a hot prefix spills onto further workers (which then also own it) instead of piling
    onto one. Among eligible candidates: longest match, then fewest in flight.
    """

    name = "prefix-aware"

    def __init__(
        self,
        max_entries: int = 200_000,
        owners_per_block: int = 4,
        balance_ratio: float = 1.5,
        balance_slack: int = 4,
    ) -> None:
        self._table: OrderedDict[int, list[str]] = OrderedDict()
        self._max_entries = max_entries
        self._owners_per_block = owners_per_block
        self._balance_ratio = balance_ratio
        self._balance_slack = balance_slack
        self._cursor = 0
        # Blocks of the last request already sent to the chosen worker (per-model hit metrics).
        self.last_matched_blocks = 0

    def matched_blocks(self, key: str, hashes: Sequence[int]) -> int:
        count = 0
        for h in hashes:
            owners = self._table.get(h)
            if owners is None or key not in owners:
                break
            count += 1
        return count

    def choose(self, candidates: Sequence[W], request: RoutingRequest) -> W:
        hashes = request.block_hashes
        ties, self.last_matched_blocks = longest_match_within_load(
            candidates, lambda c: self.matched_blocks(c.key, hashes), self._balance_ratio, self._balance_slack
        )
        chosen = ties[self._cursor % len(ties)]
        self._cursor += 1
        self._remember(chosen.key, hashes)
        return chosen

    def _remember(self, key: str, hashes: Sequence[int]) -> None:
        table = self._table
        for h in hashes:
            owners = table.get(h)
            if owners is None:
                table[h] = [key]
            else:
                table.move_to_end(h)
                if key in owners:
                    owners.remove(key)
                owners.append(key)
                if len(owners) > self._owners_per_block:
                    del owners[0]
        while len(table) > self._max_entries:
            table.popitem(last=False)

    def forget_worker(self, key: str) -> None:
        """Drop a removed worker from the table so its prefixes stop attracting requests."""
        for h in [h for h, owners in self._table.items() if key in owners]:
            owners = self._table[h]
            owners.remove(key)
            if not owners:
                del self._table[h]


class CacheView(Protocol):
    """What precise-prefix reads of the KV-event index (splitserve.router.kv_index.KvBlockIndex)."""

    def has_events(self, worker: str) -> bool: ...

    def block_size(self, worker: str) -> int | None: ...

    def matched_blocks(self, worker: str, keys: Sequence[int]) -> int: ...


class PrecisePrefix:
    """Send a prompt to the worker whose prefix cache *really* holds its longest prefix.

    The cache view is built from the engines' own KV events, so it follows evictions, restarts and
    other routers' traffic, which :class:`PrefixAware`'s memory of its own choices cannot. The load
    bound is the same as prefix-aware's. Workers whose events have not started count as holding
    nothing, so with no events at all this is least-in-flight routing.
    """

    name = "precise-prefix"

    def __init__(self, cache: CacheView, balance_ratio: float = 1.5, balance_slack: int = 4) -> None:
        self.cache = cache
        self._balance_ratio = balance_ratio
        self._balance_slack = balance_slack
        self._cursor = 0
        # Prompt tokens the last chosen worker holds in its prefix cache (per-model hit metrics).
        self.last_matched_tokens = 0

    def matched_tokens(self, worker: str, request: RoutingRequest, keys_by_size: dict[int, tuple[int, ...]]) -> int:
        cache = self.cache
        if not request.token_ids or not cache.has_events(worker):
            return 0
        size = cache.block_size(worker)
        if not size:
            return 0
        keys = keys_by_size.get(size)
        if keys is None:
            keys = request_keys(request.token_ids, size, lora_name=request.lora_name, cache_salt=request.cache_salt)
            keys_by_size[size] = keys
        return cache.matched_blocks(worker, keys) * size

    def choose(self, candidates: Sequence[W], request: RoutingRequest) -> W:
        keys_by_size: dict[int, tuple[int, ...]] = {}  # the request's keys, computed once per block size
        ties, self.last_matched_tokens = longest_match_within_load(
            candidates,
            lambda c: self.matched_tokens(c.key, request, keys_by_size),
            self._balance_ratio,
            self._balance_slack,
        )
        chosen = ties[self._cursor % len(ties)]
        self._cursor += 1
        return chosen


def prefer_active_adapter(
    candidates: Sequence[W], is_active: Callable[[W], bool], balance_ratio: float = 1.5, balance_slack: int = 4
) -> Sequence[W]:
    """LoRA affinity, as llm-d's scorer: of ``candidates`` (all serving the adapter), those where it
    is already active (running or waiting in the engine, so it holds a LoRA slot and needs no swap-in),
    unless they are overloaded by prefix-aware's bound; otherwise all of them."""
    active = [c for c in candidates if is_active(c)]
    if not active or len(active) == len(candidates):
        return candidates
    limit = load_limit(candidates, balance_ratio, balance_slack)
    within = [c for c in active if c.inflight <= limit]
    return within or candidates


class PolicyName(enum.StrEnum):
    ROUND_ROBIN = "round-robin"
    LEAST_LOADED = "least-loaded"
    PREFIX_AWARE = "prefix-aware"
    KV_AWARE = "kv-aware"
    PRECISE_PREFIX = "precise-prefix"


POLICY_FACTORIES: dict[PolicyName, Callable[[], WorkerChooser]] = {
    PolicyName.ROUND_ROBIN: RoundRobin,
    PolicyName.LEAST_LOADED: LeastLoaded,
    PolicyName.PREFIX_AWARE: PrefixAware,
    PolicyName.KV_AWARE: KvAware,
    # Each pool gets its own index; the pool feeds it from its workers' KV events.
    PolicyName.PRECISE_PREFIX: lambda: PrecisePrefix(KvBlockIndex()),
}


def make_policy(name: str) -> WorkerChooser:
    """A fresh policy by its CLI name; ValueError names the valid ones."""
    try:
        policy_name = PolicyName(name)
    except ValueError:
        valid = ", ".join(p.value for p in PolicyName)
        raise ValueError(f"unknown routing policy {name!r} (valid: {valid})") from None
    return POLICY_FACTORIES[policy_name]()
