"""spec.adapters (LoRA; the CEL rules are test_lora_api.py's): what every worker role, the router, the endpoint
picker and the pd-sidecar get, the adapters file and its ConfigMap, the workers' account, which changes roll
pods and which only change the ConfigMap (none changes the KV generation), the prune and template clean-up
when adapters go, and the roll-up of the workers' AdaptersReady pod conditions into status.adapters."""

from __future__ import annotations

import argparse
import copy
import io
import json
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from splitserve.api.spec import InferenceDeploymentSpec
from splitserve.api.status import InferenceDeploymentStatus
from splitserve.api.topology import ADAPTERS_CONDITION, LABEL_DEPLOYMENT, LABEL_ROLE, Owner
from splitserve.builders.adapters import adapters_file
from splitserve.builders.bundle import build_children, child_key
from splitserve.builders.target import Target
from splitserve.commands import diff as diff_command
from splitserve.controller.adapters import adapter_statuses, adapters_condition, failure_messages, with_adapters
from splitserve.controller.plan import (
    PRUNABLE_KINDS,
    plan_prune,
    plan_writes,
    stale_adapter_volume_ops,
    stale_pd_sidecar_ops,
)
from splitserve.validation import validate_object
from splitserve.validation.advice import object_advice
from tests.operator.fake_cluster import FakeCluster
from tests.operator.helpers import AGGREGATED, REPO, assert_valid_kubernetes, load, minimal
from tests.operator.test_builders import OWNER, _by_name, _container, _option, _worker, target_of
from tests.operator.test_plan import served
from tests.operator.test_reconcile_calls import NAMESPACE, deployment, owner_of, reconciler_for, watch_catches_up

EXAMPLE = REPO / "deploy" / "examples" / "lora-adapters.yaml"
HUB = {"name": "hub", "source": {"huggingFace": {"repo": "org/hub-lora", "revision": "v2"}}}
ON_CLAIM = {"name": "on-claim", "source": {"pvc": {"claimName": "loras", "path": "x/../on-claim"}}}
IN_IMAGE = {"name": "in-image", "source": {"uri": "/opt/loras/in-image"}}
WORKER_ROLES = {"disaggregated": ["prefill", "decode"], "aggregated": ["aggregated"]}


def lora_doc(*adapters: dict[str, Any], mode: str = "disaggregated", **spec: Any) -> dict[str, Any]:
    base = AGGREGATED if mode == "aggregated" else {}
    return minimal(**base, **spec, adapters=list(adapters or [HUB, ON_CLAIM, IN_IMAGE]))


def templates(children: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {key: child["spec"]["template"] for key, child in children.items() if child["kind"] == "Deployment"}


# --------------------------------------------------------------------------- what is rendered


@pytest.mark.parametrize("mode", ["disaggregated", "aggregated"])
def test_every_worker_role_runs_lora_and_syncs_the_adapters_file(mode: str) -> None:
    children = _by_name(lora_doc(mode=mode, engine={"lora": {"maxLoras": 2, "maxRank": 32, "maxCpuLoras": 6}}))
    for role in WORKER_ROLES[mode]:
        pod = _worker(children, role)["spec"]["template"]["spec"]
        engine = _container(_worker(children, role))
        args = engine["args"]
        ours, vllm = args[: args.index("--")], args[args.index("--") + 1 :]
        assert "--adapters-file=/etc/splitserve/adapters/adapters.json" in ours
        assert "--enable-lora" in vllm and "--lora-modules" not in vllm
        assert (_option(vllm, "--max-loras"), _option(vllm, "--max-lora-rank"), _option(vllm, "--max-cpu-loras")) == (
            "2",
            "32",
            "6",
        )
        env = {e["name"]: e for e in engine["env"]}
        assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]["value"] == "True"
        assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
        mounts = {m["mountPath"]: m for m in engine["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert mounts["/etc/splitserve/adapters"]["readOnly"] is True
        assert volumes[mounts["/etc/splitserve/adapters"]["name"]]["configMap"] == {
            "name": "demo-adapters",
            "optional": True,
        }
        claim = volumes[mounts["/adapters/loras"]["name"]]["persistentVolumeClaim"]
        assert claim == {"claimName": "loras", "readOnly": True} and mounts["/adapters/loras"]["readOnly"]
        assert pod["serviceAccountName"] == "demo-workers"


def test_the_adapters_file_is_the_planned_format_in_a_config_map() -> None:
    model_claim = {"name": "beside-model", "source": {"pvc": {"claimName": "weights", "path": "/loras/b"}}}
    whole_claim = {"name": "whole", "source": {"pvc": {"claimName": "only-lora"}}}
    model = {"name": "m", "source": {"pvc": {"claimName": "weights", "path": "/llama"}}}
    children = _by_name(lora_doc(HUB, ON_CLAIM, IN_IMAGE, model_claim, whole_claim, model=model))
    config_map = children["ConfigMap/demo-adapters"]
    assert config_map["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid
    assert json.loads(config_map["data"]["adapters.json"]) == {
        "adapters": [
            {"name": "hub", "huggingFace": {"repo": "org/hub-lora", "revision": "v2"}},
            {"name": "on-claim", "path": "/adapters/loras/on-claim"},  # ".." cannot climb out of the mount
            {"name": "in-image", "path": "/opt/loras/in-image"},
            {"name": "beside-model", "path": "/models/loras/b"},  # the model's claim, mounted once
            {"name": "whole", "path": "/adapters/only-lora"},
        ]
    }
    claims = [
        v["persistentVolumeClaim"]["claimName"]
        for v in _worker(children, "decode")["spec"]["template"]["spec"]["volumes"]
        if "persistentVolumeClaim" in v
    ]
    assert claims == ["weights", "loras", "only-lora"]


def test_the_workers_may_patch_pod_status_and_nothing_else() -> None:
    children = _by_name(lora_doc(gateway={}))
    assert children["Role/demo-workers"]["rules"] == [
        {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]}
    ]
    assert "ServiceAccount/demo-workers" in children
    # Decode pods with the pd-sidecar keep the sidecar's account; it is bound to the workers' Role too.
    decode = _worker(children, "decode")["spec"]["template"]["spec"]
    assert decode["serviceAccountName"] == "demo-decode-sidecar"
    assert [s["name"] for s in children["RoleBinding/demo-workers"]["subjects"]] == [
        "demo-workers",
        "demo-decode-sidecar",
    ]
    assert _worker(children, "prefill")["spec"]["template"]["spec"]["serviceAccountName"] == "demo-workers"


@pytest.mark.parametrize("mode", ["disaggregated", "aggregated"])
def test_the_router_the_picker_and_the_sidecar_serve_adapters_by_name(mode: str) -> None:
    """`--lora` on each front, through the real CLIs' parsers: a renamed flag fails here, not in a pod."""
    from splitserve.engine import cli as worker_cli
    from splitserve.gateway import epp as epp_cli
    from splitserve.gateway import sidecar as sidecar_cli
    from splitserve.router import cli as router_cli

    children = _by_name(lora_doc(mode=mode, gateway={}))
    router_args = _container(children["Deployment/demo-router"])["args"]
    picker_args = _container(children["Deployment/demo-epp"])["args"]
    for configure, args in [(router_cli.configure, router_args), (epp_cli.configure, picker_args)]:
        parser = argparse.ArgumentParser()
        configure(parser)
        assert "--lora" in args and parser.parse_args(args[1:]).lora
    for role in WORKER_ROLES[mode]:
        parser = argparse.ArgumentParser()
        worker_cli.configure(parser)
        parsed = parser.parse_args(_container(_worker(children, role))["args"])
        assert parsed.adapters_file == "/etc/splitserve/adapters/adapters.json" and "--enable-lora" in parsed.vllm_args
    if mode == "aggregated":
        return
    (sidecar,) = _worker(children, "decode")["spec"]["template"]["spec"]["initContainers"]
    parser = argparse.ArgumentParser()
    sidecar_cli.configure(parser)
    rendered = [a.replace("$(SPLITSERVE_GENERATION)", "g") for a in sidecar["args"][1:]]
    config, _, _ = sidecar_cli.config_from_args(parser.parse_args(rendered))
    assert config.lora


def test_without_adapters_nothing_of_lora_is_rendered() -> None:
    children = _by_name(minimal(engine={"lora": {"maxLoras": 2}}))
    lora_kinds = ("ConfigMap/", "ServiceAccount/demo-workers", "Role/demo-workers", "RoleBinding/demo-workers")
    assert not [key for key in children if key.startswith(lora_kinds)]
    text = json.dumps(children)
    for word in ("--enable-lora", "--lora", "--adapters-file", "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "POD_NAMESPACE"):
        assert word not in text, word
    assert "serviceAccountName" not in _worker(children, "decode")["spec"]["template"]["spec"]


# --------------------------------------------------------------------------- what changes roll


def test_changing_only_the_adapter_list_changes_the_config_map_and_no_pod_template() -> None:
    before = _by_name(lora_doc(HUB, ON_CLAIM))
    # Removed, added (from the hub, the image, a claim already mounted), reordered: only the file differs.
    moved = {**ON_CLAIM, "name": "moved", "source": {"pvc": {"claimName": "loras", "path": "/other"}}}
    after = _by_name(lora_doc(IN_IMAGE, moved, {**HUB, "name": "hub2"}))
    assert target_of(lora_doc(HUB, ON_CLAIM)).generation == target_of(lora_doc(IN_IMAGE)).generation
    assert templates(before) == templates(after)
    changed = sorted(key for key in before.keys() | after.keys() if before.get(key) != after.get(key))
    assert changed == ["ConfigMap/demo-adapters"]


def test_turning_lora_on_rolls_the_workers_and_the_fronts_but_keeps_the_kv_generation() -> None:
    off, on = minimal(), lora_doc()
    assert target_of(off).generation == target_of(on).generation
    old, new = templates(_by_name(off)), templates(_by_name(on))
    assert {key for key in new if old[key] != new[key]} == set(new)  # workers (LoRA) and router (--lora)
    # An adapter on a claim the workers do not mount yet rolls them (a pod's volumes are fixed), same generation.
    another = {"name": "new-claim", "source": {"pvc": {"claimName": "more-loras"}}}
    assert target_of(lora_doc(HUB, another)).generation == target_of(on).generation
    rolled = templates(_by_name(lora_doc(HUB, ON_CLAIM, IN_IMAGE, another)))
    assert {key.split("-")[1] for key in rolled if rolled[key] != new[key]} == {"prefill", "decode"}


def test_a_missing_claim_leaves_its_adapters_out_of_the_pods_and_the_file() -> None:
    spec = InferenceDeploymentSpec.model_validate(lora_doc()["spec"])
    target = Target(OWNER, spec, unavailable_claims=frozenset({"loras"}))
    children = {f"{c['kind']}/{c['metadata']['name']}": c for c in build_children(target)}
    names = [a["name"] for a in json.loads(children["ConfigMap/demo-adapters"]["data"]["adapters.json"])["adapters"]]
    assert names == ["hub", "in-image"]
    pod = _worker(children, "decode")["spec"]["template"]["spec"]
    assert not [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert adapters_file(spec)["adapters"][1]["name"] == "on-claim"


# --------------------------------------------------------------------------- prune and template clean-up


def test_removing_every_adapter_prunes_the_config_map_and_account_and_cleans_created_pools() -> None:
    assert ("v1", "ConfigMap") in PRUNABLE_KINDS
    with_lora = build_children(target_of(lora_doc()))
    without = build_children(target_of(minimal()))
    cluster = {child_key(child): served(child) for child in with_lora}
    wanted = {child_key(child) for child in without}
    pruned = {f"{obj['kind']}/{obj['metadata']['name']}" for obj in plan_prune(cluster, wanted, OWNER)}
    assert pruned == {
        "ConfigMap/demo-adapters",
        "ServiceAccount/demo-workers",
        "Role/demo-workers",
        "RoleBinding/demo-workers",
    }
    # A pool created with adapters keeps what an apply leaves out: the operator removes it by JSON patch, the
    # volumes (before the apply, by index) and the account (a pod naming a pruned one cannot be created).
    observed = cluster[child_key(next(c for c in with_lora if c["metadata"]["name"].startswith("demo-decode-")))]
    desired = next(c for c in without if c["metadata"]["name"] == observed["metadata"]["name"])
    volume_ops = stale_adapter_volume_ops(observed, desired)
    patched = apply_ops(observed, volume_ops)
    template = patched["spec"]["template"]["spec"]
    assert [v["name"] for v in template["volumes"]] == ["dshm", "hf-cache"]
    assert [m["name"] for m in template["containers"][0]["volumeMounts"]] == ["dshm", "hf-cache"]
    account_ops = stale_pd_sidecar_ops(observed, desired)
    assert "serviceAccountName" not in apply_ops(observed, account_ops)["spec"]["template"]["spec"]
    writes = plan_writes(target_of(minimal()).spec, without, cluster)
    assert [w.verb for w in writes if w.obj["metadata"]["name"] == observed["metadata"]["name"]] == [
        "patch",
        "apply",
        "patch",
    ]
    # One adapter claim fewer: only its volume goes, the adapters file's stays.
    fewer = build_children(target_of(lora_doc(HUB, IN_IMAGE)))
    desired = next(c for c in fewer if c["metadata"]["name"] == observed["metadata"]["name"])
    left = apply_ops(observed, stale_adapter_volume_ops(observed, desired))["spec"]["template"]["spec"]["volumes"]
    assert [v["name"] for v in left] == ["dshm", "hf-cache", "adapters"]


def apply_ops(obj: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 test/remove, enough for the ops above (a failed test raises)."""
    result = copy.deepcopy(obj)
    for op in ops:
        *parents, last = op["path"].strip("/").split("/")
        node: Any = result
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        key: Any = int(last) if isinstance(node, list) else last
        if op["op"] == "test":
            assert node[key] == op["value"], op
        else:
            del node[key]
    return result


# --------------------------------------------------------------------------- status.adapters


def pod(name: str, condition: dict[str, str] | None, *, ready: bool = True, role: str = "decode") -> dict[str, Any]:
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    if condition is not None:
        conditions.append({"type": ADAPTERS_CONDITION, **condition})
    labels = {LABEL_DEPLOYMENT: "demo", LABEL_ROLE: role}
    return {"metadata": {"name": name, "labels": labels}, "status": {"conditions": conditions}}


LOADED = {"status": "True", "reason": "AdaptersLoaded", "message": "loaded hub, on-claim, in-image"}


def test_status_counts_each_adapter_on_the_serving_workers_and_names_a_failure_with_its_reason() -> None:
    spec = InferenceDeploymentSpec.model_validate(lora_doc()["spec"])
    failed = {
        "status": "False",
        "reason": "AdapterLoadFailed",
        "message": "on-claim: Loading lora on-claim failed: No adapter found for /adapters/loras/on-claim; x; y",
    }
    pods = [
        pod("w-1", LOADED),
        pod("w-2", failed),
        pod("w-3", {"status": "False", "reason": "AdaptersLoading", "message": "loading hub"}),
        pod("starting", None, ready=False),  # not serving: not counted
        pod("router-x", None, role="router"),
    ]
    statuses = {s.name: s for s in adapter_statuses(spec, pods)}
    assert (statuses["in-image"].ready_workers, statuses["in-image"].workers) == (3, 3)
    assert statuses["in-image"].reason == "AdapterLoaded"
    assert (statuses["hub"].ready_workers, statuses["hub"].reason) == (2, "AdapterLoading")
    on_claim = statuses["on-claim"]
    assert (on_claim.ready_workers, on_claim.workers, on_claim.reason) == (2, 3, "AdapterLoadFailed")
    assert on_claim.message.startswith("Loading lora on-claim failed: No adapter found for /adapters/loras/on-claim")
    assert "; x; y" in on_claim.message and "(on 1 of 3 workers, e.g. w-2)" in on_claim.message
    value, reason, message = adapters_condition(list(statuses.values()))
    assert (value, reason) == ("False", "AdapterLoadFailed") and message.startswith("on-claim: AdapterLoadFailed: ")


def test_status_with_a_missing_claim_a_new_adapter_and_no_adapters() -> None:
    spec = InferenceDeploymentSpec.model_validate(lora_doc()["spec"])
    old_report = {"status": "True", "reason": "AdaptersLoaded", "message": "loaded hub, in-image"}
    statuses = {s.name: s for s in adapter_statuses(spec, [pod("w-1", old_report)], frozenset({"loras"}))}
    assert statuses["on-claim"].reason == "MissingVolumeClaim" and "loras not found" in statuses["on-claim"].message
    assert adapters_condition(list(statuses.values()))[:2] == ("False", "MissingVolumeClaim")
    # An adapter the worker's last report does not name has not been read from its file yet.
    newer = lora_doc(HUB, IN_IMAGE, {"name": "new", "source": {"uri": "/new"}})
    statuses = {s.name: s for s in adapter_statuses(target_of(newer).spec, [pod("w-1", old_report)])}
    assert statuses["new"].reason == "AdapterLoading" and statuses["hub"].reason == "AdapterLoaded"
    all_loaded = adapters_condition(adapter_statuses(spec, [pod("w-1", LOADED), pod("w-2", LOADED)]))
    assert all_loaded == ("True", "AdaptersLoaded", "3 adapters loaded on every worker (2)")
    assert adapters_condition(adapter_statuses(spec, []))[:2] == ("Unknown", "NoWorkers")
    status = with_adapters(InferenceDeploymentStatus(), spec, [], frozenset(), now="t", generation=1)
    assert status.adapters and [c.type for c in status.conditions] == ["AdaptersReady"]
    cleared = with_adapters(status, target_of(minimal()).spec, [], frozenset(), now="t", generation=2)
    assert cleared.adapters == [] and cleared.conditions == []


def test_a_failure_message_is_split_by_the_declared_names() -> None:
    names = ["a", "a:b", "c"]
    message = "a:b: Loading lora a:b failed: x; y; c: z"
    assert failure_messages(message, names) == {"a:b": "Loading lora a:b failed: x; y", "c": "z"}


async def test_an_adapter_on_a_missing_claim_is_reported_then_mounted_once_the_claim_exists() -> None:
    cluster = FakeCluster()
    reconciler, _ = reconciler_for(cluster)
    body = cluster.put(deployment(adapters=[ON_CLAIM, IN_IMAGE]))
    await reconciler.reconcile(body)
    assert ("get", "PersistentVolumeClaim", "loras") in cluster.calls
    status = owner_of(cluster)["status"]
    assert status["adapters"][0]["reason"] == "MissingVolumeClaim"
    config_map = cluster.objects[("v1", "ConfigMap", NAMESPACE, "demo-adapters")]
    assert "on-claim" not in config_map["data"]["adapters.json"]
    # The claim appears: the next reconcile (a child event, the drift pass) looks again and mounts it.
    cluster.put({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "loras",
                 "namespace": NAMESPACE}})  # fmt: skip
    watch_catches_up(reconciler, cluster)
    cluster.calls.clear()
    await reconciler.reconcile_by_name(NAMESPACE, "demo")
    assert "on-claim" in cluster.objects[("v1", "ConfigMap", NAMESPACE, "demo-adapters")]["data"]["adapters.json"]
    assert owner_of(cluster)["status"]["adapters"][0]["reason"] == "NoWorkers"
    # Nothing missing any more: a no-op reconcile looks nothing up.
    watch_catches_up(reconciler, cluster)
    cluster.calls.clear()
    await reconciler.reconcile_by_name(NAMESPACE, "demo")
    assert cluster.calls == []


def test_the_example_validates_and_renders_every_lora_object() -> None:
    doc = load(EXAMPLE)
    assert validate_object(doc) == []
    assert object_advice(doc) == []
    spec = InferenceDeploymentSpec.model_validate(doc["spec"])
    children = build_children(Target(Owner("llama-lora", "ns", "uid-1"), spec))
    for child in children:
        assert_valid_kubernetes(child)  # strictly, against the upstream schemas
    kinds = {(child["kind"], child["metadata"]["name"]) for child in children}
    assert {("ConfigMap", "llama-lora-adapters"), ("Role", "llama-lora-workers")} <= kinds


def test_diff_names_the_adapters_and_says_no_pod_rolls(tmp_path: Path) -> None:
    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old.write_text(json.dumps(lora_doc(HUB, ON_CLAIM)))
    new.write_text(json.dumps(lora_doc(IN_IMAGE, {**ON_CLAIM, "name": "moved"})))
    out = io.StringIO()
    with redirect_stdout(out):
        code = diff_command.run(argparse.Namespace(old=str(old), new=str(new), worker_image="w:1", exit_code=True))
    text = out.getvalue()
    assert code == 0, text
    assert "same generation: no pod rolls" in text and "pods that roll" not in text
    assert "adapters: hub, on-claim -> in-image, moved" in text
    assert "load and unload them at run time from ConfigMap demo-adapters" in text
