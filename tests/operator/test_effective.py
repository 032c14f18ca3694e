"""The effective spec: the user's spec with dynamic optimization's overrides, minus vetoed kinds."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from splitserve.api.spec import InferenceDeploymentSpec, Mode
from splitserve.api.status import OptimizationEvent
from splitserve.controller.loops.autopilot import record
from splitserve.optimization.autopilot import Action, from_event
from splitserve.optimization.overrides import (
    active_overrides,
    effective_spec,
    in_effect,
    merge_patch,
    merge_patch_between,
    minimal,
    without_vetoed,
)

SPEC: dict[str, Any] = {"model": {"name": "m", "source": {"uri": "s3://m"}}, "mode": "aggregated"}
SPECULATIVE_ON = {"engine": {"speculativeDecoding": {"method": "ngram"}}}

keys = st.sampled_from(["a", "b", "c", "mode", "engine"])
leaves = st.one_of(st.integers(-3, 3), st.sampled_from(["x", "y"]), st.booleans())
# Merge patches never hold empty objects (an empty object is a no-op only where the key exists).
trees = st.recursive(leaves, lambda inner: st.dictionaries(keys, inner, min_size=1, max_size=3), max_leaves=8)
objects = st.dictionaries(keys, trees, max_size=4)


def spec(**changes: Any) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.model_validate({**SPEC, **changes})


@given(objects, objects)
def test_merge_patch_between_gives_a_patch_that_turns_old_into_new(old: dict[str, Any], new: dict[str, Any]) -> None:
    assert merge_patch(old, merge_patch_between(old, new)) == new


@given(objects, objects)
def test_minimal_overrides_change_the_same_things(overrides: dict[str, Any], base: dict[str, Any]) -> None:
    merged = merge_patch(base, overrides)
    kept = minimal(overrides, base)
    assert merge_patch(base, kept) == merged
    assert (kept == {}) == (merged == base)
    assert minimal(kept, base) == kept


@given(objects)
def test_a_veto_of_every_kind_leaves_nothing_of_those_paths(overrides: dict[str, Any]) -> None:
    kept = without_vetoed(overrides, ["mode", "speculativeDecoding", "ratio"])
    assert "mode" not in kept
    assert "speculativeDecoding" not in (kept.get("engine") or {}) if isinstance(kept.get("engine"), dict) else True


def test_overrides_apply_only_while_dynamic_is_on() -> None:
    on = spec(optimization={"dynamic": True})
    off = spec(optimization={"dynamic": False})
    assert effective_spec(on, SPECULATIVE_ON).engine.speculative_decoding.method == "ngram"
    assert effective_spec(off, SPECULATIVE_ON).engine.speculative_decoding.method == "off"
    assert active_overrides(off, SPECULATIVE_ON) == {}


def test_a_veto_drops_its_override_and_keeps_the_others() -> None:
    overrides = {**SPECULATIVE_ON, "mode": "disaggregated"}
    vetoed = spec(optimization={"dynamic": True, "veto": ["speculativeDecoding"]})
    served = effective_spec(vetoed, overrides)
    assert served.engine.speculative_decoding.method == "off"
    assert served.mode is Mode.DISAGGREGATED
    assert active_overrides(vetoed, overrides) == {"mode": "disaggregated"}


def test_a_ratio_veto_drops_the_autoscaler_bounds_override_too() -> None:
    widened = {"autoscaling": {"prefillDecodeRatio": {"min": 0.25, "max": 3.0}}}
    autoscaled = {"autoscaling": {"enabled": True, "prefillDecodeRatio": {"min": 0.25, "max": 1.0}}}
    served = effective_spec(spec(optimization={"dynamic": True}, **autoscaled), widened)
    bounds = served.autoscaling.prefill_decode_ratio
    assert bounds is not None and (bounds.min, bounds.max) == (0.25, 3.0)
    vetoed = spec(optimization={"dynamic": True, "veto": ["ratio"]}, **autoscaled)
    assert active_overrides(vetoed, {**widened, "mode": "disaggregated"}) == {"mode": "disaggregated"}


def test_an_override_equal_to_the_spec_is_no_override() -> None:
    already = spec(optimization={"dynamic": True}, engine={"speculativeDecoding": {"method": "ngram"}})
    assert active_overrides(already, SPECULATIVE_ON) == {}
    assert in_effect({"mode": "aggregated"}, {"mode": "aggregated"}, dynamic=True, veto=[]) == {}


def test_the_rest_of_the_spec_is_kept() -> None:
    written = spec(optimization={"dynamic": True}, engine={"speculativeDecoding": {"numSpeculativeTokens": 5}})
    served = effective_spec(written, SPECULATIVE_ON)
    assert served.engine.speculative_decoding.num_speculative_tokens == 5
    assert served.model == written.model and served.optimization == written.optimization


def test_history_round_trips_through_status_and_an_undo_marks_the_change() -> None:
    change = Action(
        "speculativeDecoding",
        "turn speculative decoding on (ngram)",
        "low batch",
        SPECULATIVE_ON,
        {"engine": {"speculativeDecoding": {"method": "off"}}},
        "itl_p90",
        0.05,
        {"batch": 2.0},
    )
    undo = Action(change.kind, "undo: x", "worse", change.undo_patch, change.patch, "itl_p90", 0.2, {}, reverts=change)
    events: list[OptimizationEvent] = record([], change, 100.0)
    events = record(events, undo, 200.0)
    assert [event.undone for event in events] == [True, False]
    assert [event.reverted for event in events] == [False, True]
    rebuilt = [from_event(OptimizationEvent.model_validate(e.model_dump(by_alias=True))) for e in events]
    assert rebuilt[0] is not None and rebuilt[1] is not None
    assert rebuilt[0].reverted and rebuilt[0].time == 100.0 and rebuilt[0].action.patch == SPECULATIVE_ON
    assert rebuilt[0].action.baseline == 0.05 and rebuilt[0].action.reverts is None
    assert rebuilt[1].action.reverts is not None and not rebuilt[1].reverted
