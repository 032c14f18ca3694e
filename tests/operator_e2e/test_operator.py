"""The real kopf operator against the Kubernetes API emulator: create, update, drift, delete,
Degraded on missing prerequisites, invalid specs without a crash loop, API server restarts,
and `kubectl get idep` columns. (The emulator stands in for kube-apiserver; see README.)"""

from __future__ import annotations

from typing import Any

import pytest

from testkit.emulator.client import EmulatorClient, wait_for
from testkit.emulator.fixtures import EmulatorProcess, Kubectl
from testkit.operator import NAMESPACE, OperatorProcess, worker_pool

pytestmark = [pytest.mark.emulator, pytest.mark.slow]
IDEP = ("splitserve.io/v1alpha1", "inferencedeployments")
TIMEOUT = 60.0  # generous: CI machines are small and these tests share them


def idep(name: str, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": {"name": "tiny", "source": {"uri": "s3://models/tiny"}}}
    body.update(spec)
    return {
        "apiVersion": "splitserve.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": body,
    }


def condition(client: EmulatorClient, name: str, kind: str) -> dict[str, Any] | None:
    obj = client.get_or_none(*IDEP, name, namespace=NAMESPACE)
    for cond in ((obj or {}).get("status") or {}).get("conditions", []):
        if cond["type"] == kind:
            return dict(cond)
    return None


def wait_condition(
    client: EmulatorClient, name: str, kind: str, status: str, reason: str | None = None
) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        cond = condition(client, name, kind)
        if cond and cond["status"] == status and (reason is None or cond["reason"] == reason):
            return cond
        return None

    found: dict[str, Any] = wait_for(check, timeout=TIMEOUT, message=f"{name} {kind}={status} {reason or ''}")
    return found


def deployment(client: EmulatorClient, name: str) -> dict[str, Any] | None:
    return client.get_or_none("apps/v1", "deployments", name, namespace=NAMESPACE)


def pool_name(client: EmulatorClient, name: str, role: str) -> str:
    """The worker Deployment's name (`<name>-<role>-<KV generation>`), once it exists."""
    found: dict[str, Any] = wait_for(lambda: worker_pool(client, name, role), timeout=TIMEOUT, message=f"{role} pool")
    return str(found["metadata"]["name"])


def children(client: EmulatorClient, name: str) -> dict[tuple[str, str], dict[str, Any]]:
    found = {}
    for api_version, plural in [
        ("apps/v1", "deployments"),
        ("v1", "services"),
        ("v1", "serviceaccounts"),
        ("rbac.authorization.k8s.io/v1", "roles"),
        ("rbac.authorization.k8s.io/v1", "rolebindings"),
        ("policy/v1", "poddisruptionbudgets"),
        ("networking.k8s.io/v1", "networkpolicies"),
    ]:
        for obj in client.list(
            api_version, plural, namespace=NAMESPACE, label_selector=f"splitserve.io/deployment={name}"
        ):
            found[(plural, obj["metadata"]["name"])] = obj
    return found


def test_create_update_drift_and_delete(
    client: EmulatorClient, cluster: tuple[EmulatorProcess, OperatorProcess]
) -> None:
    created = client.create(idep("llm"))
    ready = wait_condition(client, "llm", "Ready", "True", "AllComponentsReady")
    assert ready["observedGeneration"] == created["metadata"]["generation"]

    objects = children(client, "llm")
    prefill, decode = pool_name(client, "llm", "prefill"), pool_name(client, "llm", "decode")
    generation = client.get(*IDEP, "llm", namespace=NAMESPACE)["status"]["kvGeneration"]
    assert (prefill, decode) == (f"llm-prefill-{generation}", f"llm-decode-{generation}")
    assert {name for _, name in objects} >= {"llm-prefill", "llm-decode", "llm-router", "llm-workers"}  # Services
    assert ("deployments", prefill) in objects and ("roles", "llm-router") in objects
    for obj in objects.values():
        (ref,) = obj["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
            "InferenceDeployment",
            "llm",
            created["metadata"]["uid"],
            True,
        )
    status = client.get(*IDEP, "llm", namespace=NAMESPACE)["status"]
    assert status["endpoint"] == f"http://llm-router.{NAMESPACE}.svc:8000/v1"
    assert status["prefill"]["summary"] == "1/1" and status["decode"]["summary"] == "1/1"
    assert {c["type"] for c in status["conditions"]} >= {
        "Ready",
        "PrefillReady",
        "DecodeReady",
        "RouterReady",
        "Progressing",
        "Degraded",
    }

    # Update: only the decode pool's template changes (the same KV generation: the same Deployments).
    names = {"prefill": prefill, "decode": decode, "router": "llm-router"}
    before = {name: deployment(client, names[name]) for name in ("prefill", "decode", "router")}
    client.patch(*IDEP, "llm", {"spec": {"decode": {"extraArgs": ["--max-num-seqs", "64"]}}}, namespace=NAMESPACE)
    wait_for(
        lambda: (
            "--max-num-seqs"
            in (deployment(client, decode) or {})
            .get("spec", {})
            .get("template", {})
            .get("spec", {})
            .get("containers", [{}])[0]
            .get("args", [])
        ),
        timeout=TIMEOUT,
        message="decode args updated",
    )
    after = {name: deployment(client, names[name]) for name in ("prefill", "decode", "router")}
    for name in ("prefill", "router"):
        assert after[name]["spec"]["template"] == before[name]["spec"]["template"], name  # type: ignore[index]
        assert after[name]["metadata"]["generation"] == before[name]["metadata"]["generation"], name  # type: ignore[index]
    wait_for(
        lambda: (
            client.get(*IDEP, "llm", namespace=NAMESPACE)["status"]["observedGeneration"]
            == client.get(*IDEP, "llm", namespace=NAMESPACE)["metadata"]["generation"]
        ),
        timeout=TIMEOUT,
        message="observedGeneration catches up",
    )

    # Drift: a Deployment deleted by hand comes back; a Service edited by hand is put back.
    client.delete("apps/v1", "deployments", decode, namespace=NAMESPACE)
    wait_for(lambda: deployment(client, decode), timeout=TIMEOUT, message="decode restored")
    client.patch("v1", "services", "llm-router", {"spec": {"type": "NodePort"}}, namespace=NAMESPACE)
    wait_for(
        lambda: client.get("v1", "services", "llm-router", namespace=NAMESPACE)["spec"]["type"] == "ClusterIP",
        timeout=TIMEOUT,
        message="router service restored",
    )

    # A pool that is not ready shows in the conditions.
    client.patch(
        "apps/v1",
        "deployments",
        decode,
        {"metadata": {"annotations": {"emulator.splitserve.io/ready": "false"}}},
        namespace=NAMESPACE,
    )
    wait_condition(client, "llm", "DecodeReady", "False", "NoReplicasReady")
    wait_condition(client, "llm", "Ready", "False", "DecodeNotReady")

    # Mode switch prunes the pools that are no longer wanted.
    client.patch(*IDEP, "llm", {"spec": {"mode": "aggregated"}}, namespace=NAMESPACE)
    wait_for(lambda: deployment(client, f"llm-aggregated-{generation}"), timeout=TIMEOUT, message="aggregated pool")
    wait_for(lambda: deployment(client, prefill) is None, timeout=TIMEOUT, message="prefill pruned")
    wait_for(
        lambda: client.get_or_none("v1", "services", "llm-prefill", namespace=NAMESPACE) is None,
        timeout=TIMEOUT,
        message="prefill service pruned",
    )

    client.delete(*IDEP, "llm", namespace=NAMESPACE)
    wait_for(lambda: not children(client, "llm"), timeout=TIMEOUT, message="children garbage-collected")
    assert cluster[1].alive


def test_missing_secret_degrades_then_recovers(client: EmulatorClient) -> None:
    spec = {
        "model": {"name": "gated", "source": {"huggingFace": {"repo": "org/gated", "tokenSecretRef": {"name": "hf"}}}}
    }
    client.create(idep("gated", **spec))
    degraded = wait_condition(client, "gated", "Degraded", "True", "MissingSecret")
    assert "Secret hf" in degraded["message"]
    wait_condition(client, "gated", "Ready", "False", "MissingSecret")
    assert worker_pool(client, "gated", "decode") is None, "nothing half-applied while a prerequisite is missing"
    wait_for(
        lambda: any(e.get("reason") == "MissingSecret" for e in client.list("v1", "events", namespace=NAMESPACE)),
        timeout=TIMEOUT,
        message="a MissingSecret event",
    )
    client.create(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "hf", "namespace": NAMESPACE},
            "data": {"token": "aGY="},
        }
    )
    wait_condition(client, "gated", "Degraded", "False", "AsExpected")
    wait_condition(client, "gated", "Ready", "True")


def test_invalid_spec_is_reported_not_crash_looped(
    client: EmulatorClient, cluster: tuple[EmulatorProcess, OperatorProcess]
) -> None:
    # The emulator does not enforce the CRD's CEL rules; a real API server would reject this
    # object at admission. The operator checks again and reports instead of crashing.
    bad = idep("bad", decode={"replicas": 9, "minReplicas": 1, "maxReplicas": 2})
    client.create(bad)
    degraded = wait_condition(client, "bad", "Degraded", "True", "InvalidSpec")
    assert "replicas must lie between minReplicas and maxReplicas" in degraded["message"]
    assert cluster[1].alive
    client.patch(*IDEP, "bad", {"spec": {"decode": {"replicas": 2}}}, namespace=NAMESPACE)
    wait_condition(client, "bad", "Ready", "True")


def test_operator_recovers_after_api_server_restart(
    client: EmulatorClient, cluster: tuple[EmulatorProcess, OperatorProcess]
) -> None:
    emulator, operator = cluster
    client.create(idep("before"))
    wait_condition(client, "before", "Ready", "True")
    emulator.kill()
    emulator.start()
    with emulator.client() as fresh:
        client = fresh
        client.create(idep("after"))
        wait_condition(client, "after", "Ready", "True")
        client.delete("apps/v1", "deployments", "before-router", namespace=NAMESPACE)
        wait_for(lambda: deployment(client, "before-router"), timeout=TIMEOUT, message="drift fixed after restart")
    assert operator.alive


def columns(header: str, row: str) -> dict[str, str]:
    """A `kubectl get` row by column: cells start where their header starts (a cell may be empty)."""
    starts = [
        index for index in range(len(header)) if header[index] != " " and (index == 0 or header[index - 1] == " ")
    ]
    ends = [*starts[1:], None]
    return {header[a:b].strip(): row[a:b].strip() for a, b in zip(starts, ends, strict=True)}


def test_kubectl_shows_printer_columns(
    cluster: tuple[EmulatorProcess, OperatorProcess], client: EmulatorClient
) -> None:
    client.create(idep("shown"))
    wait_condition(client, "shown", "Ready", "True")
    kubectl = Kubectl(cluster[0], namespace=NAMESPACE)
    output = kubectl("get", "idep", "shown").stdout
    header, row = output.strip().splitlines()
    assert header.split() == ["NAME", "READY", "MODE", "PREFILL", "DECODE", "ROLLOUT", "ENDPOINT", "AGE"]
    assert columns(header, row) == {
        "NAME": "shown",
        "READY": "True",
        "MODE": "disaggregated",
        "PREFILL": "1/1",
        "DECODE": "1/1",
        "ROLLOUT": columns(header, row)["ROLLOUT"],
        "ENDPOINT": f"http://shown-router.{NAMESPACE}.svc:8000/v1",
        "AGE": columns(header, row)["AGE"],
    }
    assert columns(header, row)["ROLLOUT"] in ("", "<none>"), "no rollout in progress: nothing to show"
    wide = kubectl("get", "idep", "shown", "-o", "wide").stdout
    assert "DIAGNOSIS" in wide.splitlines()[0] and "GENERATION" in wide.splitlines()[0]
    generation = client.get(*IDEP, "shown", namespace=NAMESPACE)["status"]["kvGeneration"]
    assert len(generation) == 10 and generation in wide.splitlines()[1]


def test_scaling_a_pool_in_the_spec_scales_its_deployment(client: EmulatorClient) -> None:
    client.create(idep("scaled", decode={"replicas": 1, "maxReplicas": 4}))
    wait_condition(client, "scaled", "Ready", "True")
    client.patch(*IDEP, "scaled", {"spec": {"decode": {"replicas": 3}}}, namespace=NAMESPACE)
    wait_for(
        lambda: (worker_pool(client, "scaled", "decode") or {}).get("spec", {}).get("replicas") == 3,
        timeout=TIMEOUT,
        message="decode scaled to 3",
    )
    wait_for(
        lambda: client.get(*IDEP, "scaled", namespace=NAMESPACE)["status"]["decode"]["summary"] == "3/3",
        timeout=TIMEOUT,
        message="status shows 3/3",
    )


def test_kubectl_scale_is_honoured_until_the_spec_changes(
    cluster: tuple[EmulatorProcess, OperatorProcess], client: EmulatorClient
) -> None:
    client.create(idep("manual", decode={"replicas": 1, "maxReplicas": 4}))
    wait_condition(client, "manual", "Ready", "True")
    kubectl = Kubectl(cluster[0], namespace=NAMESPACE)
    decode = pool_name(client, "manual", "decode")
    kubectl("scale", "deployment", decode, "--replicas=2")
    wait_for(
        lambda: client.get(*IDEP, "manual", namespace=NAMESPACE)["status"]["decode"]["summary"] == "2/2",
        timeout=TIMEOUT,
        message="status follows kubectl scale",
    )
    # A reconcile (here: a change to another pool) must not undo the manual scale.
    client.patch(*IDEP, "manual", {"spec": {"prefill": {"extraArgs": ["--max-num-seqs", "8"]}}}, namespace=NAMESPACE)
    wait_for(
        lambda: client.get(*IDEP, "manual", namespace=NAMESPACE)["status"]["observedGeneration"] == 2,
        timeout=TIMEOUT,
        message="second generation reconciled",
    )
    assert deployment(client, decode)["spec"]["replicas"] == 2  # type: ignore[index]
    for entry in deployment(client, decode)["metadata"]["managedFields"]:  # type: ignore[index]
        if entry["manager"] == "splitserve-operator":
            assert "f:replicas" not in entry.get("fieldsV1", {}).get("f:spec", {}), "the apply set owns replicas"
    # Changing the declared count in the spec is a new intent: it wins.
    client.patch(*IDEP, "manual", {"spec": {"decode": {"replicas": 3}}}, namespace=NAMESPACE)
    wait_for(
        lambda: (deployment(client, decode) or {}).get("spec", {}).get("replicas") == 3,
        timeout=TIMEOUT,
        message="spec change applied",
    )
    wait_for(
        lambda: any(
            e.get("reason") == "Scaled" and decode in e.get("message", "")
            for e in client.list("v1", "events", namespace=NAMESPACE)
        ),
        timeout=TIMEOUT,
        message="a Scaled event",
    )


def test_a_model_that_cannot_fit_degrades_and_nothing_is_applied(client: EmulatorClient) -> None:
    h100 = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    spec = {
        "model": {
            "name": "big",
            "source": {"uri": "s3://models/70b"},
            "dtype": "bfloat16",
            "parameterCount": 70_600_000_000,
        },
        "prefill": {"nodeSelector": h100},
        "decode": {"nodeSelector": h100},
    }
    client.create(idep("big", **spec))
    degraded = wait_condition(client, "big", "Degraded", "True", "ModelDoesNotFit")
    assert "does not fit" in degraded["message"] and "TP" in degraded["message"]
    assert worker_pool(client, "big", "prefill") is None and worker_pool(client, "big", "decode") is None
    tp4 = {"tensorParallelSize": 4, "resources": {"gpus": 4}, "nodeSelector": h100}
    client.patch(*IDEP, "big", {"spec": {"prefill": tp4, "decode": tp4}}, namespace=NAMESPACE)
    wait_condition(client, "big", "Ready", "True")


def test_diagnosis_is_written_to_status_and_shown_by_kubectl(
    cluster: tuple[EmulatorProcess, OperatorProcess], client: EmulatorClient
) -> None:
    client.create(idep("diag"))
    diagnosis = wait_for(
        lambda: (client.get(*IDEP, "diag", namespace=NAMESPACE).get("status") or {}).get("diagnosis"),
        timeout=TIMEOUT,
        message="status.diagnosis",
    )
    assert len(diagnosis["findings"]) == 6
    assert diagnosis["summary"]
    assert any("no telemetry" in f["verdict"] or "no telemetry" in f.get("evidence", "") for f in diagnosis["findings"])
    wide = Kubectl(cluster[0], namespace=NAMESPACE)("get", "idep", "diag", "-o", "wide").stdout
    assert diagnosis["summary"].split()[0] in wide.splitlines()[1]
