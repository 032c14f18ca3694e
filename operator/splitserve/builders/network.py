"""The NetworkPolicy that fences the workers: who may reach the engines, and the KV transfer ports."""

from __future__ import annotations

from typing import Any

from splitserve.api.spec import Connector, Role
from splitserve.api.topology import (
    LABEL_DEPLOYMENT,
    LABEL_ROLE,
    ROUTER_ROLE,
    WORKER_HTTP_PORT_NAME,
    selector_labels,
    worker_roles,
)
from splitserve.builders.target import Target, metadata

# UCX's TCP transport (NIXL without RDMA) moves KV blocks over ephemeral ports, which a
# NetworkPolicy cannot name one by one: allow the Linux ephemeral range between the pools.
KV_DATA_PORT_RANGE = (32768, 60999)


def build_network_policy(target: Target) -> dict[str, Any]:
    """Only the router (and Prometheus) reach the workers' HTTP port; only pools reach KV ports."""
    spec = target.spec
    name = target.owner.name
    roles = [str(role) for role in worker_roles(spec)]
    workers = {
        "matchLabels": {LABEL_DEPLOYMENT: name},
        "matchExpressions": [{"key": LABEL_ROLE, "operator": "In", "values": roles}],
    }
    ingress: list[dict[str, Any]] = [
        {
            "from": [
                {"podSelector": {"matchLabels": selector_labels(name, ROUTER_ROLE)}},
                # prometheus-operator's Prometheus pods, in any namespace, scrape /metrics.
                {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}},
            ],
            "ports": [{"protocol": "TCP", "port": WORKER_HTTP_PORT_NAME}],
        }
    ]
    if Role.PREFILL in worker_roles(spec) and spec.kv_transfer.connector != Connector.NONE:
        low, high = KV_DATA_PORT_RANGE
        ingress.append(
            {
                "from": [{"podSelector": workers}],
                "ports": [
                    {"protocol": "TCP", "port": spec.kv_transfer.side_channel_port},
                    {"protocol": "TCP", "port": low, "endPort": high},
                ],
            }
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(target, f"{name}-workers", "workers"),
        "spec": {"podSelector": workers, "policyTypes": ["Ingress"], "ingress": ingress},
    }
