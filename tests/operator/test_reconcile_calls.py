"""The reconciler's API economy, counted on a fake client: reads come from the cache, writes only
where something differs, a 409 re-reads once, and nothing is pruned from a cache that never synced."""

from __future__ import annotations

from typing import Any, cast

from splitserve.api.spec import InferenceDeploymentSpec
from splitserve.api.topology import Owner
from splitserve.builders.target import Images, Target
from splitserve.controller.cache import ClusterCache
from splitserve.controller.loops.diagnosis import diagnose_once
from splitserve.controller.reconcile import Reconciler
from splitserve.io.kube import KubeClient
from tests.operator.fake_cluster import FakeCluster

NAMESPACE = "serving"


def deployment(name: str = "demo", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "splitserve.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": name, "namespace": NAMESPACE, "generation": 1},
        "spec": {"model": {"name": "m", "source": {"uri": "s3://m"}}, **spec},
    }


def decode_pool(body: dict[str, Any]) -> str:
    """The decode pool Deployment's name, `<name>-decode-<KV generation>`."""
    spec = InferenceDeploymentSpec.model_validate(body["spec"])
    owner = Owner(body["metadata"]["name"], NAMESPACE)
    return f"{owner.name}-decode-{Target(owner, spec, Images()).generation}"


def reconciler_for(cluster: FakeCluster) -> tuple[Reconciler, list[str]]:
    reasons: list[str] = []
    reconciler = Reconciler(cast(KubeClient, cluster), lambda _body, _kind, reason, _message: reasons.append(reason))
    reconciler.cache.synced = True
    return reconciler, reasons


def watch_catches_up(reconciler: Reconciler, cluster: FakeCluster) -> None:
    reconciler.cache.bind(*cluster.watched())


def owner_of(cluster: FakeCluster, name: str = "demo") -> dict[str, Any]:
    return cluster.objects[("splitserve.io/v1alpha1", "InferenceDeployment", NAMESPACE, name)]


async def test_first_reconcile_writes_each_child_once_and_reads_nothing() -> None:
    cluster = FakeCluster()
    body = cluster.put(deployment())
    reconciler, reasons = reconciler_for(cluster)
    await reconciler.reconcile(body)
    verbs = cluster.verbs()
    assert "get" not in verbs
    # 13 children of a disaggregated deployment: the two worker pools are created (sized), the rest applied.
    assert verbs.count("create") == 2 and verbs.count("apply") == 11 and verbs.count("patch_status") == 1
    assert len({(kind, name) for verb, kind, name in cluster.calls if verb in ("create", "apply")}) == 13
    assert reasons.count("Created") == 1  # one Event for all of them, not one per child


async def test_a_no_op_reconcile_makes_no_call_whether_or_not_the_watch_caught_up() -> None:
    cluster = FakeCluster()
    reconciler, _ = reconciler_for(cluster)
    await reconciler.reconcile(cluster.put(deployment()))
    # Right after: the watch has not delivered the writes yet; the cache holds the server's answers.
    cluster.calls.clear()
    await reconciler.reconcile_by_name(NAMESPACE, "demo", prune=True)
    assert cluster.calls == []
    # Later: the watch shows everything.
    watch_catches_up(reconciler, cluster)
    await reconciler.reconcile_by_name(NAMESPACE, "demo", prune=True)
    await reconciler.reconcile(owner_of(cluster), prerequisites=False)
    assert cluster.calls == []


async def test_a_hand_edit_costs_one_apply_of_that_child() -> None:
    cluster = FakeCluster()
    reconciler, reasons = reconciler_for(cluster)
    await reconciler.reconcile(cluster.put(deployment()))
    key = ("v1", "Service", NAMESPACE, "demo-decode")
    edited = cluster.objects[key]
    edited["spec"]["ports"][0]["port"] = 1234
    cluster.put(edited)
    watch_catches_up(reconciler, cluster)
    cluster.calls.clear()
    await reconciler.reconcile_by_name(NAMESPACE, "demo")
    assert cluster.calls == [("apply", "Service", "demo-decode")]
    assert reasons[-1] == "Updated"


async def test_a_pool_becoming_ready_costs_one_status_write() -> None:
    cluster = FakeCluster()
    reconciler, _ = reconciler_for(cluster)
    await reconciler.reconcile(cluster.put(deployment()))
    pool = cluster.objects[("apps/v1", "Deployment", NAMESPACE, decode_pool(deployment()))]
    pool["status"] = {"replicas": 1, "readyReplicas": 1, "availableReplicas": 1, "updatedReplicas": 1}
    cluster.put(pool)
    watch_catches_up(reconciler, cluster)
    cluster.calls.clear()
    await reconciler.reconcile_by_name(NAMESPACE, "demo")
    assert cluster.calls == [("patch_status", "InferenceDeployment", "demo")]
    assert owner_of(cluster)["status"]["decode"]["readyReplicas"] == 1


async def test_a_create_the_cache_had_not_seen_reads_once_then_applies() -> None:
    cluster = FakeCluster()
    reconciler, _ = reconciler_for(cluster)
    body = cluster.put(deployment())
    # Another writer (or a watch that lags) made the decode pool already; the cache does not know it.
    cluster.put(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": decode_pool(body), "namespace": NAMESPACE, "labels": {}},
            "spec": {"replicas": 3},
        }
    )
    await reconciler.reconcile(body)
    decode_calls = [verb for verb, kind, name in cluster.calls if (kind, name) == ("Deployment", decode_pool(body))]
    assert decode_calls == ["create", "get", "apply"]
    assert [verb for verb, _, _ in cluster.calls].count("get") == 1
    # The apply set never holds the size: the pool keeps what it had.
    assert cluster.objects[("apps/v1", "Deployment", NAMESPACE, decode_pool(body))]["spec"]["replicas"] == 3


def stray_for(cluster: FakeCluster, owner: dict[str, Any]) -> dict[str, Any]:
    """A Deployment labelled and owned as ours that no spec wants (a pool left from an older spec)."""
    return cluster.put(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {
                "name": "demo-old",
                "namespace": NAMESPACE,
                "labels": {"splitserve.io/deployment": "demo"},
                "ownerReferences": [{"uid": owner["metadata"]["uid"], "kind": "InferenceDeployment", "name": "demo"}],
            },
            "spec": {"replicas": 1},
        }
    )


async def test_nothing_is_pruned_from_a_cache_that_never_synced() -> None:
    cluster = FakeCluster()
    body = cluster.put(deployment())
    stray_for(cluster, body)
    reconciler, _ = reconciler_for(cluster)
    reconciler.cache = ClusterCache()  # bound to indexes, but never listed
    reconciler.cache.bind(*cluster.watched())
    await reconciler.reconcile(body, prune=True)
    assert ("delete", "Deployment", "demo-old") not in cluster.calls
    reconciler.cache.synced = True
    await reconciler.reconcile(owner_of(cluster), prune=True)
    assert ("delete", "Deployment", "demo-old") in cluster.calls
    assert ("apps/v1", "Deployment", NAMESPACE, "demo-old") not in cluster.objects


async def test_prerequisites_are_read_on_a_spec_change_not_on_a_child_event() -> None:
    cluster = FakeCluster()
    cluster.put(
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "weights", "namespace": NAMESPACE}}
    )
    body = cluster.put(deployment(model={"name": "m", "source": {"pvc": {"claimName": "weights"}}}))
    reconciler, _ = reconciler_for(cluster)
    await reconciler.reconcile(body)
    assert [call for call in cluster.calls if call[0] == "get"] == [("get", "PersistentVolumeClaim", "weights")]
    watch_catches_up(reconciler, cluster)
    cluster.calls.clear()
    await reconciler.reconcile_by_name(NAMESPACE, "demo")
    assert cluster.calls == []


async def test_the_diagnosis_writes_status_when_its_findings_change_not_every_interval() -> None:
    cluster = FakeCluster()
    reconciler, _ = reconciler_for(cluster)
    await reconciler.reconcile(cluster.put(deployment()))
    watch_catches_up(reconciler, cluster)
    cluster.calls.clear()
    await diagnose_once(reconciler, NAMESPACE, "demo", None)
    assert cluster.calls == [("patch_status", "InferenceDeployment", "demo")]
    first = owner_of(cluster)["status"]["diagnosis"]
    watch_catches_up(reconciler, cluster)
    await diagnose_once(reconciler, NAMESPACE, "demo", None)
    assert len(cluster.calls) == 1
    assert owner_of(cluster)["status"]["diagnosis"] == first


async def test_a_new_kv_generation_costs_two_creates_and_deletes_nothing_until_it_serves() -> None:
    cluster = FakeCluster()
    reconciler, reasons = reconciler_for(cluster)
    source = {"huggingFace": {"repo": "org/m", "revision": "r1"}}
    await reconciler.reconcile(cluster.put(deployment(model={"name": "m", "source": source})))
    old = decode_pool(owner_of(cluster))
    for key, obj in list(cluster.objects.items()):
        if key[1] == "Deployment":
            wanted = obj["spec"].get("replicas", 1)
            cluster.put({**obj, "status": {"replicas": wanted, "readyReplicas": wanted, "updatedReplicas": wanted}})
    body = owner_of(cluster)
    body["spec"]["model"]["source"]["huggingFace"]["revision"] = "r2"
    body["metadata"]["generation"] = 2
    cluster.put(body)
    watch_catches_up(reconciler, cluster)
    cluster.calls.clear()
    await reconciler.reconcile(owner_of(cluster))
    new = decode_pool(owner_of(cluster))
    assert new != old
    deployments = [(verb, name) for verb, kind, name in cluster.calls if kind == "Deployment"]
    assert sorted(deployments) == [("create", new), ("create", new.replace("-decode-", "-prefill-"))]
    assert not [call for call in cluster.calls if call[0] in ("delete", "scale")]
    assert reasons[-1] == "RolloutStarted"
    status = owner_of(cluster)["status"]
    assert (
        status["rollout"]["generation"] == new.rsplit("-", 1)[1]
        and status["kvGeneration"] == status["rollout"]["generation"]
    )
    # Nothing changed since: the next reconcile makes no call.
    watch_catches_up(reconciler, cluster)
    cluster.calls.clear()
    await reconciler.reconcile_by_name(NAMESPACE, "demo")
    assert cluster.calls == []
