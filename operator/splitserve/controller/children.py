"""The reconcile's vocabulary for children, pure: their keys, the Write verbs, and which owned
Deployments are worker pools of which role and KV generation (plan.py and rollout.py share it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from splitserve.api.spec import Role
from splitserve.api.topology import LABEL_GENERATION, LABEL_ROLE, Owner

# (apiVersion, kind, name) of a child inside its owner's namespace.
ChildKey = tuple[str, str, str]
Children = Mapping[ChildKey, Mapping[str, Any]]

# The generation of worker Deployments an older operator made (`<name>-<role>`, no generation label):
# they roll out like any old generation.
LEGACY_GENERATION = "legacy"


@dataclass(frozen=True)
class Write:
    """One call the reconcile makes for a child.

    - create: a new worker pool, sized by the scaler's field manager (the operator's apply set never
      holds spec.replicas, see builders.workers);
    - apply: server-side apply of the desired object;
    - scale: `replicas` through /scale;
    - patch: a JSON patch (`ops`) removing what the operator added to a worker pool and no longer wants.
      A pool created by the scaler's manager keeps every field it was created with even when the
      operator's apply leaves it out (both managers own it); only a non-apply write removes it.
    """

    verb: Literal["create", "apply", "scale", "patch"]
    obj: Mapping[str, Any]
    replicas: int | None = None
    reason: str = ""  # the Event's reason, "" for none
    message: str = ""
    ops: tuple[Mapping[str, Any], ...] = ()


def key_of(obj: Mapping[str, Any]) -> ChildKey:
    return obj["apiVersion"], obj["kind"], obj["metadata"]["name"]


def worker_role(child: Mapping[str, Any]) -> Role | None:
    """The role of a worker pool Deployment, or None for anything else (incl. the router)."""
    if child["kind"] != "Deployment":
        return None
    role = child["metadata"].get("labels", {}).get(LABEL_ROLE)
    return Role(role) if role in {r.value for r in Role} else None


def worker_generation(child: Mapping[str, Any]) -> str:
    """The KV generation of a worker pool Deployment (LEGACY_GENERATION when it has no label)."""
    return str((child["metadata"].get("labels") or {}).get(LABEL_GENERATION) or LEGACY_GENERATION)


def owned_by(obj: Mapping[str, Any], owner: Owner) -> bool:
    return any(ref.get("uid") == owner.uid for ref in obj["metadata"].get("ownerReferences", []))


def worker_pools(children: Children, owner: Owner | None = None) -> list[tuple[str, Role, Mapping[str, Any]]]:
    """(generation, role, Deployment) of every worker pool, sorted by name; only those `owner` owns
    when given (a Deployment someone else made with our labels is never ours to scale or delete).
    One being deleted is left out: its pods are already going, nothing more is ours to do."""
    found = []
    for _, obj in sorted(children.items()):
        role = worker_role(obj)
        if role is None or obj["metadata"].get("deletionTimestamp"):
            continue
        if owner is not None and not owned_by(obj, owner):
            continue
        found.append((worker_generation(obj), role, obj))
    return found


def generations_present(children: Children) -> set[str]:
    """The KV generations worker pools exist for (labels only: the periodic loops have no uid to hand)."""
    return {generation for generation, _, _ in worker_pools(children)}
