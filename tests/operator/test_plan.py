"""The reconcile's pure plans (controller.plan): writes, mode switch, prune set and status, from
plain dicts: no client, no emulator."""

from __future__ import annotations

import copy
from typing import Any

from splitserve.api.spec import InferenceDeploymentSpec, Mode, Role
from splitserve.api.status import Problem
from splitserve.api.topology import Owner
from splitserve.builders.bundle import build_children, child_key
from splitserve.builders.target import Images, Target
from splitserve.controller.plan import (
    Children,
    StatusInput,
    plan_mode_switch,
    plan_prune,
    plan_status,
    plan_writes,
)

OWNER = Owner("demo", "serving", "uid-demo")


def spec_of(**fields: Any) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.model_validate({"model": {"name": "m", "source": {"uri": "s3://m"}}, **fields})


def served(child: dict[str, Any], ready: int | None = None) -> dict[str, Any]:
    """A desired child as the API server holds it after applying it: server fields added."""
    obj = copy.deepcopy(child)
    obj["metadata"].update(resourceVersion="7", uid=f"uid-{obj['metadata']['name']}")
    if obj["kind"] == "Deployment":
        annotations = obj["metadata"].get("annotations") or {}
        # Worker pools leave their size to the scaler (the annotation says what the spec declared).
        declared = int(annotations.get("splitserve.io/declared-replicas", obj["spec"].get("replicas", 1)))
        obj["spec"]["replicas"] = declared
        obj["status"] = {"replicas": declared, "readyReplicas": declared if ready is None else ready}
    return obj


def cluster_for(spec: InferenceDeploymentSpec, ready: int | None = None) -> Children:
    return {child_key(child): served(child, ready) for child in build_children(Target(OWNER, spec, Images()))}


def desired(spec: InferenceDeploymentSpec) -> list[dict[str, Any]]:
    return build_children(Target(OWNER, spec, Images()))


def generation(spec: InferenceDeploymentSpec) -> str:
    return Target(OWNER, spec, Images()).generation


def pool(role: str, spec: InferenceDeploymentSpec | None = None) -> str:
    """A worker pool Deployment's name: `demo-<role>-<KV generation>`."""
    return f"demo-{role}-{generation(spec or spec_of())}"


def test_nothing_to_write_when_the_cluster_holds_what_the_spec_wants() -> None:
    spec = spec_of()
    assert plan_writes(spec, desired(spec), cluster_for(spec)) == []


def test_an_empty_cluster_gets_sized_creates_for_pools_and_applies_for_the_rest() -> None:
    spec = spec_of(prefill={"replicas": 2})
    writes = plan_writes(spec, desired(spec), {})
    creates = {write.obj["metadata"]["name"]: write.replicas for write in writes if write.verb == "create"}
    assert creates == {pool("prefill", spec): 2, pool("decode", spec): 1}
    assert all(write.verb == "apply" for write in writes if write.obj["metadata"]["name"] not in creates)


def test_a_changed_spec_count_is_one_scale_and_a_hand_scale_is_kept() -> None:
    before, after = spec_of(), spec_of(decode={"replicas": 3})
    cluster = cluster_for(before)
    writes = plan_writes(after, desired(after), cluster)
    scales = [(w.obj["metadata"]["name"], w.replicas) for w in writes if w.verb == "scale"]
    assert scales == [(pool("decode"), 3)]
    # kubectl scale to 5 with an unchanged spec: not pulled back.
    hand_scaled = dict(cluster)
    key = ("apps/v1", "Deployment", pool("decode"))
    hand_scaled[key] = {**cluster[key], "spec": {**cluster[key]["spec"], "replicas": 5}}
    assert plan_writes(before, desired(before), hand_scaled) == []


def test_a_hand_edited_child_is_applied_again_and_said_updated() -> None:
    spec = spec_of()
    cluster = dict(cluster_for(spec))
    key = ("v1", "Service", "demo-decode")
    edited = copy.deepcopy(dict(cluster[key]))
    edited["spec"]["ports"][0]["port"] = 1234
    cluster[key] = edited
    writes = plan_writes(spec, desired(spec), cluster)
    assert [(w.verb, w.obj["metadata"]["name"], w.reason) for w in writes] == [("apply", "demo-decode", "Updated")]


def test_a_switch_to_aggregated_keeps_the_old_pools_until_the_new_one_serves() -> None:
    old = cluster_for(spec_of())  # disaggregated: prefill and decode pools, a prefill Service
    aggregated = spec_of(mode="aggregated")
    new_pool_not_ready = {**old, **cluster_for(aggregated, ready=0)}
    assert generation(aggregated) == generation(spec_of()), "the mode is not a KV generation input"
    switch = plan_mode_switch(aggregated, OWNER, new_pool_not_ready, generation(aggregated))
    assert switch.switching and switch.waiting_for == Role.AGGREGATED and switch.remove == ()
    assert ("apps/v1", "Deployment", pool("prefill")) in switch.keep
    assert ("v1", "Service", "demo-prefill") in switch.keep

    new_pool_ready = {**old, **cluster_for(aggregated)}
    switch = plan_mode_switch(aggregated, OWNER, new_pool_ready, generation(aggregated))
    removed = {(obj["kind"], obj["metadata"]["name"]) for obj in switch.remove}
    assert not switch.switching
    assert removed == {
        ("Deployment", pool("prefill")),
        ("Deployment", pool("decode")),
        ("Service", "demo-prefill"),
    }


def test_a_switch_leaves_another_generations_pools_to_the_rollout() -> None:
    old = cluster_for(spec_of())
    aggregated = spec_of(mode="aggregated", model={"name": "m", "source": {"uri": "s3://m2"}})
    assert generation(aggregated) != generation(spec_of())
    switch = plan_mode_switch(aggregated, OWNER, {**old, **cluster_for(aggregated, ready=0)}, generation(aggregated))
    assert not switch.switching and switch.remove == ()


def test_no_switch_when_the_pools_match_the_mode() -> None:
    spec = spec_of()
    switch = plan_mode_switch(spec, OWNER, cluster_for(spec), generation(spec))
    assert not switch.switching and switch.remove == ()


def test_prune_takes_owned_strays_of_prunable_kinds_only() -> None:
    spec = spec_of()
    cluster = dict(cluster_for(spec))
    stray = copy.deepcopy(dict(cluster[("apps/v1", "Deployment", pool("decode"))]))
    stray["metadata"]["name"] = "demo-old"
    foreign = copy.deepcopy(stray)
    foreign["metadata"].update(name="someone-elses", ownerReferences=[{"uid": "other"}])
    # RBAC is pruned too: spec.gateway's ServiceAccounts and Roles go when the gateway does.
    role = copy.deepcopy(dict(cluster[("rbac.authorization.k8s.io/v1", "Role", "demo-router")]))
    role["metadata"]["name"] = "demo-old-role"
    # A kind the builders never emit is never ours to delete, even with our owner reference.
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {**role["metadata"], "name": "demo-secret"}}
    strays = [stray, foreign, role, secret]
    cluster.update({child_key(obj): obj for obj in strays})
    wanted = {child_key(child) for child in desired(spec)}
    assert [obj["metadata"]["name"] for obj in plan_prune(cluster, wanted, OWNER)] == ["demo-old", "demo-old-role"]


def body() -> dict[str, Any]:
    return {"metadata": {"name": "demo", "namespace": "serving", "uid": "uid-demo", "generation": 3}, "spec": {}}


def conditions(status: Any) -> dict[str, tuple[str, str]]:
    return {c.type: (c.status, c.reason) for c in status.conditions}


def test_status_is_ready_when_every_pool_serves_and_says_why_not_otherwise() -> None:
    spec = spec_of()
    ready = plan_status(StatusInput(body(), cluster_for(spec), spec, None, "2026-12-03T00:00:00Z")).status
    assert conditions(ready)["Ready"][0] == "True" and ready.observed_generation == 3
    failing = plan_status(
        StatusInput(body(), cluster_for(spec), spec, Problem("ApplyFailed", "boom"), "2026-12-03T00:00:00Z")
    ).status
    assert conditions(failing)["Ready"] == ("False", "ApplyFailed")


def test_status_during_a_switch_reports_the_serving_mode_and_progressing() -> None:
    spec = spec_of(mode="aggregated")
    inp = StatusInput(
        body(), cluster_for(spec_of()), spec, None, "2026-12-03T00:00:00Z", spec, False, Mode.DISAGGREGATED
    )
    status = plan_status(inp).status
    assert conditions(status)["Progressing"] == ("True", "SwitchingMode")
    assert status.mode == Mode.DISAGGREGATED
