"""The NetworkPolicy that fences the workers: who may reach the engines, and the KV transfer ports."""

from __future__ import annotations

from typing import Any

from splitserve.api.spec import Connector, Role
from splitserve.api.topology import (
    KV_EVENTS_PORT_NAME,
    LABEL_DEPLOYMENT,
    LABEL_ROLE,
    ROUTER_ROLE,
    WORKER_HTTP_PORT_NAME,
    kv_event_roles,
    selector_labels,
    worker_roles,
)
from splitserve.builders.target import Target, metadata

# UCX's TCP transport (NIXL without RDMA) moves KV blocks over ephemeral ports, which a
# NetworkPolicy cannot name one by one: allow the Linux ephemeral range between the pools.
KV_DATA_PORT_RANGE = (32768, 60999)


def _router_pods(name: str) -> dict[str, Any]:
    return {"podSelector": {"matchLabels": selector_labels(name, ROUTER_ROLE)}}


def build_network_policy(target: Target) -> dict[str, Any]:
    """Only the router (and Prometheus) reach the workers' HTTP port; only pools reach KV transfer ports;
    only the router reaches the KV-event publishers of pools routed precise-prefix."""
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
                _router_pods(name),
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
    if kv_event_roles(spec):
        # By name: the port exists only in the containers of pools that publish events, so no other
        # worker opens anything; the router subscribes to each publisher (ZMQ SUB connects to PUB).
        ingress.append({"from": [_router_pods(name)], "ports": [{"protocol": "TCP", "port": KV_EVENTS_PORT_NAME}]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(target, f"{name}-workers", "workers"),
        "spec": {"podSelector": workers, "policyTypes": ["Ingress"], "ingress": ingress},
    }
