"""Every child object of one InferenceDeployment, in apply order."""

from __future__ import annotations

from typing import Any

from splitserve.api.topology import worker_roles
from splitserve.builders.autoscalers import autoscaler_objects
from splitserve.builders.disruption import build_pdbs
from splitserve.builders.monitoring import build_monitors
from splitserve.builders.network import build_network_policy
from splitserve.builders.router import build_router_deployment, build_router_rbac, build_router_service
from splitserve.builders.services import build_worker_services
from splitserve.builders.target import Target, metadata
from splitserve.builders.workers import build_worker_deployment


def build_children(target: Target) -> list[dict[str, Any]]:
    """The desired children. Order matters for a first apply: RBAC and Services before pods."""
    return [
        *build_router_rbac(target),
        *build_worker_services(target),
        build_router_service(target),
        *(build_worker_deployment(target, role) for role in worker_roles(target.spec)),
        build_router_deployment(target),
        *build_pdbs(target),
        build_network_policy(target),
        *build_monitors(target),
        *_autoscaler_objects(target),
    ]


def _autoscaler_objects(target: Target) -> list[dict[str, Any]]:
    """KEDA ScaledObjects or HPAs (autoscaling.backend keda/hpa); the built-in loop needs none."""
    owner = target.owner
    meta = metadata(target, owner.name, "autoscaler")
    return autoscaler_objects(
        target.spec,
        owner.namespace,
        owner.name,
        labels=meta["labels"],
        owner_references=meta.get("ownerReferences"),
    )


def child_key(obj: dict[str, Any]) -> tuple[str, str, str]:
    """Identity of a child for diffing desired against observed: (apiVersion, kind, name)."""
    return obj["apiVersion"], obj["kind"], obj["metadata"]["name"]
