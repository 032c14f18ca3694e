"""prometheus-operator objects: a ServiceMonitor for the router (and one for the endpoint picker with
spec.gateway), a PodMonitor for the workers.

Relabelling copies the pods' splitserve labels into `deployment` and `role`, the labels the
autoscaler's and the diagnosis' PromQL select on; worker series also get `generation` (the pod's KV
generation), so a rollout's two generations can be told apart on a dashboard. The router's series
carry their own `generation` label where they have one (per-generation request counts), so the
router's monitor does not add it.
"""

from __future__ import annotations

from typing import Any

from splitserve.api.topology import (
    EPP_ROLE,
    LABEL_DEPLOYMENT,
    LABEL_GENERATION,
    LABEL_ROLE,
    ROUTER_ROLE,
    WORKER_HTTP_PORT_NAME,
    epp_name,
    router_name,
)
from splitserve.builders.gateway import EPP_METRICS_PORT_NAME
from splitserve.builders.target import Target, metadata


def _copy(label: str, target: str) -> dict[str, Any]:
    source = "__meta_kubernetes_pod_label_" + label.replace(".", "_").replace("/", "_").replace("-", "_")
    return {"sourceLabels": [source], "targetLabel": target, "action": "replace"}


def _relabelings() -> list[dict[str, Any]]:
    return [_copy(LABEL_DEPLOYMENT, "deployment"), _copy(LABEL_ROLE, "role")]


def _worker_relabelings() -> list[dict[str, Any]]:
    return [*_relabelings(), _copy(LABEL_GENERATION, "generation")]


def build_monitors(target: Target) -> list[dict[str, Any]]:
    monitoring = target.spec.monitoring
    if not monitoring.enabled:
        return []
    name = target.owner.name
    interval = f"{monitoring.interval_seconds}s"
    extra = dict(monitoring.labels)

    def service_monitor(monitor_name: str, component: str, port: str) -> dict[str, Any]:
        return {
            "apiVersion": "monitoring.coreos.com/v1",
            "kind": "ServiceMonitor",
            "metadata": metadata(target, monitor_name, component, **extra),
            "spec": {
                "selector": {"matchLabels": {LABEL_DEPLOYMENT: name, "app.kubernetes.io/component": component}},
                "endpoints": [{"port": port, "path": "/metrics", "interval": interval, "relabelings": _relabelings()}],
            },
        }

    pod_monitor = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": metadata(target, f"{name}-workers", "workers", **extra),
        "spec": {
            "selector": {
                "matchLabels": {LABEL_DEPLOYMENT: name},
                "matchExpressions": [{"key": LABEL_ROLE, "operator": "NotIn", "values": [ROUTER_ROLE, EPP_ROLE]}],
            },
            "podMetricsEndpoints": [
                {
                    "port": WORKER_HTTP_PORT_NAME,
                    "path": "/metrics",
                    "interval": interval,
                    "relabelings": _worker_relabelings(),
                }
            ],
        },
    }
    monitors = [service_monitor(router_name(name), ROUTER_ROLE, "http"), pod_monitor]
    if target.spec.gateway is not None:
        monitors.append(service_monitor(epp_name(name), EPP_ROLE, EPP_METRICS_PORT_NAME))
    return monitors
