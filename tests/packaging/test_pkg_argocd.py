"""Argo CD health check of InferenceDeployment, run in a real Lua 5.1 (Argo CD embeds gopher-lua, a 5.1)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from pkg_k8s import validate_objects
from pkg_sources import REPO_ROOT

ARGOCD_DIR = REPO_ROOT / "deploy" / "argocd"
HEALTH_LUA = ARGOCD_DIR / "health-inferencedeployment.lua"
CM_PATCH = ARGOCD_DIR / "argocd-cm-patch.yaml"
HEALTH_KEY = "resource.customizations.health.splitserve.io_InferenceDeployment"

lupa = pytest.importorskip("lupa.lua51", reason="lupa (with its bundled Lua 5.1) is not installed")


def run_health(obj: dict[str, Any], script_path: Path = HEALTH_LUA) -> dict[str, str]:
    runtime = lupa.LuaRuntime()
    runtime.globals().obj = runtime.table_from(obj, recursive=True)
    result = runtime.execute(script_path.read_text())
    return {"status": result["status"], "message": result["message"]}


def condition(kind: str, status: str, reason: str = "", message: str = "") -> dict[str, Any]:
    return {"type": kind, "status": status, "reason": reason, "message": message, "observedGeneration": 3}


def idep(
    generation: int = 3, observed: int | None = 3, conditions: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    status: dict[str, Any] = {}
    if observed is not None:
        status["observedGeneration"] = observed
    if conditions is not None:
        status["conditions"] = conditions
    return {
        "apiVersion": "splitserve.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": "llama", "namespace": "ml", "generation": generation},
        "spec": {},
        "status": status,
    }


HEALTHY_CONDITIONS = [
    condition("Ready", "True", "AllComponentsReady", "prefill, decode and router are serving"),
    condition("PrefillReady", "True", "AllReplicasReady", "2/2 prefill replicas ready"),
    condition("DecodeReady", "True", "AllReplicasReady", "1/1 decode replicas ready"),
    condition("RouterReady", "True", "AllReplicasReady", "1/1 router replicas ready"),
    condition("Progressing", "False", "Stable", "every pool matches the spec"),
    condition("Degraded", "False", "AsExpected", "the spec is realised"),
]


def with_conditions(**overrides: dict[str, Any]) -> list[dict[str, Any]]:
    conditions = copy.deepcopy(HEALTHY_CONDITIONS)
    return [overrides.get(c["type"], c) for c in conditions]


def test_no_status_yet_is_progressing() -> None:
    obj = idep()
    del obj["status"]
    assert run_health(obj)["status"] == "Progressing"


def test_empty_conditions_are_progressing() -> None:
    assert run_health(idep(conditions=[]))["status"] == "Progressing"


def test_unobserved_generation_is_progressing_even_if_ready() -> None:
    health = run_health(idep(generation=4, observed=3, conditions=HEALTHY_CONDITIONS))
    assert health == {
        "status": "Progressing",
        "message": "Waiting for the operator to observe generation 4 (observed 3)",
    }


def test_missing_observed_generation_is_progressing() -> None:
    health = run_health(idep(observed=None, conditions=HEALTHY_CONDITIONS))
    assert health["status"] == "Progressing"
    assert "generation 3" in health["message"]


def test_ready_is_healthy() -> None:
    assert run_health(idep(conditions=HEALTHY_CONDITIONS)) == {
        "status": "Healthy",
        "message": "prefill, decode and router are serving",
    }


def test_not_ready_lists_every_failing_part() -> None:
    conditions = with_conditions(
        Ready=condition("Ready", "False", "PrefillNotReady", "PrefillReady: 0/2 prefill replicas ready; ..."),
        PrefillReady=condition("PrefillReady", "False", "NoReplicasReady", "0/2 prefill replicas ready"),
        RouterReady=condition("RouterReady", "False", "NotCreated", "the router Deployment does not exist yet"),
    )
    assert run_health(idep(conditions=conditions)) == {
        "status": "Degraded",
        "message": "PrefillReady: NoReplicasReady: 0/2 prefill replicas ready; "
        "RouterReady: NotCreated: the router Deployment does not exist yet",
    }


def test_degraded_condition_is_reported_with_the_parts() -> None:
    conditions = with_conditions(
        Ready=condition("Ready", "False", "MissingSecret", "secret hf-token not found"),
        DecodeReady=condition("DecodeReady", "False", "NoReplicasReady", "0/1 decode replicas ready"),
        Degraded=condition("Degraded", "True", "MissingSecret", "secret hf-token not found"),
    )
    health = run_health(idep(conditions=conditions))
    assert health["status"] == "Degraded"
    assert health["message"] == (
        "DecodeReady: NoReplicasReady: 0/1 decode replicas ready; Degraded: MissingSecret: secret hf-token not found"
    )


def test_not_ready_without_failing_parts_falls_back_to_ready_reason() -> None:
    conditions = with_conditions(Ready=condition("Ready", "False", "InvalidSpec", "tensor parallel size exceeds GPUs"))
    assert run_health(idep(conditions=conditions)) == {
        "status": "Degraded",
        "message": "Ready: InvalidSpec: tensor parallel size exceeds GPUs",
    }


def test_ready_unknown_and_missing_ready_are_progressing() -> None:
    unknown = with_conditions(Ready=condition("Ready", "Unknown", "Reconciling", "first reconcile"))
    assert run_health(idep(conditions=unknown)) == {
        "status": "Progressing",
        "message": "Ready: Reconciling: first reconcile",
    }
    no_ready = [c for c in HEALTHY_CONDITIONS if c["type"] != "Ready"]
    assert run_health(idep(conditions=no_ready))["status"] == "Progressing"


def test_condition_without_reason_or_message() -> None:
    conditions = with_conditions(
        Ready={"type": "Ready", "status": "False"}, RouterReady={"type": "RouterReady", "status": "False"}
    )
    assert run_health(idep(conditions=conditions)) == {"status": "Degraded", "message": "RouterReady"}


ROLLING_OUT = condition("Progressing", "True", "RollingOut", "generation 3f2a9c01d4: prefill 1/2, decode 2/3 ready")
PAUSED = condition("Progressing", "False", "RolloutPaused", "rollout of 3f2a9c01d4 paused")
STABLE = condition("Progressing", "False", "Stable", "every pool matches the spec")
PAUSE_NUMBERS = "Failed (error rate): error rate 30.0% vs 0.0% (limit +2.0%); TTFT p90 0.12s vs 0.11s (limit x1.5)"


def rollout(summary: str = "3f2a9c01d4 2/3 67%", paused: bool = False, message: str = "") -> dict[str, Any]:
    return {
        "generation": "3f2a9c01d4",
        "replacing": ["9b1e7f00aa"],
        "paused": paused,
        "reason": "RolloutPaused" if paused else "",
        "message": message,
        "summary": summary,
    }


def in_rollout(
    progressing: dict[str, Any], status_rollout: dict[str, Any] | None, **overrides: dict[str, Any]
) -> dict[str, Any]:
    obj = idep(conditions=with_conditions(Progressing=progressing, **overrides))
    if status_rollout is not None:
        obj["status"]["rollout"] = status_rollout
    return obj


ROLLOUT_CASES = [
    pytest.param(
        in_rollout(ROLLING_OUT, rollout()),
        "Progressing",
        "Rolling out 3f2a9c01d4 2/3 67%: generation 3f2a9c01d4: prefill 1/2, decode 2/3 ready",
        id="rolling-out-with-old-pools-ready",
    ),
    pytest.param(
        in_rollout(ROLLING_OUT, rollout(summary="")),
        "Progressing",
        "Rolling out generation 3f2a9c01d4: generation 3f2a9c01d4: prefill 1/2, decode 2/3 ready",
        id="rolling-out-before-the-first-summary",
    ),
    pytest.param(
        in_rollout(
            ROLLING_OUT,
            rollout(),
            Ready=condition("Ready", "Unknown", "DecodeNotReady", "DecodeReady: 0/1; waiting for the engines"),
        ),
        "Progressing",
        "Rolling out 3f2a9c01d4 2/3 67%: generation 3f2a9c01d4: prefill 1/2, decode 2/3 ready",
        id="rolling-out-while-ready-is-unknown",
    ),
    pytest.param(
        in_rollout(PAUSED, rollout(paused=True, message=PAUSE_NUMBERS)),
        "Degraded",
        f"Rollout paused (generation 3f2a9c01d4): {PAUSE_NUMBERS}",
        id="paused-by-the-analysis",
    ),
    pytest.param(
        in_rollout(PAUSED, None),
        "Degraded",
        "Rollout paused: rollout of 3f2a9c01d4 paused",
        id="paused-condition-without-rollout-status",
    ),
    pytest.param(
        in_rollout(ROLLING_OUT, rollout(paused=True, message=PAUSE_NUMBERS)),
        "Degraded",
        f"Rollout paused (generation 3f2a9c01d4): {PAUSE_NUMBERS}",
        id="paused-by-the-analysis-before-the-plan-saw-it",
    ),
    pytest.param(in_rollout(STABLE, None), "Healthy", "prefill, decode and router are serving", id="after-rollout"),
    pytest.param(
        in_rollout(ROLLING_OUT, None),
        "Healthy",
        "prefill, decode and router are serving",
        id="pods-rolling-within-one-generation-stay-healthy",
    ),
    pytest.param(
        in_rollout(
            ROLLING_OUT,
            rollout(),
            Ready=condition("Ready", "False", "DecodeNotReady", "..."),
            DecodeReady=condition("DecodeReady", "False", "NoReplicasReady", "0/3 decode replicas ready"),
        ),
        "Degraded",
        "DecodeReady: NoReplicasReady: 0/3 decode replicas ready",
        id="a-real-failure-during-a-rollout-is-degraded",
    ),
]


@pytest.mark.parametrize(("obj", "health", "message"), ROLLOUT_CASES)
def test_kv_generation_rollouts(obj: dict[str, Any], health: str, message: str) -> None:
    assert run_health(obj) == {"status": health, "message": message}


def test_unobserved_spec_change_of_a_paused_rollout_is_progressing() -> None:
    # Changing the spec again is how a paused rollout resumes: until the operator has seen it, Progressing.
    obj = in_rollout(PAUSED, rollout(paused=True, message=PAUSE_NUMBERS))
    obj["metadata"]["generation"] = 4
    assert run_health(obj)["status"] == "Progressing"


STATUSES = st.sampled_from(["True", "False", "Unknown"])


@given(
    ready=STATUSES,
    parts=st.tuples(STATUSES, STATUSES, STATUSES),
    degraded=st.booleans(),
    generation=st.integers(min_value=1, max_value=5),
    observed=st.integers(min_value=1, max_value=5),
)
def test_health_follows_the_rules_for_any_status(
    ready: str, parts: tuple[str, str, str], degraded: bool, generation: int, observed: int
) -> None:
    if observed > generation:
        observed = generation
    conditions = [condition("Ready", ready, "R", "ready message")]
    conditions += [
        condition(kind, status, f"{kind}Reason")
        for kind, status in zip(("PrefillReady", "DecodeReady", "RouterReady"), parts, strict=True)
    ]
    conditions.append(condition("Degraded", "True" if degraded else "False", "Broken" if degraded else "AsExpected"))
    health = run_health(idep(generation=generation, observed=observed, conditions=conditions))
    if observed < generation:
        assert health["status"] == "Progressing"
    elif ready == "True":
        assert health["status"] == "Healthy"
    elif ready == "False":
        assert health["status"] == "Degraded"
        for kind, status in zip(("PrefillReady", "DecodeReady", "RouterReady"), parts, strict=True):
            assert (f"{kind}: {kind}Reason" in health["message"]) == (status == "False")
        assert ("Degraded: Broken" in health["message"]) == degraded
    else:
        assert health["status"] == "Progressing"


def test_configmap_patch_carries_the_same_script() -> None:
    [patch] = [doc for doc in yaml.safe_load_all(CM_PATCH.read_text()) if doc]
    assert patch["metadata"] == {
        "name": "argocd-cm",
        "namespace": "argocd",
        "labels": {"app.kubernetes.io/name": "argocd-cm", "app.kubernetes.io/part-of": "argocd"},
    }
    assert patch["data"][HEALTH_KEY] == HEALTH_LUA.read_text()
    assert validate_objects([patch], custom_schemas={}).errors == []


def operator_status(**pools: Any) -> dict[str, Any]:
    """A status as the operator's own roll-up writes it (skips when the controller is not importable)."""
    rollup = pytest.importorskip("splitserve.controller.rollup", reason="operator roll-up not available")
    from splitserve.api.spec import Mode
    from splitserve.api.status import InferenceDeploymentStatus

    status = rollup.roll_up(
        mode=Mode.DISAGGREGATED,
        generation=3,
        previous=InferenceDeploymentStatus(),
        prefill=pools.get("prefill"),
        decode=pools.get("decode"),
        router=pools.get("router"),
        endpoint="http://llama-router.ml.svc:8000/v1",
        problem=pools.get("problem"),
        now="2026-12-02T12:00:00Z",
    )
    dumped: dict[str, Any] = status.to_wire()
    return dumped


def test_health_of_statuses_the_operator_really_writes() -> None:
    rollup = pytest.importorskip("splitserve.controller.rollup", reason="operator roll-up not available")
    up = rollup.PoolObservation(desired=1, replicas=1, ready=1, updated=1, up_to_date=True)
    down = rollup.PoolObservation(desired=2, replicas=2, ready=0, updated=2, up_to_date=True)
    obj = idep()
    obj["status"] = operator_status(prefill=up, decode=up, router=up)
    assert run_health(obj)["status"] == "Healthy"
    obj["status"] = operator_status(prefill=down, decode=up, router=up)
    health = run_health(obj)
    assert health["status"] == "Degraded"
    assert health["message"].startswith("PrefillReady: NoReplicasReady: 0/2 prefill replicas ready")
    obj["status"] = operator_status(
        prefill=up, decode=up, router=up, problem=rollup.Problem("MissingSecret", "no hf-token")
    )
    assert run_health(obj) == {"status": "Degraded", "message": "Degraded: MissingSecret: no hf-token"}
