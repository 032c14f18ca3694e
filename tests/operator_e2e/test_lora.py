"""spec.adapters with the real kopf operator against the API emulator (kmock-based, testkit/emulator): the
adapters file's ConfigMap, the workers' LoRA args, mounts and account appear; a new adapter list changes
the ConfigMap and no worker pod template; a worker pod's AdapterLoadFailed condition is named in
status.adapters and the AdaptersReady condition; removing the adapters prunes what they brought.

The emulator runs no kubelet, so the test makes the worker pod itself and sets its conditions as a worker's
adapter sync would (a strategic-merge patch of pods/status)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from testkit.emulator.client import EmulatorClient, wait_for
from testkit.operator import NAMESPACE, worker_pool

pytestmark = [pytest.mark.emulator, pytest.mark.slow]
IDEP = ("splitserve.io/v1alpha1", "inferencedeployments")
TIMEOUT = 60.0
NAME = "lora"
HUB = {"name": "hub-a", "source": {"huggingFace": {"repo": "org/adapter-a"}}}
IN_IMAGE = {"name": "b", "source": {"uri": "/opt/adapters/b"}}


def lora_idep(*adapters: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": IDEP[0],
        "kind": "InferenceDeployment",
        "metadata": {"name": NAME, "namespace": NAMESPACE},
        "spec": {"model": {"name": "tiny", "source": {"uri": "s3://models/tiny"}}, "adapters": list(adapters)},
    }


def adapters_in_file(client: EmulatorClient) -> list[str] | None:
    config_map = client.get_or_none("v1", "configmaps", f"{NAME}-adapters", namespace=NAMESPACE)
    if config_map is None:
        return None
    return [entry["name"] for entry in json.loads(config_map["data"]["adapters.json"])["adapters"]]


def pools(client: EmulatorClient) -> dict[str, dict[str, Any]]:
    found = {role: worker_pool(client, NAME, role) for role in ("prefill", "decode")}
    return {role: pool for role, pool in found.items() if pool is not None}


def adapter_status(client: EmulatorClient) -> dict[str, dict[str, Any]]:
    status = (client.get(*IDEP, NAME, namespace=NAMESPACE).get("status")) or {}
    return {entry["name"]: entry for entry in status.get("adapters", [])}


def condition(client: EmulatorClient, kind: str) -> dict[str, Any] | None:
    status = client.get(*IDEP, NAME, namespace=NAMESPACE).get("status") or {}
    return next((c for c in status.get("conditions", []) if c["type"] == kind), None)


def test_adapters_load_at_run_time_and_a_failed_one_is_named_in_status(client: EmulatorClient) -> None:
    client.create(lora_idep(HUB))
    wait_for(lambda: adapters_in_file(client) == ["hub-a"], timeout=TIMEOUT, message="adapters ConfigMap")
    found = wait_for(lambda: len(pools(client)) == 2 and pools(client), timeout=TIMEOUT, message="worker pools")
    for pool in found.values():
        pod = pool["spec"]["template"]["spec"]
        engine = pod["containers"][0]
        assert "--adapters-file=/etc/splitserve/adapters/adapters.json" in engine["args"]
        assert "--enable-lora" in engine["args"] and pod["serviceAccountName"] == f"{NAME}-workers"
        assert {"name": "adapters", "mountPath": "/etc/splitserve/adapters", "readOnly": True} in engine["volumeMounts"]
    # The operator watches worker pods only (their reports feed status.adapters), selected by the API server.
    watches = [r for r in client.requests_log() if r.get("resource") == "pods" and r.get("verb") == "watch"]
    assert watches and all("splitserve.io/role in (" in r["query"].get("labelSelector", "") for r in watches)
    router = client.get("apps/v1", "deployments", f"{NAME}-router", namespace=NAMESPACE)
    assert "--lora" in router["spec"]["template"]["spec"]["containers"][0]["args"]
    assert client.get_or_none("rbac.authorization.k8s.io/v1", "roles", f"{NAME}-workers", namespace=NAMESPACE)

    # Another adapter list: the ConfigMap changes, no worker pod template does (no roll, same generation).
    before = {role: (pool["metadata"]["name"], pool["metadata"]["generation"]) for role, pool in found.items()}
    templates = {role: pool["spec"]["template"] for role, pool in found.items()}
    client.patch(*IDEP, NAME, {"spec": {"adapters": [IN_IMAGE, {**HUB, "name": "hub-c"}]}}, namespace=NAMESPACE)
    wait_for(lambda: adapters_in_file(client) == ["b", "hub-c"], timeout=TIMEOUT, message="new adapters file")
    wait_for(lambda: set(adapter_status(client)) == {"b", "hub-c"}, timeout=TIMEOUT, message="status of the list")
    after = pools(client)
    assert {role: (pool["metadata"]["name"], pool["metadata"]["generation"]) for role, pool in after.items()} == before
    assert {role: pool["spec"]["template"] for role, pool in after.items()} == templates

    # A decode worker reports that it cannot load b, as the adapter sync does on its own pod.
    decode = after["decode"]
    pod = client.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "lora-decode-worker-1",
                "namespace": NAMESPACE,
                "labels": decode["spec"]["template"]["metadata"]["labels"],
            },
            "spec": {"containers": [{"name": "engine", "image": "worker"}]},
        }
    )
    reason = "Loading lora b failed: No adapter found for /opt/adapters/b"
    conditions = [
        {"type": "Ready", "status": "True"},
        {"type": "splitserve.io/AdaptersReady", "status": "False", "reason": "AdapterLoadFailed",
         "message": f"b: {reason}"},
    ]  # fmt: skip
    client.patch(
        "v1",
        "pods",
        pod["metadata"]["name"],
        {"status": {"conditions": conditions}},
        namespace=NAMESPACE,
        subresource="status",
        patch_type="strategic",
    )
    failed = wait_for(
        lambda: adapter_status(client).get("b", {}).get("reason") == "AdapterLoadFailed" and adapter_status(client),
        timeout=TIMEOUT,
        message="b failed in status.adapters",
    )
    assert failed["b"]["message"].startswith(reason) and (failed["b"]["readyWorkers"], failed["b"]["workers"]) == (0, 1)
    assert failed["hub-c"]["readyWorkers"] == 1  # the report names b only
    ready = condition(client, "AdaptersReady")
    assert ready is not None and (ready["status"], ready["reason"]) == ("False", "AdapterLoadFailed")
    assert ready["message"].startswith(f"b: AdapterLoadFailed: {reason}")

    # No adapters: the ConfigMap and the workers' account go, and the pools no longer name the account.
    client.patch(*IDEP, NAME, {"spec": {"adapters": []}}, namespace=NAMESPACE)
    for api_version, plural, name in [
        ("v1", "configmaps", f"{NAME}-adapters"),
        ("v1", "serviceaccounts", f"{NAME}-workers"),
        ("rbac.authorization.k8s.io/v1", "rolebindings", f"{NAME}-workers"),
    ]:
        wait_for(
            lambda api_version=api_version, plural=plural, name=name: (
                client.get_or_none(api_version, plural, name, namespace=NAMESPACE) is None
            ),
            timeout=TIMEOUT,
            message=f"{plural}/{name} pruned",
        )
    wait_for(
        lambda: all("serviceAccountName" not in p["spec"]["template"]["spec"] for p in pools(client).values()),
        timeout=TIMEOUT,
        message="account removed from the pools",
    )
    assert condition(client, "AdaptersReady") is None
    client.delete(*IDEP, NAME, namespace=NAMESPACE)
