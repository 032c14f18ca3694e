"""The make-before-break rollout of a new KV generation (controller.rollout), pure: constructed
children, the plan's writes performed on them, and the test as kubelet (pods come, become ready,
go). No client, no emulator."""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from typing import Any

import pytest

from splitserve.api.spec import InferenceDeploymentSpec, Role
from splitserve.api.status import InferenceDeploymentStatus, RolloutStatus
from splitserve.api.topology import ANNOTATION_ROLLOUT_TARGET, LABEL_GENERATION, Owner
from splitserve.builders.bundle import build_children, child_key
from splitserve.builders.target import Images, Target
from splitserve.controller.children import ChildKey, worker_generation, worker_role
from splitserve.controller.plan import StatusInput, plan_prune, plan_status, plan_writes
from splitserve.controller.rollout import RolloutPlan, plan_rollout

OWNER = Owner("demo", "serving", "uid-demo")


def spec_of(revision: str = "r1", **fields: Any) -> InferenceDeploymentSpec:
    body: dict[str, Any] = {
        "model": {"name": "m", "source": {"huggingFace": {"repo": "org/m", "revision": revision}}},
        "prefill": {"replicas": 2},
        "decode": {"replicas": 2},
    }
    body.update(fields)
    return InferenceDeploymentSpec.model_validate(body)


def generation(spec: InferenceDeploymentSpec) -> str:
    return Target(OWNER, spec, Images()).generation


@dataclass
class Cluster:
    """The children as the API server holds them, the operator's status, and the Events it posted.
    `reconcile` is reconcile.py's read -> plan -> perform on plain dicts; the test plays kubelet."""

    spec: InferenceDeploymentSpec
    children: dict[ChildKey, dict[str, Any]] = field(default_factory=dict)
    status: InferenceDeploymentStatus = field(default_factory=InferenceDeploymentStatus)
    events: list[tuple[str, str, str]] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)  # worker Deployments
    clock: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def body(self) -> dict[str, Any]:
        meta = {"name": "demo", "namespace": "serving", "uid": "uid-demo", "generation": 1}
        return {"metadata": meta, "status": self.status.model_dump(by_alias=True, mode="json", exclude_none=True)}

    def reconcile(self) -> RolloutPlan:
        target = Target(OWNER, self.spec, Images())
        plan = plan_rollout(self.spec, OWNER, self.children, target.generation, build_children(target), self.status)
        for write in [*plan_writes(self.spec, plan.desired, self.children, plan.sizes), *plan.writes]:
            key = child_key(dict(write.obj))
            if write.verb == "create":
                obj = copy.deepcopy(dict(write.obj))
                stamp = f"2026-12-03T00:{next(self.clock):02d}:00Z"
                obj["metadata"].update(uid=f"uid-{key[2]}", creationTimestamp=stamp)
                obj["status"] = {}
                self.children[key] = obj
            elif write.verb == "apply":
                before = self.children.get(key, {})
                obj = copy.deepcopy(dict(write.obj))
                obj["metadata"].update(
                    {k: v for k, v in before.get("metadata", {}).items() if k not in obj["metadata"]}
                )
                if "replicas" in before.get("spec", {}):
                    obj["spec"]["replicas"] = before["spec"]["replicas"]
                obj["status"] = before.get("status", {})
                self.children[key] = obj
            else:
                assert write.replicas is not None
                self.children[key]["spec"]["replicas"] = write.replicas
        wanted = {child_key(child) for child in plan.desired} | plan.keep
        strays = plan_prune(self.children, wanted, OWNER)
        for gone in {child_key(dict(obj)): obj for obj in [*plan.remove, *strays]}.values():
            if worker_role(gone) is not None:
                self.deleted.append(gone["metadata"]["name"])
            del self.children[child_key(dict(gone))]
        self.events += plan.events
        now = "2026-12-03T01:00:00Z"
        self.status = plan_status(StatusInput(self.body(), self.children, self.spec, None, now, rollout=plan)).status
        return plan

    # ------------------------------------------------------------------ the kubelet

    def workers(self, gen: str | None = None) -> dict[str, dict[str, Any]]:
        """Worker Deployments by role (of generation `gen`), or by name when `gen` is None."""
        found = {}
        for obj in self.children.values():
            role = worker_role(obj)
            if role is None:
                continue
            if gen is None:
                found[obj["metadata"]["name"]] = obj
            elif worker_generation(obj) == gen:
                found[str(role)] = obj
        return found

    def sync(self) -> None:
        """Pods follow spec.replicas at once: new ones are not ready, removed ones are gone (the
        router is always ready: not what this is about)."""
        router = self.children[("apps/v1", "Deployment", "demo-router")]
        wanted = router["spec"].get("replicas", 1)
        router["status"] = {"replicas": wanted, "readyReplicas": wanted, "updatedReplicas": wanted}
        for obj in self.workers().values():
            wanted = obj["spec"]["replicas"]
            status = obj.setdefault("status", {})
            status["replicas"] = status["updatedReplicas"] = wanted
            status["readyReplicas"] = min(status.get("readyReplicas", 0), wanted)

    def make_ready(self, gen: str, role: str, count: int = 1) -> None:
        status = self.workers(gen)[role]["status"]
        status["readyReplicas"] = min(status["replicas"], status.get("readyReplicas", 0) + count)

    def sizes(self) -> dict[str, tuple[int, int]]:
        """(spec.replicas, readyReplicas) of every worker Deployment, keyed `<generation>/<role>`."""
        return {
            f"{worker_generation(obj)}/{worker_role(obj)}": (
                obj["spec"]["replicas"],
                obj["status"].get("readyReplicas", 0),
            )
            for obj in self.workers().values()
        }


def serving(spec: InferenceDeploymentSpec, ready: bool = True) -> Cluster:
    """A cluster where `spec` has been served for a while: every pool at its size and ready."""
    cluster = Cluster(spec)
    cluster.reconcile()
    cluster.sync()
    for obj in cluster.workers().values():
        obj["status"]["readyReplicas"] = obj["spec"]["replicas"] if ready else 0
    cluster.reconcile()
    return cluster


def check_invariants(cluster: Cluster, new: str, surge: int = 1) -> None:
    """At least one generation with a ready prefill and a ready decode; at most `surge` new workers
    of a role not ready."""
    by_generation: dict[str, dict[str, int]] = {}
    for obj in cluster.workers().values():
        by_generation.setdefault(worker_generation(obj), {})[str(worker_role(obj))] = obj["status"].get(
            "readyReplicas", 0
        )
    assert any(ready.get("prefill", 0) >= 1 and ready.get("decode", 0) >= 1 for ready in by_generation.values()), (
        cluster.sizes()
    )
    for role, obj in cluster.workers(new).items():
        assert obj["spec"]["replicas"] - obj["status"].get("readyReplicas", 0) <= surge, (role, cluster.sizes())


def reasons(cluster: Cluster) -> list[str]:
    return [reason for _, reason, _ in cluster.events]


def conditions(status: InferenceDeploymentStatus) -> dict[str, tuple[str, str]]:
    return {c.type: (c.status, c.reason) for c in status.conditions}


def test_one_generation_is_steady_state() -> None:
    cluster = serving(spec_of())
    gen = generation(spec_of())
    plan = cluster.reconcile()
    assert not plan.rolling and plan.sizes == {} and plan.keep == frozenset() and plan.events == ()
    assert cluster.status.kv_generation == gen and cluster.status.rollout is None
    (entry,) = cluster.status.generations
    assert (entry.id, entry.state, entry.traffic_share) == (gen, "Serving", 1.0)
    assert [(p.role, p.ready, p.desired) for p in entry.pools] == [("decode", 2, 2), ("prefill", 2, 2)]
    assert set(cluster.workers()) == {f"demo-prefill-{gen}", f"demo-decode-{gen}"}


def test_a_revision_change_comes_up_beside_the_old_and_replaces_it_step_by_step() -> None:
    cluster = serving(spec_of("r1"))
    old, new = generation(spec_of("r1")), generation(spec_of("r2"))
    cluster.spec = spec_of("r2")
    plan = cluster.reconcile()
    # The new pools are created at maxSurge, recording the target; the old ones are untouched.
    assert plan.rolling and plan.targets == {Role.PREFILL: 2, Role.DECODE: 2}
    assert cluster.sizes() == {
        f"{old}/prefill": (2, 2),
        f"{old}/decode": (2, 2),
        f"{new}/prefill": (1, 0),
        f"{new}/decode": (1, 0),
    }
    for obj in cluster.workers(new).values():
        assert obj["metadata"]["annotations"][ANNOTATION_ROLLOUT_TARGET] == "2"
    assert reasons(cluster) == ["RolloutStarted"]
    status = cluster.status
    assert status.kv_generation == new and status.rollout is not None
    assert (status.rollout.generation, status.rollout.replacing, status.rollout.paused) == (new, [old], False)
    assert status.rollout.summary == f"{new} 0/4 0%"
    assert conditions(status)["Progressing"] == ("True", "RollingOut")
    assert [(g.id, g.state, g.traffic_share) for g in status.generations] == [
        (new, "RollingOut", 0.0),
        (old, "Serving", 1.0),
    ]
    # Status pool summaries sum the role's pools of both generations.
    assert status.prefill.summary == "2/3" and status.decode.summary == "2/3"

    # Readiness arrives one worker at a time: each step is one reconcile and one kubelet sync.
    steps = [("prefill", (2, 1, 2, 2)), ("decode", (2, 2, 1, 1)), ("prefill", (2, 2, 0, 1)), ("decode", (2, 2, 0, 0))]
    for role, (new_prefill, new_decode, old_prefill, old_decode) in steps:
        cluster.sync()
        cluster.make_ready(new, role)
        check_invariants(cluster, new)
        cluster.reconcile()
        check_invariants(cluster, new)
        sizes = cluster.sizes()
        assert (
            sizes[f"{new}/prefill"][0],
            sizes[f"{new}/decode"][0],
            sizes[f"{old}/prefill"][0],
            sizes[f"{old}/decode"][0],
        ) == (new_prefill, new_decode, old_prefill, old_decode), role
        assert cluster.deleted == []
    mid = cluster.status
    assert mid.rollout is not None and [g.state for g in mid.generations] == ["RollingOut", "Draining"]
    # Old pools at 0 whose pods still terminate: not deleted yet.
    cluster.reconcile()
    assert cluster.deleted == [] and f"{old}/decode" in cluster.sizes()
    cluster.sync()  # their pods are gone
    cluster.make_ready(new, "decode", 0)
    plan = cluster.reconcile()
    assert plan.complete and sorted(cluster.deleted) == [f"demo-decode-{old}", f"demo-prefill-{old}"]
    assert reasons(cluster) == ["RolloutStarted", "RolloutComplete"]
    assert cluster.sizes() == {f"{new}/prefill": (2, 2), f"{new}/decode": (2, 2)}
    done = cluster.status
    assert done.rollout is None and [(g.id, g.state, g.traffic_share) for g in done.generations] == [
        (new, "Serving", 1.0)
    ]
    assert conditions(done)["Progressing"] == ("False", "Stable") and conditions(done)["Ready"][0] == "True"
    # Steady again: nothing more to write, the old target annotation is harmless.
    before = copy.deepcopy(cluster.children)
    cluster.reconcile()
    assert cluster.children == before and reasons(cluster) == ["RolloutStarted", "RolloutComplete"]


def test_a_larger_surge_starts_more_new_workers_at_once() -> None:
    cluster = serving(spec_of("r1", prefill={"replicas": 4}, decode={"replicas": 4}))
    new = generation(spec_of("r2"))
    cluster.spec = spec_of("r2", prefill={"replicas": 4}, decode={"replicas": 4}, rollout={"prefill": {"maxSurge": 3}})
    cluster.reconcile()
    assert cluster.sizes()[f"{new}/prefill"] == (3, 0) and cluster.sizes()[f"{new}/decode"] == (1, 0)
    cluster.sync()
    cluster.make_ready(new, "prefill", 2)
    cluster.reconcile()
    assert cluster.sizes()[f"{new}/prefill"] == (4, 2)
    check_invariants(cluster, new, surge=3)


def test_the_old_keeps_a_ready_pair_until_the_new_has_one() -> None:
    cluster = serving(spec_of("r1", prefill={"replicas": 1}, decode={"replicas": 1}))
    old, new = generation(spec_of("r1")), generation(spec_of("r2"))
    cluster.spec = spec_of("r2", prefill={"replicas": 1}, decode={"replicas": 1})
    cluster.reconcile()
    cluster.sync()
    cluster.make_ready(new, "prefill")
    cluster.reconcile()
    # A ready new prefill alone is no pair: the old decode and prefill both stay.
    assert cluster.sizes()[f"{old}/prefill"] == (1, 1) and cluster.sizes()[f"{old}/decode"] == (1, 1)
    cluster.make_ready(new, "decode")
    cluster.reconcile()
    assert cluster.sizes()[f"{old}/prefill"][0] == 0 and cluster.sizes()[f"{old}/decode"][0] == 0


def rolled_halfway(cluster: Cluster, new: str) -> None:
    """The new generation has one ready worker per role (a pair); the old has shrunk by one."""
    cluster.reconcile()
    cluster.sync()
    cluster.make_ready(new, "prefill")
    cluster.make_ready(new, "decode")
    cluster.reconcile()
    cluster.sync()


def test_a_third_generation_replaces_two_old_ones_the_non_serving_and_oldest_first() -> None:
    cluster = serving(spec_of("r1"))
    a, b, c = (generation(spec_of(r)) for r in ("r1", "r2", "r3"))
    cluster.spec = spec_of("r2")
    rolled_halfway(cluster, b)
    assert cluster.sizes() == {
        f"{a}/prefill": (1, 1),
        f"{a}/decode": (1, 1),
        f"{b}/prefill": (2, 1),
        f"{b}/decode": (2, 1),
    }
    cluster.spec = spec_of("r3")
    plan = cluster.reconcile()
    # The target is the rollout's, not the old pools' sum (3); the oldest gives way first.
    assert plan.targets == {Role.PREFILL: 2, Role.DECODE: 2}
    assert cluster.sizes()[f"{a}/prefill"][0] == 0 and cluster.sizes()[f"{b}/prefill"][0] == 2
    assert cluster.status.rollout is not None and cluster.status.rollout.replacing == [a, b]
    assert reasons(cluster)[-1] == "RolloutStarted"
    for _ in range(6):
        cluster.sync()
        for role in ("prefill", "decode"):
            cluster.make_ready(c, role)
        check_invariants(cluster, c)
        cluster.reconcile()
        check_invariants(cluster, c)
    cluster.sync()
    cluster.reconcile()
    assert sorted(cluster.deleted) == sorted(f"demo-{role}-{gen}" for role in ("prefill", "decode") for gen in (a, b))
    assert set(cluster.sizes()) == {f"{c}/prefill", f"{c}/decode"}


def test_a_revert_reuses_the_old_pools_and_drains_the_new_ones() -> None:
    cluster = serving(spec_of("r1"))
    a, b = generation(spec_of("r1")), generation(spec_of("r2"))
    uids = {name: obj["metadata"]["uid"] for name, obj in cluster.workers().items()}
    cluster.spec = spec_of("r2")
    rolled_halfway(cluster, b)
    cluster.spec = spec_of("r1")
    plan = cluster.reconcile()
    assert plan.rolling and plan.generation == a and plan.targets == {Role.PREFILL: 2, Role.DECODE: 2}
    assert reasons(cluster)[-1] == "RolloutReverted"
    # The old pools again, by name and uid: grown back step by step, the reverted ones shrinking.
    assert {name: cluster.workers()[name]["metadata"]["uid"] for name in uids} == uids
    assert cluster.sizes() == {
        f"{a}/prefill": (2, 1),
        f"{a}/decode": (2, 1),
        f"{b}/prefill": (1, 1),
        f"{b}/decode": (1, 1),
    }
    assert cluster.status.rollout is not None and cluster.status.rollout.generation == a
    for role in ("prefill", "decode"):
        cluster.sync()
        cluster.make_ready(a, role)
        cluster.reconcile()
        check_invariants(cluster, a)
    cluster.sync()
    cluster.reconcile()
    assert sorted(cluster.deleted) == [f"demo-decode-{b}", f"demo-prefill-{b}"]
    assert {name: obj["metadata"]["uid"] for name, obj in cluster.workers().items()} == uids
    assert reasons(cluster) == ["RolloutStarted", "RolloutReverted", "RolloutComplete"]


def paused_by_analysis(cluster: Cluster, gen: str) -> None:
    """What the rollout analysis writes on a regression (through Reconciler.update_status)."""
    assert cluster.status.rollout is not None and cluster.status.rollout.generation == gen
    rollout = cluster.status.rollout.model_copy(
        update={"paused": True, "reason": "RolloutPaused", "message": "error rate 0.30 vs 0.01 (+0.29 > 0.02)"}
    )
    cluster.status = cluster.status.model_copy(update={"rollout": rollout})


def test_a_pause_sends_traffic_back_to_the_old_until_the_generation_changes() -> None:
    cluster = serving(spec_of("r1"))
    a, b, c = (generation(spec_of(r)) for r in ("r1", "r2", "r3"))
    cluster.spec = spec_of("r2")
    rolled_halfway(cluster, b)
    paused_by_analysis(cluster, b)
    plan = cluster.reconcile()
    assert plan.paused and not plan.complete
    assert {k: v[0] for k, v in cluster.sizes().items()} == {
        f"{a}/prefill": 2,
        f"{a}/decode": 2,
        f"{b}/prefill": 0,
        f"{b}/decode": 0,
    }
    assert cluster.events[-1] == (
        "Warning",
        "RolloutPaused",
        f"rollout of KV generation {b} paused: error rate 0.30 vs 0.01 (+0.29 > 0.02); traffic back on {a}",
    )
    status = cluster.status
    assert conditions(status)["Progressing"] == ("False", "RolloutPaused")
    assert status.rollout is not None and status.rollout.paused and status.rollout.summary == f"{b} paused"
    assert "+0.29" in status.rollout.message
    assert [(g.id, g.state) for g in status.generations] == [(b, "Paused"), (a, "Serving")]
    # Nothing more happens while paused: no new Event, the pools stay, even once B's pods are gone.
    cluster.sync()
    cluster.reconcile()
    cluster.sync()
    plan = cluster.reconcile()
    assert plan.paused and not plan.complete and cluster.deleted == []
    assert reasons(cluster).count("RolloutPaused") == 1
    # A new generation clears the pause: a new rollout, from the old pools' target.
    cluster.spec = spec_of("r3")
    plan = cluster.reconcile()
    assert not plan.paused and plan.targets == {Role.PREFILL: 2, Role.DECODE: 2}
    assert cluster.status.rollout is not None
    assert (cluster.status.rollout.generation, cluster.status.rollout.paused) == (c, False)
    assert conditions(cluster.status)["Progressing"] == ("True", "RollingOut")
    assert cluster.sizes()[f"{c}/prefill"] == (1, 0) and reasons(cluster)[-1] == "RolloutStarted"


def test_a_pause_of_another_generation_is_ignored() -> None:
    cluster = serving(spec_of("r1"))
    cluster.spec = spec_of("r2")
    rolled_halfway(cluster, generation(spec_of("r2")))
    assert cluster.status.rollout is not None
    stale = RolloutStatus(generation="0123456789", paused=True, reason="RolloutPaused")
    cluster.status = cluster.status.model_copy(update={"rollout": stale})
    assert not cluster.reconcile().paused


def test_with_autoscaling_the_target_is_the_old_current_size_and_keda_waits() -> None:
    autoscaling = {"enabled": True, "backend": "keda"}
    pools = {"prefill": {"replicas": 1, "maxReplicas": 4}, "decode": {"replicas": 1, "maxReplicas": 4}}
    cluster = serving(spec_of("r1", autoscaling=autoscaling, **pools))
    a, b = generation(spec_of("r1")), generation(spec_of("r2"))
    assert any(key[1] == "ScaledObject" for key in cluster.children)
    # KEDA grew decode to 3, and prefill to 6 past a maxReplicas lowered since.
    cluster.workers(a)["decode"]["spec"]["replicas"] = 3
    cluster.workers(a)["prefill"]["spec"]["replicas"] = 6
    cluster.sync()
    cluster.make_ready(a, "decode", 3)
    cluster.make_ready(a, "prefill", 6)
    cluster.spec = spec_of("r2", autoscaling=autoscaling, **pools)
    plan = cluster.reconcile()
    assert plan.targets == {Role.PREFILL: 4, Role.DECODE: 3}
    # No ScaledObject while the rollout sizes the pools; they come back for the new generation.
    assert not any(key[1] == "ScaledObject" for key in cluster.children)
    assert cluster.sizes()[f"{b}/decode"] == (1, 0)
    completed = []
    for _ in range(6):
        cluster.sync()
        for role in ("prefill", "decode"):
            cluster.make_ready(b, role)
        completed.append(cluster.reconcile().complete)
        check_invariants(cluster, b)
    assert completed == [False, False, False, False, True, False] and cluster.status.rollout is None
    assert cluster.sizes() == {f"{b}/prefill": (4, 4), f"{b}/decode": (3, 3)}
    assert any(key[1] == "ScaledObject" for key in cluster.children)


def test_without_autoscaling_a_count_changed_with_the_generation_is_the_target() -> None:
    cluster = serving(spec_of("r1"))
    # kubectl scale of the old decode to 3 is kept (the spec's count did not change) ...
    cluster.workers(generation(spec_of("r1")))["decode"]["spec"]["replicas"] = 3
    # ... while prefill's count changes with the revision: the new intent wins.
    cluster.spec = spec_of("r2", prefill={"replicas": 1})
    assert cluster.reconcile().targets == {Role.PREFILL: 1, Role.DECODE: 3}


def legacy(cluster: Cluster) -> None:
    """Make the cluster's worker pools look like an older operator's: `<name>-<role>`, no generation label."""
    for key, obj in list(cluster.children.items()):
        role = worker_role(obj)
        if role is None:
            continue
        del cluster.children[key]
        meta = obj["metadata"]
        meta["name"] = f"demo-{role}"
        meta["labels"].pop(LABEL_GENERATION)
        meta["annotations"].pop(ANNOTATION_ROLLOUT_TARGET, None)
        cluster.children[child_key(obj)] = obj


def test_legacy_unlabelled_pools_roll_out_like_an_old_generation() -> None:
    cluster = serving(spec_of("r1"))
    gen = generation(spec_of("r1"))
    legacy(cluster)
    cluster.status = InferenceDeploymentStatus()  # an older operator wrote none of this
    plan = cluster.reconcile()
    assert plan.rolling and plan.targets == {Role.PREFILL: 2, Role.DECODE: 2}
    assert cluster.status.rollout is not None and cluster.status.rollout.replacing == ["legacy"]
    assert cluster.sizes() == {
        "legacy/prefill": (2, 2),
        "legacy/decode": (2, 2),
        f"{gen}/prefill": (1, 0),
        f"{gen}/decode": (1, 0),
    }
    assert reasons(cluster) == ["RolloutStarted"]
    for _ in range(4):
        cluster.sync()
        for role in ("prefill", "decode"):
            cluster.make_ready(gen, role)
        cluster.reconcile()
        check_invariants(cluster, gen)
    cluster.sync()
    cluster.reconcile()
    assert sorted(cluster.deleted) == ["demo-decode", "demo-prefill"]


def test_a_rollout_to_aggregated_sizes_the_aggregated_pool_from_the_old_decode() -> None:
    cluster = serving(spec_of("r1"))
    a = generation(spec_of("r1"))
    cluster.spec = spec_of("r2", mode="aggregated")
    b = generation(cluster.spec)
    plan = cluster.reconcile()
    assert plan.targets == {Role.AGGREGATED: 2}
    # The old prefill Service stays while old prefill pools do.
    assert ("v1", "Service", "demo-prefill") in cluster.children
    cluster.sync()
    cluster.make_ready(b, "aggregated")
    cluster.reconcile()
    # One ready aggregated worker is the new generation's pair: the old prefill goes, decode shrinks.
    assert cluster.sizes()[f"{a}/prefill"][0] == 0 and cluster.sizes()[f"{a}/decode"][0] == 1
    for _ in range(2):
        cluster.sync()
        cluster.make_ready(b, "aggregated")
        cluster.reconcile()
    assert sorted(cluster.deleted) == [f"demo-decode-{a}", f"demo-prefill-{a}"]
    assert set(cluster.sizes()) == {f"{b}/aggregated"}
    cluster.reconcile()
    assert ("v1", "Service", "demo-prefill") not in cluster.children


@pytest.mark.parametrize("paused", [False, True])
def test_events_are_said_once(paused: bool) -> None:
    cluster = serving(spec_of("r1"))
    cluster.spec = spec_of("r2")
    rolled_halfway(cluster, generation(spec_of("r2")))
    if paused:
        paused_by_analysis(cluster, generation(spec_of("r2")))
    cluster.reconcile()
    said = len(cluster.events)
    cluster.reconcile()
    cluster.reconcile()
    assert len(cluster.events) == said
