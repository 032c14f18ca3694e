"""A model of speculative decoding for the simulator (pure: no clocks, no I/O).

vLLM's draft-and-verify: a proposer (n-gram prompt lookup, or a small draft model) guesses ``k`` tokens
per sequence; one forward pass of the target model scores all ``k + 1`` positions; the longest prefix
of guesses the target agrees with is kept, plus one token of the target's own. With each guess
accepted independently with probability ``a`` the number of tokens a step yields per sequence is

    E[tokens] = 1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a)          (Leviathan et al., 2023)

What a step costs (the assumptions, stated so they can be argued with):

* Without speculation the simulator's ``LatencyModel`` applies: ``decode_base_s`` (reading the weights
  once: decode is memory-bandwidth-bound) ``+ decode_per_seq_s * n`` (each sequence's KV cache).
* With speculation the step scores ``n * (k + 1)`` positions instead of ``n``. The weights are still read
  once, but the matrix work grows with the positions: the step takes
  ``max(decode_base_s, n * (k + 1) * compute_s_per_token) + decode_per_seq_s * n + overhead_s``,
  i.e. it stays bandwidth-bound (nearly free extra positions) until the batch's positions reach the
  GPU's ridge point, then grows linearly. ``compute_s_per_token`` is ``2 * parameters / (peak FLOPS x MFU)``
  (the diagnosis's sizing: 8B parameters, an H100's 989 TFLOPS at 40% MFU -> ~40 us per position);
  ``overhead_s`` is the proposer and rejection sampler per step (n-gram lookup: ~0.5 ms; a draft model
  adds ``k`` small forward passes: ``draft_step_fraction * decode_base_s`` each).
* Attention reads each sequence's KV cache once for all its positions, so the per-sequence KV term
  is not multiplied by ``k + 1``.

So speculation pays at small batches (a step costs about the same and yields E[tokens] > 1) and stops
paying once ``n * (k + 1)`` positions make the step compute-bound, where rejected guesses are pure waste.
vLLM's own benchmarks report the same shape: speed-ups at low request rates, slow-downs at high rates
(vLLM blog, "How Speculative Decoding Boosts vLLM Performance by up to 2.8x", 2024-10-17).

How vLLM reports it: ``vllm:inter_token_latency_seconds`` is observed once per request per engine step
that produced tokens (v1 ``IterationStats``), whatever the number of tokens; with speculation it
measures the (longer) step, not the time per token. ``vllm:request_time_per_output_token_seconds``
(decode time / (output tokens - 1), per request) is the per-token view.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from splitserve.sim.config import EngineLimits, LatencyModel
from splitserve.sim.scheduler import Phase, Scheduler, StepPlan, StepResult

H100_8B_COMPUTE_S_PER_TOKEN = 2 * 8e9 / (989e12 * 0.4)  # ~40 us: 8B parameters, H100 bf16 peak, 40% MFU


@dataclass(frozen=True)
class SpeculativeModel:
    num_speculative_tokens: int = 3  # k, vLLM's num_speculative_tokens
    acceptance_rate: float = 0.6  # a, per guessed token
    compute_s_per_token: float = H100_8B_COMPUTE_S_PER_TOKEN
    overhead_s: float = 0.0005  # proposer + rejection sampling per step (n-gram lookup)
    draft_step_fraction: float = 0.0  # a draft model's forward pass as a share of decode_base_s (0: n-gram)

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        if not 0.0 <= self.acceptance_rate < 1.0:
            raise ValueError("acceptance_rate must be in [0, 1)")

    @property
    def expected_tokens_per_step(self) -> float:
        a, k = self.acceptance_rate, self.num_speculative_tokens
        return (1 - a ** (k + 1)) / (1 - a)

    def decode_seconds(self, latency: LatencyModel, num_decode_seqs: int) -> float:
        """The decode part of a step that verifies k guesses for each of `num_decode_seqs` sequences."""
        if not num_decode_seqs:
            return 0.0
        positions = num_decode_seqs * (self.num_speculative_tokens + 1)
        weights_or_compute = max(latency.decode_base_s, positions * self.compute_s_per_token)
        drafting = self.num_speculative_tokens * self.draft_step_fraction * latency.decode_base_s
        return weights_or_compute + latency.decode_per_seq_s * num_decode_seqs + self.overhead_s + drafting

    def step_seconds(self, latency: LatencyModel, num_decode_seqs: int, num_prefill_tokens: int) -> float:
        return self.decode_seconds(latency, num_decode_seqs) + latency.step_seconds(0, num_prefill_tokens)

    def per_token_seconds(self, latency: LatencyModel, batch: int) -> float:
        """Expected time per generated token of one sequence at a steady batch (decode only)."""
        return self.decode_seconds(latency, batch) / self.expected_tokens_per_step

    def accepted(self, rng: random.Random) -> int:
        """Guesses kept in one step for one sequence: the run of accepted guesses from the first."""
        kept = 0
        while kept < self.num_speculative_tokens and rng.random() < self.acceptance_rate:
            kept += 1
        return kept


class SpeculativeScheduler(Scheduler):
    """The simulator's scheduler where each decode step yields 1 + accepted guesses per sequence."""

    def __init__(self, limits: EngineLimits, model: SpeculativeModel, rng: random.Random) -> None:
        super().__init__(limits)
        self.model = model
        self.rng = rng

    def complete(self, plan: StepPlan) -> StepResult:
        result = super().complete(plan)
        resumed = set(plan.resumed)  # their first token: nothing drafted to verify yet
        for seq in plan.decode:
            if seq in resumed:
                continue
            extra = self.model.accepted(self.rng)
            while extra and seq.phase is Phase.RUNNING:
                # Accepted tokens need KV slots like any other; without a free block the step keeps fewer.
                if not self.pool.grow(seq.block_ids, seq.num_computed + 1):
                    break
                seq.num_computed += 1
                self._cache_computed(seq)  # blocks filled by accepted guesses enter the prefix cache too
                self._emit(seq, result)
                extra -= 1
        return result
