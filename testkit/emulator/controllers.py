"""Fake kubelet/controller-manager: gives workloads the status a real cluster would eventually report.

For every apps/v1 Deployment and StatefulSet it sets status.replicas, readyReplicas, availableReplicas,
updatedReplicas and observedGeneration from spec.replicas, so readiness roll-ups can be tested.
Per-object control with annotations:

* ``emulator.splitserve.io/ready: "false"`` -> no replica becomes ready (readyReplicas 0);
* ``emulator.splitserve.io/ready-replicas: "N"`` -> exactly N replicas are ready (capped at spec.replicas).

Like the real controllers (Go `omitempty`), zero counts are left out of the status.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
from typing import Any

from testkit.emulator.api import KubernetesApi

READY_ANNOTATION = "emulator.splitserve.io/ready"
READY_REPLICAS_ANNOTATION = "emulator.splitserve.io/ready-replicas"
WORKLOAD_KEYS = ("apps/deployments", "apps/statefulsets")


def desired_status(obj: dict[str, Any]) -> dict[str, Any]:
    spec = obj.get("spec") or {}
    metadata = obj.get("metadata") or {}
    annotations = metadata.get("annotations") or {}
    replicas = int(spec.get("replicas", 1))
    ready = replicas
    if annotations.get(READY_ANNOTATION, "").lower() == "false":
        ready = 0
    if READY_REPLICAS_ANNOTATION in annotations:
        with contextlib.suppress(ValueError):
            ready = min(replicas, max(0, int(annotations[READY_REPLICAS_ANNOTATION])))
    counts = {
        "replicas": replicas,
        "readyReplicas": ready,
        "availableReplicas": ready,
        "updatedReplicas": replicas,
    }
    if obj.get("kind") == "StatefulSet":
        counts["currentReplicas"] = replicas
    status: dict[str, Any] = {key: value for key, value in counts.items() if value}
    status["observedGeneration"] = int(metadata.get("generation", 1))
    available = "True" if ready >= replicas else "False"
    status["conditions"] = [
        {
            "type": "Available",
            "status": available,
            "reason": "MinimumReplicasAvailable" if available == "True" else "MinimumReplicasUnavailable",
        },
    ]
    return status


def reconcile_workloads(api: KubernetesApi) -> int:
    """One pass over all workloads; returns how many statuses changed."""
    changed = 0
    for key in WORKLOAD_KEYS:
        for obj in api.store.list_objects(key):
            wanted = desired_status(obj)
            if obj.get("status") == wanted or obj["metadata"].get("deletionTimestamp"):
                continue
            new = copy.deepcopy(obj)
            new["status"] = wanted
            api.store.put(key, new, created=False)
            changed += 1
    return changed


async def run_fake_controllers(api: KubernetesApi, *, interval: float = 0.2) -> None:
    while True:
        reconcile_workloads(api)
        await asyncio.sleep(interval)
