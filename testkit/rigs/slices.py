"""The EndpointSlice the endpoints controller keeps for a worker Service: what the router's Kubernetes
discovery reads, and what the tests and rigs that play the endpoints controller publish."""

from __future__ import annotations

from typing import Any

from testkit.operator import NAMESPACE


def endpoint_slice(service: str, addresses: dict[str, bool], port: int) -> dict[str, Any]:
    """One EndpointSlice of `service` in NAMESPACE; addresses map to whether they are terminating."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{service}-slice",
            "namespace": NAMESPACE,
            "labels": {"kubernetes.io/service-name": service},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": [
            {"addresses": [ip], "conditions": {"ready": not terminating, "serving": True, "terminating": terminating}}
            for ip, terminating in addresses.items()
        ],
    }
