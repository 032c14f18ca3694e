"""Status roll-up and the drift check are pure: tested over tables of observations."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from splitserve.api.spec import Mode
from splitserve.api.status import InferenceDeploymentStatus, Problem
from splitserve.controller.drift import contains
from splitserve.controller.rollup import PoolObservation, roll_up


def pool(desired: int, ready: int, *, updated: int | None = None, up_to_date: bool = True) -> PoolObservation:
    return PoolObservation(desired, desired, ready, desired if updated is None else updated, up_to_date)


def status(**kwargs: Any) -> InferenceDeploymentStatus:
    arguments: dict[str, Any] = {
        "mode": Mode.DISAGGREGATED,
        "generation": 3,
        "previous": InferenceDeploymentStatus(),
        "prefill": pool(1, 1),
        "decode": pool(2, 2),
        "router": pool(1, 1),
        "endpoint": "http://demo-router.ns.svc:8000/v1",
        "problem": None,
        "now": "2026-12-02T10:00:00Z",
    }
    arguments.update(kwargs)
    return roll_up(**arguments)


def conditions(result: InferenceDeploymentStatus) -> dict[str, tuple[str, str]]:
    return {c.type: (c.status, c.reason) for c in result.conditions}


def test_all_ready() -> None:
    result = status()
    assert conditions(result)["Ready"] == ("True", "AllComponentsReady")
    assert conditions(result)["Progressing"] == ("False", "Stable")
    assert conditions(result)["Degraded"] == ("False", "AsExpected")
    assert result.observed_generation == 3
    assert result.decode.summary == "2/2" and result.ready == "True"
    assert all(c.observed_generation == 3 for c in result.conditions)


@pytest.mark.parametrize(
    ("overrides", "ready", "failing"),
    [
        ({"decode": pool(2, 0)}, ("False", "DecodeNotReady"), "DecodeReady"),
        ({"prefill": None}, ("False", "PrefillNotReady"), "PrefillReady"),
        ({"router": pool(2, 0)}, ("False", "RouterNotReady"), "RouterReady"),
    ],
)
def test_a_failing_part_makes_ready_false_with_its_reason(
    overrides: dict[str, Any], ready: tuple[str, str], failing: str
) -> None:
    result = status(**overrides)
    assert conditions(result)["Ready"] == ready
    assert conditions(result)[failing][0] == "False"
    ready_condition = next(c for c in result.conditions if c.type == "Ready")
    assert failing in ready_condition.message


def test_partial_readiness_serves_but_progresses() -> None:
    result = status(decode=pool(3, 1, updated=1))
    assert conditions(result)["DecodeReady"] == ("True", "MinimumReplicasReady")
    assert conditions(result)["Progressing"] == ("True", "RollingOut")


def test_scaled_to_zero_is_ready() -> None:
    assert conditions(status(decode=pool(0, 0)))["DecodeReady"] == ("True", "ScaledToZero")


def test_aggregated_mode_ignores_prefill() -> None:
    result = status(mode=Mode.AGGREGATED, prefill=None)
    assert conditions(result)["PrefillReady"] == ("True", "NotUsed")
    assert result.prefill.summary == "0/0"


def test_problem_sets_degraded_and_not_ready() -> None:
    result = status(problem=Problem("MissingSecret", "Secret hf not found"))
    assert conditions(result)["Degraded"] == ("True", "MissingSecret")
    assert conditions(result)["Ready"] == ("False", "MissingSecret")


def test_transition_time_moves_only_when_status_changes() -> None:
    first = status(now="2026-12-02T10:00:00Z")
    same = status(previous=first, now="2026-12-02T11:00:00Z")
    assert {c.type: c.last_transition_time for c in same.conditions}["Ready"] == "2026-12-02T10:00:00Z"
    broken = status(previous=same, decode=pool(2, 0), now="2026-12-02T12:00:00Z")
    times = {c.type: c.last_transition_time for c in broken.conditions}
    assert times["Ready"] == "2026-12-02T12:00:00Z"
    assert times["RouterReady"] == "2026-12-02T10:00:00Z"


def test_pool_observation_from_deployment() -> None:
    observed = PoolObservation.from_deployment(
        {
            "metadata": {"generation": 4},
            "spec": {"replicas": 2},
            "status": {"replicas": 2, "readyReplicas": 1, "updatedReplicas": 2, "observedGeneration": 3},
        }
    )
    assert observed == PoolObservation(2, 2, 1, 2, False)
    assert observed.rolling
    assert PoolObservation.from_deployment(None) is None


def test_contains_ignores_server_fields_but_sees_changes() -> None:
    desired = {"spec": {"replicas": 2, "template": {"args": ["a", "b"]}, "resources": {"cpu": "4"}}}
    observed = {"spec": {"replicas": 2, "template": {"args": ["a", "b"]}, "resources": {"cpu": 4}, "paused": False}}
    assert contains(observed, desired)
    assert not contains({"spec": {**observed["spec"], "replicas": 3}}, desired)
    assert not contains({"spec": {**observed["spec"], "template": {"args": ["a"]}}}, desired)
    assert not contains({}, desired)


@given(
    st.recursive(
        st.integers() | st.text(max_size=3),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=2), c, max_size=3),
    )
)
def test_contains_is_reflexive(value: Any) -> None:
    assert contains(value, value)


def test_with_condition_replaces_by_type_and_keeps_the_transition_time_while_status_holds() -> None:
    from splitserve.api.status import InferenceDeploymentStatus

    first = InferenceDeploymentStatus().with_condition(
        "Degraded", "True", "MissingSecret", "no secret", now="2026-12-04T08:00:00Z", generation=3
    )
    same = first.with_condition("Degraded", "True", "MissingPVC", "no pvc", now="2026-12-04T09:00:00Z", generation=4)
    flipped = same.with_condition("Degraded", "False", "AsExpected", "", now="2026-12-04T10:00:00Z", generation=4)
    assert [(c.type, c.reason, c.last_transition_time, c.observed_generation) for c in same.conditions] == [
        ("Degraded", "MissingPVC", "2026-12-04T08:00:00Z", 4)
    ]
    assert [(c.status, c.last_transition_time) for c in flipped.conditions] == [("False", "2026-12-04T10:00:00Z")]
    assert first.conditions[0].reason == "MissingSecret"  # a copy: the original is unchanged


def test_a_roles_pools_of_two_generations_combine_into_one_observation() -> None:
    def deployment(desired: int, ready: int, observed: int = 1) -> dict[str, Any]:
        status = {"replicas": desired, "readyReplicas": ready, "updatedReplicas": desired}
        return {
            "metadata": {"generation": 1},
            "spec": {"replicas": desired},
            "status": status | {"observedGeneration": observed},
        }

    combined = PoolObservation.combined([deployment(2, 2), deployment(1, 0, observed=0)])
    assert combined == PoolObservation(desired=3, replicas=3, ready=2, updated=3, up_to_date=False)
    assert combined.to_status().summary == "2/3"
    assert PoolObservation.combined([]) is None
