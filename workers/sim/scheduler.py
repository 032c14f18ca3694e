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
slot starts every waiting pull at once. That last token is planned as a decode (in
``StepPlan.decode``, and listed in ``StepPlan.resumed``) and costed like one: the step runs one
position for it, not a prefill, so it pays no ``prefill_overhead_s``.

Prefix caching follows vLLM's ``KVCacheManager``: once a step has computed the tokens that fill a
block (prompt or generated), the block's hash is registered in the pool (``cache_full_blocks``),
which is also when the pool records a ``BlockStored`` event; pulled KV is registered when the pull
completes. Hashes chain over the prompt and then the output tokens, as vLLM's request block hashes do.

LoRA: a request for an adapter mixes the adapter into every block hash (vLLM's extra key ``("lora",
name, path)``), so its blocks are never a prefix hit for another adapter or the base model, and its
``BlockStored`` events carry ``lora_id``, ``lora_name`` and ``extra_keys``. As vLLM's scheduler, a
batch holds requests of at most ``max_loras`` adapters: a request for another adapter waits (the
requests behind it may go first) until a running adapter's last request leaves the batch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from splitserve.sim.config import EngineLimits, LatencyModel
from splitserve.sim.kv import KVBlockPool
from splitserve.sim.lora import LoRARequest
from splitserve.sim.tokens import (
    adapter_seed,
    block_hash,
    block_hashes,
    generation_seed,
    lora_extra_key,
    output_token,
    prompt_digest,
)


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
    generation: str = ""
    """The engine's KV generation: it seeds the output tokens (tokens.generation_seed)."""
    lora: LoRARequest | None = None
    """The LoRA adapter the request is for (None: the base model): it seeds the output and keys the blocks."""
    phase: Phase = Phase.WAITING
    kv_pulled: bool = False
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    prefill_target: int = 0
    output: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    num_cached_blocks: int = 0
    """Leading blocks already in the prefix cache (vLLM's per-request ``num_cached_block``)."""
    awaiting_last_token: bool = False
    """The prompt's KV arrived from a remote prefill; only its last token is left to compute."""
    _digest: bytes = b""
    _seed: bytes = b""
    _hashes: list[int] = field(default_factory=list)

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

    def seed(self) -> bytes:
        """What the output tokens are drawn from: the prompt's digest mixed with the generation."""
        if not self._seed:
            seed = generation_seed(self.digest(), self.generation)
            self._seed = adapter_seed(seed, self.lora.name if self.lora is not None else None)
        return self._seed

    @property
    def lora_name(self) -> str | None:
        return self.lora.name if self.lora is not None else None

    def extra_key(self) -> int:
        """What every block hash of this request mixes in: its adapter (0 for the base model)."""
        return 0 if self.lora is None else lora_extra_key(self.lora.name, self.lora.path)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``start:end`` of prompt then output (what the KV cache holds, in order)."""
        prompt = self.prompt_token_ids
        if end <= len(prompt):
            return prompt[start:end]
        cut = len(prompt)
        return prompt[start:] + self.output[: end - cut] if start < cut else self.output[start - cut : end - cut]

    def hashes(self, block_size: int, num_tokens: int | None = None) -> list[int]:
        """Chained hashes of the full blocks among the first ``num_tokens`` tokens (default: the prompt).

        Extended as output tokens fill blocks; the list returned may cover more blocks than asked.
        """
        wanted = (self.num_prompt_tokens if num_tokens is None else num_tokens) // block_size
        if len(self._hashes) < wanted:
            done = len(self._hashes)
            extra = self.extra_key()
            if not done and wanted * block_size <= self.num_prompt_tokens:
                self._hashes = block_hashes(self.prompt_token_ids, block_size, extra)  # all prompt blocks at once
            else:
                tokens = self.token_slice(done * block_size, wanted * block_size)
                parent = self._hashes[-1] if done else 0
                for offset in range(0, len(tokens), block_size):
                    parent = block_hash(parent, tokens[offset : offset + block_size], extra)
                    self._hashes.append(parent)
        return self._hashes


@dataclass
class StepPlan:
    decode: list[Sequence] = field(default_factory=list)
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)
    resumed: list[Sequence] = field(default_factory=list)
    """The sequences of ``decode`` whose KV was pulled from a remote prefill and that compute their
    last prompt token (and emit their first token) in this step."""
    admitted: list[Sequence] = field(default_factory=list)
    """Sequences that left the waiting queue for the batch in this plan (queue time ends)."""
    new_pulls: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_prefill_tokens(self) -> int:
        """Prompt tokens prefilled in this step (a resumed sequence's last token is not one)."""
        return sum(tokens for _, tokens in self.prefill)

    @property
    def num_decode_seqs(self) -> int:
        """Sequences computing one position in this step (resumed pulled sequences included)."""
        return len(self.decode)

    def seconds(self, latency: LatencyModel) -> float:
        """What this step costs. A resumed sequence's last prompt token costs a decode token (its KV
        came from the prefill engine; only one position runs), never a prefill's fixed overhead."""
        return latency.step_seconds(self.num_decode_seqs, self.num_prefill_tokens)

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
    def __init__(self, limits: EngineLimits, enable_kv_cache_events: bool = False, max_loras: int = 1) -> None:
        self.limits = limits
        self.max_loras = max_loras
        self.pool = KVBlockPool(
            limits.num_kv_blocks,
            limits.block_size,
            limits.enable_prefix_caching,
            enable_kv_cache_events=enable_kv_cache_events,
        )
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
        # Decodes first, so running sequences keep making progress under prefill pressure. A sequence
        # resumed from pulled KV computes one position, like a decode, and is planned as one.
        for seq in list(self.running):
            if seq.phase is not Phase.RUNNING or budget <= 0:
                continue
            if seq.prefilling and not seq.awaiting_last_token:
                continue
            if self._make_room(seq, seq.num_computed + 1, plan):
                plan.decode.append(seq)
                if seq.awaiting_last_token:
                    plan.resumed.append(seq)
                budget -= 1
        for seq in self.running:
            if budget <= 0:
                break
            if seq.prefilling and not seq.awaiting_last_token:
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
            self._cache_computed(seq)
            if not seq.prefilling:
                result.prefill_done.append(seq)
                self._emit(seq, result)
        for seq in plan.decode:
            if seq.phase is not Phase.RUNNING:
                continue
            seq.num_computed += 1
            self._cache_computed(seq)
            if seq.awaiting_last_token:  # its prompt is now complete: this is its first token
                seq.awaiting_last_token = False
                result.prefill_done.append(seq)
            self._emit(seq, result)
        return result

    def _cache_computed(self, seq: Sequence) -> None:
        """Register the blocks that the computed tokens of ``seq`` have filled (vLLM: cache_blocks)."""
        size = self.limits.block_size
        num_full = seq.num_computed // size
        if num_full <= seq.num_cached_blocks or not self.pool.enable_prefix_caching:
            return
        hashes = seq.hashes(size, num_full * size)
        tokens = seq.token_slice(seq.num_cached_blocks * size, num_full * size)
        lora = seq.lora
        self.pool.cache_full_blocks(
            seq.block_ids,
            hashes,
            tokens,
            seq.num_cached_blocks,
            num_full,
            lora_id=lora.int_id if lora is not None else None,
            lora_name=lora.name if lora is not None else None,
        )
        seq.num_cached_blocks = num_full

    def pull_done(self, seq: Sequence) -> None:
        """The remote KV of ``seq`` arrived: only the last prompt token is left to compute."""
        if seq.phase is not Phase.PULLING:
            return
        self.pulling.discard(seq)
        seq.kv_pulled = True
        # As vLLM's _update_waiting_for_remote_kv: the pulled blocks enter the prefix cache now.
        seq.num_computed = seq.num_prompt_tokens
        self._cache_computed(seq)
        seq.num_computed = seq.num_prompt_tokens - 1
        seq.prefill_target = seq.num_prompt_tokens
        seq.awaiting_last_token = True
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
        seq.num_cached_blocks = 0

    def _emit(self, seq: Sequence, result: StepResult) -> None:
        token = output_token(seq.seed(), len(seq.output))
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
        # take no slot, so a free slot lets every waiting pull start in the same step. A request
        # whose adapter would be one more than max_loras in the batch is skipped, in both queues,
        # and keeps its place.
        loras = {seq.lora_name for seq in self.running if seq.lora is not None}
        skipped: list[Sequence] = []
        while self.ready and len(self.running) < self.limits.max_num_seqs:
            seq = self.ready.popleft()
            if not self._lora_fits(seq, loras):
                skipped.append(seq)
                continue
            self._run(seq, plan, loras)
        self.ready.extendleft(reversed(skipped))
        skipped = []
        try:
            self._admit_waiting(plan, loras, skipped)
        finally:
            self.waiting.extendleft(reversed(skipped))

    def _admit_waiting(self, plan: StepPlan, loras: set[str | None], skipped: list[Sequence]) -> None:
        while self.waiting and len(self.running) < self.limits.max_num_seqs:
            seq = self.waiting[0]
            if not self._lora_fits(seq, loras):
                skipped.append(self.waiting.popleft())
                continue
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
            allocation = self.pool.allocate(target, seq.hashes(self.limits.block_size, target))
            if allocation is None:
                return
            self.waiting.popleft()
            seq.block_ids = allocation.block_ids
            seq.num_computed = allocation.num_cached_tokens
            seq.num_cached_blocks = allocation.num_cached_tokens // self.limits.block_size
            seq.prefill_target = target
            if not seq.output and not seq.num_preemptions:
                seq.num_cached_tokens = allocation.num_cached_tokens
            self._run(seq, plan, loras)

    def _lora_fits(self, seq: Sequence, loras: set[str | None]) -> bool:
        return seq.lora is None or seq.lora_name in loras or len(loras) < self.max_loras

    def _run(self, seq: Sequence, plan: StepPlan, loras: set[str | None]) -> None:
        seq.phase = Phase.RUNNING
        self.running.append(seq)
        plan.admitted.append(seq)
        if seq.lora is not None:
            loras.add(seq.lora_name)

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
        seq.awaiting_last_token = False  # its pulled KV is gone with its blocks: recomputed locally
        seq.phase = Phase.WAITING
        self.waiting.appendleft(seq)
        plan.preempted.append(seq)
        if seq in plan.decode:
            plan.decode.remove(seq)
        if seq in plan.resumed:
            plan.resumed.remove(seq)
        plan.prefill = [(other, chunk) for other, chunk in plan.prefill if other is not seq]
