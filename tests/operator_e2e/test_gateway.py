"""spec.gateway with the real kopf operator against the API emulator: the InferencePool, HTTPRoute,
endpoint picker and the decode pods' pd-sidecar appear, and go when the block is removed."""

from __future__ import annotations

from typing import Any

import pytest

from testkit.emulator.client import EmulatorClient, wait_for
from testkit.operator import NAMESPACE, worker_pool

pytestmark = [pytest.mark.emulator, pytest.mark.slow]
IDEP = ("splitserve.io/v1alpha1", "inferencedeployments")
POOL = ("inference.networking.k8s.io/v1", "inferencepools")
ROUTE = ("gateway.networking.k8s.io/v1", "httproutes")
TIMEOUT = 60.0


def gateway_idep(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "splitserve.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "model": {"name": "tiny", "source": {"uri": "s3://models/tiny"}},
            "gateway": {"httpRoute": {"parentRefs": [{"name": "inference-gateway", "namespace": "gateway"}]}},
        },
    }


def decode_init_containers(client: EmulatorClient, name: str) -> list[str] | None:
    pool = worker_pool(client, name, "decode")
    if pool is None:
        return None
    return [c["name"] for c in pool["spec"]["template"]["spec"].get("initContainers", [])]


def test_gateway_children_come_and_go_with_the_block(client: EmulatorClient) -> None:
    created = client.create(gateway_idep("gw"))
    pool = wait_for(lambda: client.get_or_none(*POOL, "gw", namespace=NAMESPACE), timeout=TIMEOUT, message="pool")
    assert pool["spec"]["endpointPickerRef"]["name"] == "gw-epp"
    assert pool["metadata"]["ownerReferences"][0]["uid"] == created["metadata"]["uid"]
    route = wait_for(lambda: client.get_or_none(*ROUTE, "gw", namespace=NAMESPACE), timeout=TIMEOUT, message="route")
    assert route["spec"]["rules"][0]["backendRefs"][0]["kind"] == "InferencePool"
    wait_for(
        lambda: client.get_or_none("apps/v1", "deployments", "gw-epp", namespace=NAMESPACE),
        timeout=TIMEOUT,
        message="endpoint picker",
    )
    wait_for(lambda: decode_init_containers(client, "gw") == ["pd-sidecar"], timeout=TIMEOUT, message="sidecar")
    assert client.get_or_none("v1", "serviceaccounts", "gw-decode-sidecar", namespace=NAMESPACE) is not None

    # A hand-deleted InferencePool comes back, like any child.
    client.delete(*POOL, "gw", namespace=NAMESPACE)
    wait_for(lambda: client.get_or_none(*POOL, "gw", namespace=NAMESPACE), timeout=TIMEOUT, message="pool restored")

    # Without the block: the Gateway's objects go, the decode pods lose the sidecar, the router stays.
    client.patch(*IDEP, "gw", {"spec": {"gateway": None}}, namespace=NAMESPACE)
    for api_version, plural, name in [
        (*POOL, "gw"),
        (*ROUTE, "gw"),
        ("apps/v1", "deployments", "gw-epp"),
        ("v1", "services", "gw-epp"),
        ("v1", "serviceaccounts", "gw-decode-sidecar"),
        ("networking.k8s.io/v1", "networkpolicies", "gw-epp"),
    ]:
        wait_for(
            lambda api_version=api_version, plural=plural, name=name: (
                client.get_or_none(api_version, plural, name, namespace=NAMESPACE) is None
            ),
            timeout=TIMEOUT,
            message=f"{plural}/{name} pruned",
        )
    wait_for(lambda: decode_init_containers(client, "gw") == [], timeout=TIMEOUT, message="sidecar removed")
    assert client.get_or_none("apps/v1", "deployments", "gw-router", namespace=NAMESPACE) is not None
    client.delete(*IDEP, "gw", namespace=NAMESPACE)
