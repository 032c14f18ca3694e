"""PodDisruptionBudgets: voluntary evictions take at most one pod of a pool at a time."""

from __future__ import annotations

from typing import Any

from splitserve.api.topology import (
    ROUTER_ROLE,
    pool_name,
    router_name,
    selector_labels,
    worker_roles,
)
from splitserve.builders.target import Target, metadata


def build_pdbs(target: Target) -> list[dict[str, Any]]:
    """One PDB per pool: voluntary evictions take at most one pod of a pool at a time."""
    name = target.owner.name
    components: list[str] = [*(str(role) for role in worker_roles(target.spec)), ROUTER_ROLE]
    return [
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": metadata(
                target, router_name(name) if component == ROUTER_ROLE else pool_name(name, component), component
            ),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(name, component)}},
        }
        for component in components
    ]
