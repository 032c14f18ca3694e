"""Autopilot: sustained window, hysteresis, rate limit, veto, undo, one change at a time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.api.spec import Mode
from splitserve.diagnosis.model_facts import KvShape, ModelFacts
from splitserve.diagnosis.scale import traffic_needs
from splitserve.diagnosis.telemetry import Reading, Telemetry
from splitserve.optimization.autopilot import (
    Action,
    AppliedAction,
    AutopilotPolicy,
    Decision,
    Sample,
    ServingState,
    decide_optimization,
    from_event,
    sample_from_input,
    state_from_spec,
)
from tests.diagnosis.conftest import InputFactory, SpecFactory

POLICY = AutopilotPolicy()  # window 600 s, settle 420 s, evaluation 900 s, min interval 1800 s
DISAGG_OFF = ServingState(Mode.DISAGGREGATED, "off", prefill_replicas=1, decode_replicas=2)
DISAGG_ON = ServingState(Mode.DISAGGREGATED, "ngram", prefill_replicas=1, decode_replicas=2)
AGG_OFF = ServingState(Mode.AGGREGATED, "off", prefill_replicas=1, decode_replicas=2)


def series(start: float, end: float, step: float = 60.0, **fields: Any) -> list[Sample]:
    """Samples every `step` seconds from start to end inclusive, all with the same values."""
    count = int((end - start) // step) + 1
    return [Sample(time=start + i * step, **fields) for i in range(count)]


def run(
    state: ServingState,
    samples: Sequence[Sample],
    now: float,
    *,
    history: Sequence[AppliedAction] = (),
    veto: Sequence[str] = (),
    dynamic: bool = True,
) -> Decision:
    return decide_optimization(
        dynamic=dynamic, veto=veto, state=state, samples=samples, history=history, now=now, policy=POLICY
    )


# Moderate load: no rule fires (between every on/off threshold).
CALM: dict[str, Any] = {"batch_per_replica": 12.0, "itl_p90": 0.04, "ttft_p90": 0.5, "ttft_inflation": 1.2}
LOW: dict[str, Any] = {**CALM, "batch_per_replica": 6.0}
HIGH: dict[str, Any] = {**CALM, "batch_per_replica": 40.0}


def test_nothing_happens_unless_dynamic_is_on() -> None:
    assert run(DISAGG_OFF, series(0, 1200, **LOW), 1200, dynamic=False).action is None


def test_speculative_decoding_turns_on_after_a_sustained_low_load_window() -> None:
    decision = run(DISAGG_OFF, series(0, 1200, **LOW), 1200)
    action = decision.action
    assert action is not None and action.kind == "speculativeDecoding"
    assert action.patch == {"engine": {"speculativeDecoding": {"method": "ngram"}}}
    assert action.undo_patch == {"engine": {"speculativeDecoding": {"method": "off"}}}
    assert action.target_metric == "itl_p90" and action.baseline == pytest.approx(0.04)
    assert action.numbers["batch"] == pytest.approx(6.0)


def test_draft_method_is_used_when_the_spec_names_a_draft_model() -> None:
    state = ServingState(Mode.DISAGGREGATED, "off", 1, 2, speculative_method_when_on="draft")
    action = run(state, series(0, 1200, **LOW), 1200).action
    assert action is not None and action.patch == {"engine": {"speculativeDecoding": {"method": "draft"}}}


def test_speculative_decoding_turns_off_at_sustained_high_load() -> None:
    action = run(DISAGG_ON, series(0, 1200, **HIGH), 1200).action
    assert action is not None and action.what == "turn speculative decoding off"


def test_one_sample_against_the_evidence_breaks_the_window() -> None:
    samples = series(0, 1200, **LOW)
    samples[-3] = Sample(samples[-3].time, **CALM)
    decision = run(DISAGG_OFF, samples, 1200)
    assert decision.action is None and "no sustained evidence" in decision.note


def test_missing_data_does_not_count_as_evidence() -> None:
    samples = series(0, 1200, **LOW)
    samples[-1] = Sample(samples[-1].time)
    assert run(DISAGG_OFF, samples, 1200).action is None


def test_not_enough_history_means_no_change() -> None:
    decision = run(DISAGG_OFF, series(900, 1200, **LOW), 1200)
    assert decision.action is None and "not enough history" in decision.note


def test_too_few_samples_in_the_window() -> None:
    samples = [Sample(0, **LOW), Sample(700, **LOW)]
    decision = run(DISAGG_OFF, samples, 1200)
    assert decision.action is None and "samples in the window" in decision.note


@given(st.lists(st.floats(min_value=8.5, max_value=31.5), min_size=11, max_size=11))
def test_hysteresis_band_never_toggles_speculative_decoding(batches: list[float]) -> None:
    samples = [Sample(i * 60.0, batch_per_replica=b, itl_p90=0.04) for i, b in enumerate(batches)]
    for state in (DISAGG_OFF, DISAGG_ON):
        action = run(state, samples, 600).action
        assert action is None or action.kind != "speculativeDecoding"


def _applied(action: Action, time: float, *, reverted: bool = False) -> AppliedAction:
    return AppliedAction(action, time, reverted)


def _spec_on_action() -> Action:
    action = run(DISAGG_OFF, series(0, 1200, **LOW), 1200).action
    assert action is not None
    return action


def test_waits_for_the_evaluation_period_after_a_change() -> None:
    history = [_applied(_spec_on_action(), 1200)]
    samples = series(0, 1500, **{**LOW, "itl_p90": 0.5})
    decision = run(DISAGG_ON, samples, 1500, history=history)
    assert decision.action is None and "waiting" in decision.note


def test_undo_when_the_target_metric_got_worse() -> None:
    original = _spec_on_action()  # baseline ITL 0.04
    history = [_applied(original, 1200)]
    samples = series(0, 1200, **LOW) + series(1260, 2100, **{**LOW, "itl_p90": 0.06})
    action = run(DISAGG_ON, samples, 2100, history=history).action
    assert action is not None and action.reverts is original
    assert action.patch == original.undo_patch
    assert action.numbers == {"before": pytest.approx(0.04), "after": pytest.approx(0.06)}
    event = action.to_event("2026-01-01T00:00:00Z")
    assert event.reverted and event.action.startswith("undo:")


def test_no_undo_within_the_tolerance_and_rate_limit_holds() -> None:
    history = [_applied(_spec_on_action(), 1200)]
    samples = series(0, 1200, **LOW) + series(1260, 2100, **{**LOW, "itl_p90": 0.043})  # +7.5% < 10%
    decision = run(DISAGG_ON, samples, 2100, history=history)
    assert decision.action is None and "rate limited" in decision.note


def test_rate_limit_after_an_undo_then_the_undone_change_is_not_retried() -> None:
    original = _spec_on_action()
    revert = Action(**{**original.__dict__, "reverts": original, "patch": original.undo_patch})
    history = [_applied(original, 1200, reverted=True), _applied(revert, 2000)]
    samples = series(0, 6000, **LOW)
    assert "rate limited" in run(DISAGG_OFF, samples, 3000, history=history).note
    decision = run(DISAGG_OFF, samples, 6000, history=history)
    assert decision.action is None and "undone recently" in decision.note
    later = 1200 + POLICY.retry_after_revert_s + 1200
    retried = run(DISAGG_OFF, series(0, later, **LOW), later, history=history).action
    assert retried is not None and retried.kind == "speculativeDecoding"


def test_evidence_from_before_the_last_change_does_not_count() -> None:
    history = [_applied(_spec_on_action(), 1200)]
    # Long after the change; only 300 s of samples since it.
    samples = series(0, 1200, **HIGH) + series(4700, 5000, **HIGH)
    decision = run(DISAGG_ON, samples, 5000, history=history)
    assert decision.action is None and "not enough history" in decision.note


def test_veto_blocks_a_kind_and_lets_the_next_through() -> None:
    # Low load on disaggregated pools supports both "aggregate" and "speculate"; mode goes first.
    samples = series(0, 1200, **{**LOW, "batch_per_replica": 2.0})
    first = run(DISAGG_OFF, samples, 1200).action
    assert first is not None and first.kind == "mode" and first.patch == {"mode": "aggregated"}
    vetoed = run(DISAGG_OFF, samples, 1200, veto=["mode"]).action
    assert vetoed is not None and vetoed.kind == "speculativeDecoding"
    nothing = run(DISAGG_OFF, samples, 1200, veto=["mode", "speculativeDecoding"])
    assert nothing.action is None and "vetoed" in nothing.note


def test_veto_also_blocks_the_undo() -> None:
    history = [_applied(_spec_on_action(), 1200)]
    samples = series(0, 1200, **LOW) + series(1260, 2100, **{**LOW, "itl_p90": 0.2})
    decision = run(DISAGG_ON, samples, 2100, history=history, veto=["speculativeDecoding"])
    assert decision.action is None and "vetoed" in decision.note


def test_disaggregate_under_sustained_interference_and_load() -> None:
    busy = {**CALM, "batch_per_replica": 24.0, "ttft_inflation": 3.0}
    action = run(AGG_OFF, series(0, 1200, **busy), 1200).action
    assert action is not None and action.patch == {"mode": "disaggregated"} and action.target_metric == "ttft_p90"
    # Interference without load, or load without interference: stay.
    assert run(AGG_OFF, series(0, 1200, **{**busy, "ttft_inflation": 1.5}), 1200).action is None
    assert run(AGG_OFF, series(0, 1200, **{**busy, "batch_per_replica": 12.0}), 1200).action is None


@pytest.mark.parametrize(
    ("needed", "expected_prefill"),
    [(1.5, 3), (0.1, None), (0.6, None)],  # 2 decode replicas: ratio 0.5 now; 1.5 needs 3 prefill
)
def test_ratio_changes_only_outside_the_band(needed: float, expected_prefill: int | None) -> None:
    state = ServingState(Mode.DISAGGREGATED, "off", prefill_replicas=1, decode_replicas=2)
    action = run(state, series(0, 1200, **{**CALM, "needed_ratio": needed}), 1200).action
    if expected_prefill is None:
        assert action is None
    else:
        assert action is not None and action.kind == "ratio"
        assert action.patch == {"prefill": {"replicas": expected_prefill}}
        assert action.undo_patch == {"prefill": {"replicas": 1}}


def test_ratio_lower_need_reduces_prefill() -> None:
    state = ServingState(Mode.DISAGGREGATED, "off", prefill_replicas=4, decode_replicas=4)
    action = run(state, series(0, 1200, **{**CALM, "needed_ratio": 0.25}), 1200).action
    assert action is not None and action.patch == {"prefill": {"replicas": 1}}


AUTOSCALED = ServingState(
    Mode.DISAGGREGATED, "off", prefill_replicas=1, decode_replicas=2, autoscaled=True, ratio_bounds=(0.25, 1.0)
)


@pytest.mark.parametrize(
    ("needed", "patch"),
    [
        (2.0, {"min": 0.25, "max": 3.0}),  # above max x band: the max moves to need x band
        (0.1, {"min": 0.0667, "max": 1.0}),  # below min / band: the min moves to need / band
        (1.2, None),  # above max but inside the band
        (0.5, None),  # inside the bounds
    ],
)
def test_with_an_autoscaler_the_ratio_lever_is_its_bounds(needed: float, patch: dict[str, float] | None) -> None:
    action = run(AUTOSCALED, series(0, 1200, **{**CALM, "needed_ratio": needed}), 1200).action
    if patch is None:
        assert action is None
        return
    assert action is not None and action.kind == "ratio" and action.target_metric == "ttft_p90"
    assert action.patch == {"autoscaling": {"prefillDecodeRatio": patch}}
    assert action.undo_patch == {"autoscaling": {"prefillDecodeRatio": {"min": 0.25, "max": 1.0}}}
    assert "prefill" not in action.patch  # the autoscaler owns the pool sizes


def test_with_an_autoscaler_and_no_bounds_the_ratio_is_left_to_it() -> None:
    unbounded = ServingState(Mode.DISAGGREGATED, "off", prefill_replicas=1, decode_replicas=2, autoscaled=True)
    assert run(unbounded, series(0, 1200, **{**CALM, "needed_ratio": 5.0}), 1200).action is None
    assert unbounded.highest_ratio is None and AUTOSCALED.highest_ratio == 1.0 and DISAGG_OFF.highest_ratio == 0.5


def test_state_reads_the_bounds_only_of_the_builtin_autoscaler(make_spec: SpecFactory) -> None:
    bounds = {"prefillDecodeRatio": {"min": 0.5, "max": 2.0}}
    builtin = state_from_spec(make_spec({"autoscaling": {"enabled": True, **bounds}}))
    assert builtin.autoscaled and builtin.ratio_bounds == (0.5, 2.0)
    keda = state_from_spec(make_spec({"autoscaling": {"enabled": True, "backend": "keda", **bounds}}))
    assert keda.autoscaled and keda.ratio_bounds is None
    static = state_from_spec(make_spec({"autoscaling": {"enabled": False, **bounds}}))
    assert not static.autoscaled and static.ratio_bounds is None


def test_policy_rejects_settings_without_hysteresis_or_evaluation() -> None:
    with pytest.raises(ValueError, match="hysteresis"):
        AutopilotPolicy(speculative_on_below_batch=16, speculative_off_above_batch=16)
    with pytest.raises(ValueError, match="evaluation"):
        AutopilotPolicy(evaluation_s=1800, min_interval_s=1800)


def test_state_and_samples_come_from_spec_and_telemetry(make_spec: SpecFactory, make_input: InputFactory) -> None:
    spec = make_spec(
        {
            "engine": {"speculativeDecoding": {"method": "off", "draftModel": "org/draft-1b"}},
            "prefill": {"replicas": 2},
            "decode": {"replicas": 3, "maxReplicas": 4},
        }
    )
    state = state_from_spec(spec)
    assert (state.mode, state.speculative_method, state.speculative_method_when_on) == (
        Mode.DISAGGREGATED,
        "off",
        "draft",
    )
    assert state.ratio == pytest.approx(2 / 3)

    values = {
        "running_per_replica": 5.0,
        "itl_p90": 0.03,
        "ttft_p90": 0.9,
        "prefill_time_p90": 0.3,
        "request_rate": 10.0,
        "prompt_tokens_rate": 20_000.0,
        "generation_tokens_rate": 2_000.0,
    }
    telemetry = Telemetry(**{name: Reading(value, "q") for name, value in values.items()})  # type: ignore[arg-type]
    facts = ModelFacts(8e9, "test", KvShape(32, 8, 128), "test", 32)
    sample = sample_from_input(make_input(spec, telemetry=telemetry, facts=facts), 42.0)
    assert sample.time == 42.0 and sample.batch_per_replica == 5.0
    assert sample.ttft_inflation == pytest.approx(3.0)
    needs = traffic_needs(make_input(spec, telemetry=telemetry, facts=facts))
    assert needs is not None and sample.needed_ratio == pytest.approx(needs[0] / needs[1])
    assert sample_from_input(make_input(spec, facts=facts), 1.0) == Sample(1.0)


def _apply(state: ServingState, action: Action) -> ServingState:
    patch = action.patch
    if "mode" in patch:
        return ServingState(
            Mode(patch["mode"]), state.speculative_method, state.prefill_replicas, state.decode_replicas
        )
    if "engine" in patch:
        method = patch["engine"]["speculativeDecoding"]["method"]
        return ServingState(state.mode, method, state.prefill_replicas, state.decode_replicas)
    return ServingState(state.mode, state.speculative_method, patch["prefill"]["replicas"], state.decode_replicas)


def _drive(loads: list[float], itl: list[float], veto: list[str]) -> list[AppliedAction]:
    """Run the autopilot every minute over a load trace (each level held 5 minutes), checking invariants."""
    state = DISAGG_OFF
    samples: list[Sample] = []
    history: list[AppliedAction] = []
    for minute in range(len(loads) * 5):
        now = minute * 60.0
        batch = loads[minute // 5]
        samples.append(Sample(now, batch, itl[minute % len(itl)], 0.5, 3.0 if batch > 20 else 1.1, needed_ratio=0.5))
        decision = run(state, samples, now, history=history, veto=veto)
        action = decision.action
        if action is None:
            continue
        assert action.kind not in veto
        if history:
            gap = now - history[-1].time
            if action.reverts is not None:
                assert POLICY.evaluation_s <= gap < POLICY.min_interval_s
                history[-1] = AppliedAction(history[-1].action, history[-1].time, reverted=True)
            else:
                assert gap >= POLICY.min_interval_s
        window = [s for s in samples if s.time >= now - POLICY.window_s]
        assert len(window) >= POLICY.min_samples or action.reverts is not None
        history.append(AppliedAction(action, now))
        state = _apply(state, action)
    return history


@settings(max_examples=40, deadline=None)
@given(
    loads=st.lists(st.floats(min_value=0, max_value=64), min_size=20, max_size=60),
    itl=st.lists(st.floats(min_value=0.01, max_value=0.2), min_size=1, max_size=10),
    veto=st.lists(st.sampled_from(["mode", "speculativeDecoding", "ratio"]), max_size=2),
)
def test_closed_loop_keeps_every_invariant(loads: list[float], itl: list[float], veto: list[str]) -> None:
    _drive(loads, itl, veto)


def test_closed_loop_follows_the_load() -> None:
    """An hour idle, then two hours busy: aggregate, speculate, then disaggregate and stop speculating."""
    loads = [2.0] * 12 + [40.0] * 24
    history = _drive(loads, [0.04], [])
    assert [entry.action.what for entry in history] == [
        "switch to aggregated",
        "turn speculative decoding on (ngram)",
        "switch to disaggregated",
        "turn speculative decoding off",
    ]


# --- speculative decoding is judged on the time per output token (vLLM's ITL is per engine step)


def test_speculative_decoding_is_judged_on_tpot_when_the_engines_export_it() -> None:
    samples = series(0, 1200, **{**LOW, "tpot_p90": 0.012})
    action = run(DISAGG_OFF, samples, 1200).action
    assert action is not None and action.kind == "speculativeDecoding"
    assert action.target_metric == "tpot_p90" and action.baseline == pytest.approx(0.012)
    assert action.numbers["tpot_p90"] == pytest.approx(0.012)
    assert action.to_event("2026-01-01T00:00:00Z").target_metric == "tpot_p90"


def test_a_speculative_step_that_looks_longer_per_step_but_halves_tpot_is_kept() -> None:
    """vLLM v1 observes one ITL per request per step: a draft model makes the step ~33% longer."""
    before = {**LOW, "itl_p90": 0.012, "tpot_p90": 0.012}
    after = {**LOW, "itl_p90": 0.016, "tpot_p90": 0.0074}
    original = run(DISAGG_OFF, series(0, 1200, **before), 1200).action
    assert original is not None
    samples = series(0, 1200, **before) + series(1260, 2100, **after)
    decision = run(DISAGG_ON, samples, 2100, history=[_applied(original, 1200)])
    assert decision.action is None and "rate limited" in decision.note


def test_a_speculative_change_that_makes_tpot_worse_is_undone() -> None:
    before = {**LOW, "tpot_p90": 0.012}
    original = run(DISAGG_OFF, series(0, 1200, **before), 1200).action
    assert original is not None
    samples = series(0, 1200, **before) + series(1260, 2100, **{**before, "itl_p90": 0.04, "tpot_p90": 0.02})
    action = run(DISAGG_ON, samples, 2100, history=[_applied(original, 1200)]).action
    assert action is not None and action.reverts is original
    assert action.numbers == {"before": pytest.approx(0.012), "after": pytest.approx(0.02)}


def test_old_history_entries_judged_on_itl_still_load_and_undo() -> None:
    original = _spec_on_action()  # samples without TPOT: the fallback, itl_p90
    assert original.target_metric == "itl_p90"
    event = original.to_event("2026-01-01T00:20:00Z", 1200.0)
    applied = from_event(event)
    assert applied is not None and applied.action.target_metric == "itl_p90"
    samples = series(0, 1200, **LOW) + series(1260, 2100, **{**LOW, "itl_p90": 0.06, "tpot_p90": 0.001})
    action = run(DISAGG_ON, samples, 2100, history=[applied]).action
    assert action is not None and action.reverts is not None and action.numbers["after"] == pytest.approx(0.06)
    tpot_event = event.model_copy(update={"target_metric": "tpot_p90"})
    loaded = from_event(tpot_event)
    assert loaded is not None and loaded.action.target_metric == "tpot_p90"


# --- the undo check ignores samples taken while the change settles


def test_undo_ignores_start_up_and_a_telemetry_window_full_of_the_old_state() -> None:
    """A prefill scale-up: TTFT keeps the backlog's value while the window refills, then falls far below."""
    state = ServingState(Mode.DISAGGREGATED, "off", prefill_replicas=1, decode_replicas=4)
    queueing = {**CALM, "ttft_p90": 90.0, "ttft_inflation": 30.0, "needed_ratio": 0.5}
    original = run(state, series(0, 1200, **queueing), 1200).action
    assert original is not None and original.kind == "ratio" and original.baseline == pytest.approx(90.0)
    settling = series(1260, 1200 + POLICY.settle_s, **{**queueing, "ttft_p90": 300.0})
    recovered = series(1200 + POLICY.settle_s + 60, 2100, **{**queueing, "ttft_p90": 8.0})
    samples = series(0, 1200, **queueing) + settling + recovered
    scaled = ServingState(Mode.DISAGGREGATED, "off", prefill_replicas=2, decode_replicas=4)
    decision = run(scaled, samples, 2100, history=[_applied(original, 1200)])
    assert decision.action is None and "rate limited" in decision.note


def test_a_change_still_worse_after_settling_is_undone() -> None:
    state = ServingState(Mode.DISAGGREGATED, "off", prefill_replicas=1, decode_replicas=4)
    queueing = {**CALM, "ttft_p90": 90.0, "ttft_inflation": 30.0, "needed_ratio": 0.5}
    original = run(state, series(0, 1200, **queueing), 1200).action
    assert original is not None
    samples = series(0, 1200, **queueing) + series(1260, 2100, **{**queueing, "ttft_p90": 120.0})
    scaled = ServingState(Mode.DISAGGREGATED, "off", prefill_replicas=2, decode_replicas=4)
    action = run(scaled, samples, 2100, history=[_applied(original, 1200)]).action
    assert action is not None and action.reverts is original


def test_evaluation_waits_for_enough_settled_samples() -> None:
    history = [_applied(_spec_on_action(), 1200)]
    # Telemetry missed every minute after settling: nothing to judge on yet, and nothing else happens.
    samples = series(0, 1200, **LOW) + series(1260, 1200 + POLICY.settle_s, **{**LOW, "itl_p90": 0.2})
    decision = run(DISAGG_ON, samples, 2100, history=history)
    assert decision.action is None and "settled" in decision.note


def test_policy_rejects_an_evaluation_before_the_settle_period_ends() -> None:
    with pytest.raises(ValueError, match="settle"):
        AutopilotPolicy(settle_s=600, evaluation_s=600)
    assert POLICY.settle_s < POLICY.evaluation_s < POLICY.min_interval_s


# --- a decode pool starved by prefill looks idle: add prefill, do not speculate or aggregate


PREFILL_STARVED: dict[str, Any] = {**LOW, "batch_per_replica": 2.0, "ttft_p90": 120.0, "ttft_inflation": 40.0}


def test_prefill_bound_window_changes_the_ratio_not_speculative_decoding() -> None:
    state = ServingState(Mode.DISAGGREGATED, "off", prefill_replicas=1, decode_replicas=4)
    decision = run(state, series(0, 1200, **{**PREFILL_STARVED, "needed_ratio": 0.5}), 1200)
    action = decision.action
    assert action is not None and action.kind == "ratio" and action.patch == {"prefill": {"replicas": 2}}
    vetoed = run(state, series(0, 1200, **{**PREFILL_STARVED, "needed_ratio": 0.5}), 1200, veto=["ratio"])
    assert vetoed.action is None and "prefill-bound" in vetoed.note


@pytest.mark.parametrize(
    "evidence",
    [
        {"ttft_inflation": 2.5},  # TTFT inflation alone
        {"ttft_inflation": 1.1, "needed_ratio": 2.0},  # the traffic's prefill need alone (ratio now 0.5)
        {"ttft_inflation": 1.1, "ttft_p90": 3.0, "ttft_slo": 1.0},  # a declared TTFT SLO missed
    ],
)
def test_prefill_bound_evidence_blocks_speculative_on_and_aggregated(evidence: dict[str, Any]) -> None:
    samples = series(0, 1200, **{**LOW, "batch_per_replica": 2.0, **evidence})
    decision = run(DISAGG_OFF, samples, 1200, veto=["ratio"])
    assert decision.action is None and "prefill-bound" in decision.note
    assert "switch to aggregated held back" in decision.note


def test_no_prefill_bound_evidence_lets_speculative_decoding_on() -> None:
    samples = series(0, 1200, **{**LOW, "ttft_inflation": 1.5, "needed_ratio": 0.6, "ttft_p90": 0.5, "ttft_slo": 1.0})
    action = run(DISAGG_OFF, samples, 1200).action
    assert action is not None and action.kind == "speculativeDecoding"


def test_speculative_off_is_never_held_back() -> None:
    samples = series(0, 1200, **{**HIGH, "ttft_inflation": 5.0, "needed_ratio": 3.0})
    action = run(DISAGG_ON, samples, 1200, veto=["ratio"]).action
    assert action is not None and action.what == "turn speculative decoding off"


def test_samples_carry_tpot_and_only_a_declared_ttft_slo(make_spec: SpecFactory, make_input: InputFactory) -> None:
    telemetry = Telemetry(tpot_p90=Reading(0.007, "q"), itl_p90=Reading(0.012, "q"))
    facts = ModelFacts(8e9, "test", KvShape(32, 8, 128), "test", 32)
    undeclared = sample_from_input(make_input(make_spec({}), telemetry=telemetry, facts=facts), 1.0)
    assert undeclared.tpot_p90 == pytest.approx(0.007) and undeclared.ttft_slo is None
    declared = make_spec({"autoscaling": {"prefill": {"ttftSloSeconds": 2.5}}})
    assert sample_from_input(make_input(declared, telemetry=telemetry, facts=facts), 1.0).ttft_slo == 2.5
