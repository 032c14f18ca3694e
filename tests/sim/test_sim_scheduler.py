from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.sim.config import EngineLimits
from splitserve.sim.scheduler import Phase, Scheduler, Sequence
from splitserve.sim.tokens import generate_text, output_text


def limits(**overrides: int) -> EngineLimits:
    base = {"block_size": 4, "num_kv_blocks": 64, "max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 64}
    base.update(overrides)
    return EngineLimits(**base)  # type: ignore[arg-type]


def seq(
    name: str,
    prompt_len: int,
    max_tokens: int,
    *,
    prompt_of: str | None = None,
    remote_prefill: bool = False,
    remote_decode: bool = False,
) -> Sequence:
    """A sequence whose prompt depends on its name (or on ``prompt_of``), so prompts differ by default."""
    start = 1000 * sum(map(ord, prompt_of or name))
    prompt = list(range(start, start + prompt_len))
    return Sequence(name, prompt, max_tokens, remote_prefill=remote_prefill, remote_decode=remote_decode)


def run_steps(scheduler: Scheduler, steps: int) -> list[list[str]]:
    """Tokens emitted per step, as request ids."""
    emitted = []
    for _ in range(steps):
        result = scheduler.complete(scheduler.schedule())
        emitted.append([s.request_id for s, _ in result.tokens])
    return emitted


def test_each_step_emits_one_token_per_running_sequence() -> None:
    scheduler = Scheduler(limits())
    for name, tokens in (("a", 3), ("b", 5), ("c", 1)):
        scheduler.add(seq(name, 6, tokens))
    emitted = run_steps(scheduler, 6)
    assert emitted[0] == ["a", "b", "c"]  # all prefilled in one step, each emits its first token
    assert emitted[1] == ["a", "b"]
    assert emitted[2] == ["a", "b"]
    assert emitted[3] == ["b"]
    assert emitted[4] == ["b"]
    assert emitted[5] == []
    assert scheduler.pool.num_used == 0


def test_requests_wait_for_kv_blocks_and_are_admitted_as_others_finish() -> None:
    # 4 blocks of 4 tokens: one 10-token prompt with 4 new tokens needs all of them.
    scheduler = Scheduler(limits(num_kv_blocks=4, max_model_len=16))
    first, second = seq("first", 10, 4), seq("second", 10, 2)
    scheduler.add(first)
    scheduler.add(second)
    plan = scheduler.schedule()
    assert [s.request_id for s in plan.admitted] == ["first"]
    assert scheduler.num_waiting_for_capacity == 1
    scheduler.complete(plan)
    emitted = run_steps(scheduler, 8)
    assert emitted[:3] == [["first"]] * 3
    assert second.phase is Phase.FINISHED and first.phase is Phase.FINISHED
    assert scheduler.num_waiting_for_capacity == 0


def test_max_num_seqs_caps_the_batch() -> None:
    scheduler = Scheduler(limits(max_num_seqs=2))
    for name in "abc":
        scheduler.add(seq(name, 2, 2))
    emitted = run_steps(scheduler, 4)
    assert emitted == [["a", "b"], ["a", "b"], ["c"], ["c"]]


def test_long_prompts_are_prefilled_in_chunks_within_the_token_budget() -> None:
    scheduler = Scheduler(limits(max_num_batched_tokens=4))
    long = seq("long", 10, 1)
    scheduler.add(long)
    plans = []
    for _ in range(3):
        plan = scheduler.schedule()
        plans.append(plan.num_prefill_tokens)
        scheduler.complete(plan)
    assert plans == [4, 4, 2]
    assert len(long.output) == 1


def test_prefix_cache_hit_skips_computed_blocks() -> None:
    scheduler = Scheduler(limits())
    scheduler.add(seq("a", 13, 1))
    run_steps(scheduler, 1)
    again = seq("b", 13, 1, prompt_of="a")
    scheduler.add(again)
    plan = scheduler.schedule()
    assert again.num_cached_tokens == 12
    assert plan.num_prefill_tokens == 1


def test_preemption_frees_blocks_and_recomputation_keeps_the_output() -> None:
    # Two sequences that each grow past what the pool can give both: the newer is preempted.
    scheduler = Scheduler(limits(num_kv_blocks=4, max_model_len=16))
    a, b = seq("a", 4, 8), seq("b", 4, 8)
    scheduler.add(a)
    scheduler.add(b)
    preempted = 0
    for _ in range(60):
        plan = scheduler.schedule()
        preempted += len(plan.preempted)
        scheduler.complete(plan)
    assert preempted >= 1
    assert a.phase is Phase.FINISHED and b.phase is Phase.FINISHED
    for s in (a, b):
        assert "".join(output_text(t) for t in s.output) == generate_text(s.prompt_token_ids, 8)
    assert scheduler.pool.num_used == 0


def test_remote_prefill_pulls_then_needs_one_step_for_the_first_token() -> None:
    scheduler = Scheduler(limits())
    remote = seq("remote", 9, 3, remote_prefill=True)
    scheduler.add(remote)
    plan = scheduler.schedule()
    assert plan.new_pulls == [remote] and not plan.has_work
    assert scheduler.num_deferred == 1 and len(remote.block_ids) == 3
    scheduler.pull_done(remote)
    plan = scheduler.schedule()
    # The last prompt token runs like a decode token: no prefill in this step.
    assert plan.resumed == [remote] and plan.num_prefill_tokens == 0 and plan.num_decode_seqs == 1
    scheduler.complete(plan)
    run_steps(scheduler, 2)
    assert remote.phase is Phase.FINISHED and len(remote.output) == 3


def test_a_full_batch_starts_no_kv_pull_and_a_free_slot_starts_every_waiting_one() -> None:
    # vLLM's scheduler takes nothing from its waiting queues once max_num_seqs requests run, not
    # even to start a KV load; a request loading KV is not in `running`, so one free slot lets it
    # start every waiting pull, and the pulled requests join the batch only as slots allow.
    scheduler = Scheduler(limits(max_num_seqs=2))
    short, long = seq("short", 2, 2), seq("long", 2, 20)
    remote = [seq(f"remote{i}", 9, 1, remote_prefill=True) for i in range(4)]
    for s in (short, long, *remote):
        scheduler.add(s)
    for _ in range(2):  # the second step gives "short" its last token
        plan = scheduler.schedule()
        assert not plan.new_pulls and len(scheduler.running) == 2
        scheduler.complete(plan)
    # Not pulled: no blocks on this engine, so the KV is still held by the prefill engine.
    assert all(r.phase is Phase.WAITING and not r.block_ids for r in remote)
    assert scheduler.num_waiting_for_capacity == 4 and scheduler.num_deferred == 0
    assert short.phase is Phase.FINISHED
    plan = scheduler.schedule()
    assert plan.new_pulls == remote and scheduler.num_deferred == 4
    scheduler.complete(plan)
    for r in remote:
        scheduler.pull_done(r)
    plan = scheduler.schedule()
    assert plan.admitted == [remote[0]] and scheduler.running == [long, remote[0]]
    assert scheduler.num_deferred == 3


def test_remote_decode_keeps_blocks_after_finishing() -> None:
    scheduler = Scheduler(limits())
    held = seq("held", 9, 1, remote_decode=True)
    scheduler.add(held)
    run_steps(scheduler, 1)
    assert held.phase is Phase.FINISHED
    assert scheduler.pool.num_used == 3 == len(held.block_ids)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 20), st.integers(1, 12)), min_size=1, max_size=12),
    st.integers(6, 20),
    st.integers(1, 4),
)
def test_every_request_finishes_with_its_greedy_text(
    requests: list[tuple[int, int]], num_blocks: int, max_seqs: int
) -> None:
    scheduler = Scheduler(limits(num_kv_blocks=num_blocks, max_num_seqs=max_seqs, max_model_len=num_blocks * 4))
    seqs = [seq(f"r{i}", p, t) for i, (p, t) in enumerate(requests) if p + t <= num_blocks * 4]
    for s in seqs:
        scheduler.add(s)
    for _ in range(2000):
        if all(s.phase is Phase.FINISHED for s in seqs):
            break
        scheduler.complete(scheduler.schedule())
    for s in seqs:
        assert s.phase is Phase.FINISHED
        assert "".join(output_text(t) for t in s.output) == generate_text(s.prompt_token_ids, s.max_tokens)
    assert scheduler.pool.num_used == 0
