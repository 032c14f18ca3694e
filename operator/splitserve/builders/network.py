"""The NetworkPolicies: who may reach the engines, the KV transfer ports and, with spec.gateway, the
decode pods' pd-sidecar and the endpoint picker."""

from __future__ import annotations

from typing import Any

from splitserve.api.spec import Connector, Mode, Role
from splitserve.api.topology import (
    EPP_ROLE,
    KV_EVENTS_PORT_NAME,
    LABEL_DEPLOYMENT,
    LABEL_ROLE,
    PD_SIDECAR_PORT_NAME,
    ROUTER_ROLE,
    WORKER_HTTP_PORT_NAME,
    epp_name,
    kv_event_roles,
    selector_labels,
    worker_roles,
)
from splitserve.builders.gateway import EPP_GRPC_PORT_NAME, EPP_METRICS_PORT_NAME
from splitserve.builders.target import Target, metadata

# UCX's TCP transport (NIXL without RDMA) moves KV blocks over ephemeral ports, which a
# NetworkPolicy cannot name one by one: allow the Linux ephemeral range between the pools.
KV_DATA_PORT_RANGE = (32768, 60999)


def _prometheus_pods() -> dict[str, Any]:
    """prometheus-operator's Prometheus pods, in any namespace, scrape /metrics."""
    return {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}


def _pods(name: str, component: str) -> dict[str, Any]:
    return {"podSelector": {"matchLabels": selector_labels(name, component)}}


def _pickers(target: Target) -> list[dict[str, Any]]:
    """The pods that choose workers and poll them (/metrics, health, KV events): the router's, and the
    endpoint picker's with spec.gateway."""
    name = target.owner.name
    return [_pods(name, ROUTER_ROLE), *([_pods(name, EPP_ROLE)] if target.spec.gateway is not None else [])]


def gateway_peers(target: Target) -> list[dict[str, Any]]:
    """The Gateway's proxy pods (spec.gateway.allowedFrom); unknown to the operator otherwise, so pods of
    every namespace."""
    gateway = target.spec.gateway
    if gateway is None:
        return []
    return [dict(peer) for peer in gateway.allowed_from] or [{"namespaceSelector": {}}]


def build_network_policy(target: Target) -> dict[str, Any]:
    """Only the router, the endpoint picker (and Prometheus) reach the workers' HTTP port; only pools reach
    KV transfer ports; only they reach the KV-event publishers of pools routed precise-prefix. With
    spec.gateway the Gateway's proxies reach the pods of the InferencePool on its target port."""
    spec = target.spec
    name = target.owner.name
    roles = [str(role) for role in worker_roles(spec)]
    workers = {
        "matchLabels": {LABEL_DEPLOYMENT: name},
        "matchExpressions": [{"key": LABEL_ROLE, "operator": "In", "values": roles}],
    }
    # In aggregated mode the Gateway sends requests straight to the engines' HTTP port.
    aggregated_gateway = gateway_peers(target) if spec.mode == Mode.AGGREGATED else []
    ingress: list[dict[str, Any]] = [
        {
            "from": [*_pickers(target), _prometheus_pods(), *aggregated_gateway],
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
        # worker opens anything; the pickers subscribe to each publisher (ZMQ SUB connects to PUB).
        ingress.append({"from": _pickers(target), "ports": [{"protocol": "TCP", "port": KV_EVENTS_PORT_NAME}]})
    if spec.gateway is not None and spec.mode == Mode.DISAGGREGATED:
        ingress += [
            # By name again: only decode pods have the pd-sidecar's port.
            {"from": gateway_peers(target), "ports": [{"protocol": "TCP", "port": PD_SIDECAR_PORT_NAME}]},
            # The pd-sidecar runs the prefill leg itself. A rule cannot name the pool it admits to, so
            # decode pods may reach each other's HTTP port too (as the router may).
            {
                "from": [{"podSelector": {"matchLabels": selector_labels(name, Role.DECODE)}}],
                "ports": [{"protocol": "TCP", "port": WORKER_HTTP_PORT_NAME}],
            },
        ]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(target, f"{name}-workers", "workers"),
        "spec": {"podSelector": workers, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def build_epp_network_policy(target: Target) -> list[dict[str, Any]]:
    """With spec.gateway: the Gateway's proxies reach the endpoint picker's gRPC port, Prometheus its metrics."""
    if target.spec.gateway is None:
        return []
    name = target.owner.name
    ingress = [
        {"from": gateway_peers(target), "ports": [{"protocol": "TCP", "port": EPP_GRPC_PORT_NAME}]},
        {"from": [_prometheus_pods()], "ports": [{"protocol": "TCP", "port": EPP_METRICS_PORT_NAME}]},
    ]
    return [
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": metadata(target, epp_name(name), EPP_ROLE),
            "spec": {
                "podSelector": {"matchLabels": selector_labels(name, EPP_ROLE)},
                "policyTypes": ["Ingress"],
                "ingress": ingress,
            },
        }
    ]
