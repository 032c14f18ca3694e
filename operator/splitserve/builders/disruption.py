"""PodDisruptionBudgets: voluntary evictions take at most one pod of a pool at a time."""

from __future__ import annotations

from typing import Any

from splitserve.api.topology import (
    EPP_ROLE,
    ROUTER_ROLE,
    epp_name,
    pool_name,
    router_name,
    selector_labels,
    worker_roles,
)
from splitserve.builders.target import Target, metadata


def build_pdbs(target: Target) -> list[dict[str, Any]]:
    """One PDB per pool (and the router, the endpoint picker): voluntary evictions take at most one pod
    of a pool at a time."""
    name = target.owner.name
    names = {str(role): pool_name(name, role) for role in worker_roles(target.spec)}
    names[ROUTER_ROLE] = router_name(name)
    if target.spec.gateway is not None:
        names[EPP_ROLE] = epp_name(name)
    return [
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": metadata(target, pdb_name, component),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(name, component)}},
        }
        for component, pdb_name in names.items()
    ]
