"""The speculative-decoding model of the simulator: expected yield, cost shape, and the scheduler's extra tokens."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from splitserve.sim.config import PROFILES, EngineLimits
from splitserve.sim.scheduler import Scheduler, Sequence
from splitserve.sim.speculative import SpeculativeModel, SpeculativeScheduler

H100 = PROFILES["gpu-h100-8b"].latency
LIMITS = EngineLimits(
    block_size=16, num_kv_blocks=512, max_num_seqs=64, max_num_batched_tokens=4096, max_model_len=4096
)


@given(st.integers(1, 8), st.floats(0.0, 0.95))
def test_expected_tokens_is_the_geometric_sum(k: int, a: float) -> None:
    model = SpeculativeModel(num_speculative_tokens=k, acceptance_rate=a)
    assert model.expected_tokens_per_step == pytest.approx(sum(a**i for i in range(k + 1)))
    assert 1.0 <= model.expected_tokens_per_step <= k + 1


@given(st.integers(1, 6), st.floats(0.0, 0.9), st.integers(0, 2**32))
def test_accepted_guesses_stay_within_k(k: int, a: float, seed: int) -> None:
    model = SpeculativeModel(num_speculative_tokens=k, acceptance_rate=a)
    rng = random.Random(seed)
    assert all(0 <= model.accepted(rng) <= k for _ in range(50))


def test_sampled_yield_matches_the_formula() -> None:
    model = SpeculativeModel(num_speculative_tokens=3, acceptance_rate=0.6)
    rng = random.Random(1)
    mean = sum(1 + model.accepted(rng) for _ in range(20_000)) / 20_000
    assert mean == pytest.approx(model.expected_tokens_per_step, rel=0.03)


def test_pays_at_small_batches_and_hurts_at_large_ones() -> None:
    model = SpeculativeModel(num_speculative_tokens=3, acceptance_rate=0.6)
    plain = [H100.step_seconds(n, 0) for n in (1, 8, 256)]
    speculative = [model.per_token_seconds(H100, n) for n in (1, 8, 256)]
    assert speculative[0] < plain[0] / 1.8  # about 2x at batch 1
    assert speculative[1] < plain[1]
    weak = SpeculativeModel(num_speculative_tokens=3, acceptance_rate=0.3)
    assert weak.per_token_seconds(H100, 256) > H100.step_seconds(256, 0)  # compute-bound: guesses are waste
    assert model.decode_seconds(H100, 256) > H100.step_seconds(256, 0)  # a step always costs at least as much


def test_speculative_scheduler_finishes_in_fewer_steps_with_the_same_tokens() -> None:
    def steps_to_finish(scheduler: Scheduler) -> tuple[int, int]:
        seq = Sequence("r", list(range(100)), 60)
        scheduler.add(seq)
        steps = 0
        while seq.output == [] or len(seq.output) < 60:
            plan = scheduler.schedule()
            assert plan.has_work
            scheduler.complete(plan)
            steps += 1
        return steps, len(seq.output)

    plain_steps, plain_tokens = steps_to_finish(Scheduler(LIMITS))
    model = SpeculativeModel(num_speculative_tokens=3, acceptance_rate=0.7)
    fast_steps, fast_tokens = steps_to_finish(SpeculativeScheduler(LIMITS, model, random.Random(3)))
    assert plain_tokens == fast_tokens == 60
    assert fast_steps < plain_steps * 0.6
