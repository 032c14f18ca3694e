"""URL parsing: which resource, namespace, name and subresource a Kubernetes API path addresses."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from testkit.emulator.resources import ResourceRegistry


@dataclasses.dataclass(frozen=True)
class ResourcePath:
    group: str
    version: str
    plural: str
    namespace: str | None  # None: cluster-scoped or across all namespaces
    name: str | None
    subresource: str
    legacy_watch: bool  # the deprecated /watch/ path prefix


def parse_resource_path(path: str, registry: ResourceRegistry) -> ResourcePath | None:
    """Parse /api/v1/... and /apis/g/v/...; None for discovery and non-resource paths."""
    segments = [segment for segment in path.split("/") if segment]
    if len(segments) >= 2 and segments[0] == "api":
        group, version, rest = "", segments[1], segments[2:]
    elif len(segments) >= 3 and segments[0] == "apis":
        group, version, rest = segments[1], segments[2], segments[3:]
    else:
        return None
    legacy_watch = bool(rest) and rest[0] == "watch"
    if legacy_watch:
        rest = rest[1:]
    if not rest:
        return None
    namespace: str | None = None
    if rest[0] == "namespaces" and len(rest) >= 3:
        candidate = registry.find(group, version, rest[2])
        if candidate is not None and candidate.namespaced:
            namespace, rest = rest[1], rest[2:]
    plural = rest[0]
    name = rest[1] if len(rest) > 1 else None
    subresource = rest[2] if len(rest) > 2 else ""
    if len(rest) > 3:
        return None
    return ResourcePath(group, version, plural, namespace, name, subresource, legacy_watch)


def verb_for(method: str, target: ResourcePath | None, params: Mapping[str, str]) -> str:
    """The RBAC verb of a request, as the API server's authorizer would name it."""
    method = method.upper()
    if target is None:
        return method.lower()
    watching = target.legacy_watch or params.get("watch", "").lower() in ("1", "true")
    if method == "GET":
        if watching:
            return "watch"
        return "get" if target.name else "list"
    if method == "DELETE":
        return "delete" if target.name else "deletecollection"
    return {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method, method.lower())
