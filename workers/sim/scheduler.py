"""Continuous-batching scheduler of the simulated engine (pure logic: no clocks, no I/O).

Each call to ``schedule`` plans one engine step: every running sequence that finished its prefill
decodes one token, and prompt chunks are prefilled within the step's token budget. ``complete``
applies the plan once the step's time has passed. Waiting requests are admitted first come, first
served while KV blocks and batch slots allow; when a decoding sequence needs a block and none is
free, the newest running sequence is preempted (its blocks freed, recomputed later), as vLLM does.

Requests that carry KV from a remote prefill are admitted into a separate "pulling" set while the
engine fetches their blocks (vLLM's WAITING_FOR_REMOTE_KVS, reported as waiting reason "deferred"),
then join the batch needing only their last prompt token computed. As in vLLM, a pull starts only
while the batch has a free slot (fewer than ``max_num_seqs`` running), and pulling sequences take
no slot: a saturated decode engine leaves the KV held on the prefill engine, and the first free
slot starts every waiting pull at once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from splitserve.sim.config import EngineLimits
from splitserve.sim.kv import KVBlockPool
from splitserve.sim.tokens import block_hashes, output_token, prompt_digest


class Phase(Enum):
    WAITING = "waiting"
    PULLING = "pulling"
    READY = "ready"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request as the scheduler sees it."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    remote_prefill: bool = False
    """KV for the prompt comes from a remote prefill engine (decode side of P/D)."""
    remote_decode: bool = False
    """Keep the KV after finishing so a remote decode engine can pull it (prefill side of P/D)."""
    phase: Phase = Phase.WAITING
    kv_pulled: bool = False
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    prefill_target: int = 0
    output: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    _digest: bytes = b""
    _hashes: list[int] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.prefill_target

    def digest(self) -> bytes:
        if not self._digest:
            self._digest = prompt_digest(self.prompt_token_ids)
        return self._digest

    def hashes(self, block_size: int) -> list[int]:
        if self._hashes is None:
            self._hashes = block_hashes(self.prompt_token_ids, block_size)
        return self._hashes


@dataclass
class StepPlan:
    decode: list[Sequence] = field(default_factory=list)
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
    """Sequences that left the waiting queue for the batch in this plan (queue time ends)."""
    new_pulls: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(tokens for _, tokens in self.prefill)

    @property
    def has_work(self) -> bool:
        return bool(self.decode or self.prefill)


@dataclass
class StepResult:
    tokens: list[tuple[Sequence, int]] = field(default_factory=list)
    """(sequence, token id) for every token emitted by the step, in batch order."""
    prefill_done: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(self, limits: EngineLimits) -> None:
        self.limits = limits
        self.pool = KVBlockPool(limits.num_kv_blocks, limits.block_size, limits.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.pulling: set[Sequence] = set()
        self.ready: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def num_waiting_for_capacity(self) -> int:
        return len(self.waiting)

    @property
    def num_deferred(self) -> int:
        return len(self.pulling) + len(self.ready)

    def add(self, seq: Sequence) -> None:
        seq.phase = Phase.WAITING
        self.waiting.append(seq)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        self._admit(plan)
        budget = self.limits.max_num_batched_tokens
        # Decodes first, so running sequences keep making progress under prefill pressure.
        for seq in list(self.running):
            if seq.phase is not Phase.RUNNING or seq.prefilling or budget <= 0:
                continue
            if self._make_room(seq, seq.num_computed + 1, plan):
                plan.decode.append(seq)
                budget -= 1
        for seq in self.running:
            if budget <= 0:
                break
            if seq.prefilling:
                chunk = min(seq.prefill_target - seq.num_computed, budget)
                plan.prefill.append((seq, chunk))
                budget -= chunk
        return plan

    def complete(self, plan: StepPlan) -> StepResult:
        result = StepResult()
        for seq, chunk in plan.prefill:
            if seq.phase is not Phase.RUNNING:
                continue  # aborted during the step
            seq.num_computed += chunk
            if not seq.prefilling:
                self.pool.register(seq.block_ids, seq.hashes(self.limits.block_size))
                result.prefill_done.append(seq)
                self._emit(seq, result)
        for seq in plan.decode:
            if seq.phase is not Phase.RUNNING:
                continue
            seq.num_computed += 1
            self._emit(seq, result)
        return result

    def pull_done(self, seq: Sequence) -> None:
        """The remote KV of ``seq`` arrived: only the last prompt token is left to compute."""
        if seq.phase is not Phase.PULLING:
            return
        self.pulling.discard(seq)
        seq.kv_pulled = True
        seq.num_computed = seq.num_prompt_tokens - 1
        seq.prefill_target = seq.num_prompt_tokens
        seq.phase = Phase.READY
        self.ready.append(seq)

    def pull_failed_recompute(self, seq: Sequence) -> None:
        """The remote KV of ``seq`` is lost: prefill it locally instead, ahead of other waiting work."""
        if seq.phase is not Phase.PULLING:
            return
        self.pulling.discard(seq)
        self._release(seq)
        seq.remote_prefill = False
        seq.phase = Phase.WAITING
        self.waiting.appendleft(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop ``seq`` wherever it is and free its blocks (client gone, transfer failed)."""
        if seq.phase is Phase.FINISHED:
            return
        if seq.phase is Phase.WAITING:
            self.waiting.remove(seq)
        elif seq.phase is Phase.PULLING:
            self.pulling.discard(seq)
        elif seq.phase is Phase.READY:
            self.ready.remove(seq)
        elif seq.phase is Phase.RUNNING:
            self.running.remove(seq)
        self._release(seq)
        seq.phase = Phase.FINISHED

    def _release(self, seq: Sequence) -> None:
        if seq.block_ids:
            self.pool.free(seq.block_ids)
            seq.block_ids = []

    def _emit(self, seq: Sequence, result: StepResult) -> None:
        token = output_token(seq.digest(), len(seq.output))
        seq.output.append(token)
        result.tokens.append((seq, token))
        if len(seq.output) >= seq.max_tokens:
            self.running.remove(seq)
            seq.phase = Phase.FINISHED
            if not seq.remote_decode:
                self._release(seq)  # with remote_decode the engine holds the blocks for the puller
            result.finished.append(seq)

    def _admit(self, plan: StepPlan) -> None:
        # As vLLM's Scheduler.schedule (v1/core/sched/scheduler.py): its waiting loop stops as soon
        # as len(running) reaches max_num_seqs, before it looks at the next request, so a pull
        # (blocks allocated, WAITING_FOR_REMOTE_KVS) starts only while the batch has a free slot
        # and a full decode leaves the KV held on the prefill side. Requests whose KV arrived are
        # taken first (its kv_holding_waiting queue). Pulling requests stay out of `running` and
        # take no slot, so a free slot lets every waiting pull start in the same step.
        while self.ready and len(self.running) < self.limits.max_num_seqs:
            seq = self.ready.popleft()
            seq.phase = Phase.RUNNING
            self.running.append(seq)
            plan.admitted.append(seq)
        while self.waiting and len(self.running) < self.limits.max_num_seqs:
            seq = self.waiting[0]
            if seq.remote_prefill and not seq.kv_pulled:
                allocation = self.pool.allocate(seq.num_prompt_tokens)
                if allocation is None:
                    return
                self.waiting.popleft()
                seq.block_ids = allocation.block_ids
                seq.phase = Phase.PULLING
                self.pulling.add(seq)
                plan.new_pulls.append(seq)
                continue
            # A preempted sequence recomputes its prompt and what it generated so far.
            target = seq.num_prompt_tokens + len(seq.output)
            allocation = self.pool.allocate(target, seq.hashes(self.limits.block_size))
            if allocation is None:
                return
            self.waiting.popleft()
            seq.block_ids = allocation.block_ids
            seq.num_computed = allocation.num_cached_tokens
            seq.prefill_target = target
            if not seq.output and not seq.num_preemptions:
                seq.num_cached_tokens = allocation.num_cached_tokens
            seq.phase = Phase.RUNNING
            self.running.append(seq)
            plan.admitted.append(seq)

    def _make_room(self, seq: Sequence, num_tokens: int, plan: StepPlan) -> bool:
        """Grow ``seq`` to ``num_tokens`` slots, preempting the newest sequences if KV is full."""
        while not self.pool.grow(seq.block_ids, num_tokens):
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.phase = Phase.WAITING
        self.waiting.appendleft(seq)
        plan.preempted.append(seq)
        if seq in plan.decode:
            plan.decode.remove(seq)
        plan.prefill = [(other, chunk) for other, chunk in plan.prefill if other is not seq]
