"""Derive the RBAC rules a client needed from the emulator's request log, and check a Role against them."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any


@dataclasses.dataclass(frozen=True, order=True)
class Permission:
    api_group: str
    resource: str  # "deployments" or "deployments/status"
    verb: str


def used_permissions(records: Iterable[Mapping[str, Any]], *, user_agent_prefix: str) -> set[Permission]:
    """Permissions exercised by requests whose User-Agent starts with the prefix (e.g. "kopf")."""
    used: set[Permission] = set()
    for record in records:
        if not str(record.get("user_agent", "")).startswith(user_agent_prefix) or not record.get("resource"):
            continue
        resource = record["resource"] + (f"/{record['subresource']}" if record.get("subresource") else "")
        used.add(Permission(record.get("group", ""), resource, record["verb"]))
    return used


def as_rules(permissions: Iterable[Permission]) -> list[dict[str, list[str]]]:
    """Group permissions into Role rules: one rule per (apiGroup, resource), verbs sorted."""
    verbs: dict[tuple[str, str], set[str]] = {}
    for permission in permissions:
        verbs.setdefault((permission.api_group, permission.resource), set()).add(permission.verb)
    return [
        {"apiGroups": [group], "resources": [resource], "verbs": sorted(found)}
        for (group, resource), found in sorted(verbs.items())
    ]


def _granted(rule: Mapping[str, Any], permission: Permission) -> bool:
    groups, resources, verbs = rule.get("apiGroups") or [], rule.get("resources") or [], rule.get("verbs") or []
    return (
        ("*" in groups or permission.api_group in groups)
        and ("*" in resources or permission.resource in resources)
        and ("*" in verbs or permission.verb in verbs)
    )


def missing_permissions(permissions: Iterable[Permission], rules: Iterable[Mapping[str, Any]]) -> set[Permission]:
    """Permissions that no rule (of a Role/ClusterRole's `rules`) grants."""
    rule_list = list(rules)
    return {permission for permission in permissions if not any(_granted(rule, permission) for rule in rule_list)}
