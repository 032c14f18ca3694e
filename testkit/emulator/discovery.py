"""Discovery documents: /api, /apis, /apis/<group>, /apis/<group>/<version>, /version."""

from __future__ import annotations

from typing import Any

from testkit.emulator.resources import ResourceRegistry

KUBERNETES_VERSION = {
    "major": "1",
    "minor": "37",
    "gitVersion": "v1.37.0-splitserve-emulator",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2026-01-01T00:00:00Z",
    "goVersion": "go1.25.0",
    "compiler": "gc",
    "platform": "linux/amd64",
}


def _group_version(group: str, version: str) -> dict[str, str]:
    return {"groupVersion": f"{group}/{version}", "version": version}


def core_versions(server_address: str) -> dict[str, Any]:
    return {
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}],
    }


def _group(registry: ResourceRegistry, group: str) -> dict[str, Any]:
    versions = [_group_version(group, version) for version in registry.groups()[group]]
    return {"name": group, "versions": versions, "preferredVersion": versions[0]}


def group_list(registry: ResourceRegistry) -> dict[str, Any]:
    groups = [_group(registry, group) for group in registry.groups() if group]
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}


def group(registry: ResourceRegistry, name: str) -> dict[str, Any] | None:
    if not name or name not in registry.groups():
        return None
    return {"kind": "APIGroup", "apiVersion": "v1", **_group(registry, name)}


def resource_list(registry: ResourceRegistry, group: str, version: str) -> dict[str, Any] | None:
    infos = registry.in_group_version(group, version)
    if not infos:
        return None
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": f"{group}/{version}" if group else version,
        "resources": [entry for info in infos for entry in info.discovery_entries()],
    }


def root_paths(registry: ResourceRegistry) -> dict[str, Any]:
    paths = {"/api", "/api/v1", "/apis", "/version", "/healthz", "/readyz", "/livez"}
    for name, versions in registry.groups().items():
        if name:
            paths.add(f"/apis/{name}")
            paths.update(f"/apis/{name}/{version}" for version in versions)
    return {"paths": sorted(paths)}
