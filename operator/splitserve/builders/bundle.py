"""Every child object of one InferenceDeployment, in apply order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from splitserve.api.topology import router_name, worker_roles
from splitserve.builders.adapters import build_adapters_config_map, build_workers_rbac
from splitserve.builders.autoscalers import autoscaler_objects, is_autoscaler
from splitserve.builders.disruption import build_pdbs
from splitserve.builders.gateway import (
    build_gateway_deployments,
    build_gateway_rbac,
    build_gateway_routing,
    build_gateway_services,
)
from splitserve.builders.monitoring import build_monitors
from splitserve.builders.network import build_epp_network_policy, build_network_policy
from splitserve.builders.router import build_router_deployment, build_router_rbac, build_router_service
from splitserve.builders.services import build_worker_services
from splitserve.builders.target import Target, metadata
from splitserve.builders.workers import build_worker_deployment


def build_children(target: Target) -> list[dict[str, Any]]:
    """The desired children. Order matters for a first apply: RBAC and Services before pods."""
    return [
        *build_router_rbac(target),
        *build_gateway_rbac(target),
        # Before the worker pods that mount the adapters file and use the account.
        *build_workers_rbac(target),
        *build_adapters_config_map(target),
        *build_worker_services(target),
        build_router_service(target),
        *build_gateway_services(target),
        *build_worker_deployments(target),
        build_router_deployment(target),
        *build_gateway_deployments(target),
        *build_pdbs(target),
        build_network_policy(target),
        *build_epp_network_policy(target),
        *build_monitors(target),
        # After the picker's Service: a Gateway resolves the pool's endpointPickerRef at once.
        *build_gateway_routing(target),
        *_autoscaler_objects(target),
    ]


def build_worker_deployments(target: Target) -> list[dict[str, Any]]:
    """The worker Deployments of the target's generation, one per role of its mode."""
    return [build_worker_deployment(target, role) for role in worker_roles(target.spec)]


def build_rollout_children(target: Target, replaced: Sequence[Target]) -> list[dict[str, Any]]:
    """The children while `target`'s generation rolls out over the generations of `replaced` (the
    specs they were built from): the target's children less the KEDA/HPA autoscalers (the rollout
    sizes the pools itself), with the replaced generations' worker Deployments beside the new ones.

    What `splitserve render --from` shows. A replaced spec of the target's own generation adds
    nothing: its Deployments are the target's."""
    new = [child for child in build_children(target) if not is_autoscaler(child)]
    seen = {child_key(child) for child in new}
    old: list[dict[str, Any]] = []
    for previous in replaced:
        for deployment in build_worker_deployments(previous):
            if child_key(deployment) not in seen:
                seen.add(child_key(deployment))
                old.append(deployment)
    # After the new worker Deployments, before the router: the order of a first apply still holds.
    router_index = next(
        index
        for index, child in enumerate(new)
        if child["metadata"]["name"] == router_name(target.owner.name) and child["kind"] == "Deployment"
    )
    return [*new[:router_index], *old, *new[router_index:]]


def _autoscaler_objects(target: Target) -> list[dict[str, Any]]:
    """KEDA ScaledObjects or HPAs (autoscaling.backend keda/hpa) scaling the target's generation; the
    built-in loop needs none. During a rollout the controller drops them (autoscalers.is_autoscaler)."""
    owner = target.owner
    meta = metadata(target, owner.name, "autoscaler")
    return autoscaler_objects(
        target.spec,
        owner.namespace,
        owner.name,
        worker_image=target.images.worker,
        labels=meta["labels"],
        owner_references=meta.get("ownerReferences"),
    )


def child_key(obj: dict[str, Any]) -> tuple[str, str, str]:
    """Identity of a child for diffing desired against observed: (apiVersion, kind, name)."""
    return obj["apiVersion"], obj["kind"], obj["metadata"]["name"]
