"""An in-memory stand-in for the Kubernetes API, for the reconciler's unit tests.

It answers the calls the Reconciler makes (create, server-side apply, /scale, get, delete, status
patch) well enough to count them: objects get a resourceVersion that grows with every write, apply
merges the applied fields over what is there, status is kept apart. `watched()` is what a synced
watch would show, ready to hand to the ClusterCache as kopf's indexes. Not an API server: the
operator's end-to-end tests run against the emulator for that.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from splitserve.api.patch import merge_patch
from splitserve.api.topology import LABEL_DEPLOYMENT
from splitserve.io.kube import KubeError

Key = tuple[str, str, str, str]  # apiVersion, kind, namespace, name


@dataclass
class FakeCluster:
    objects: dict[Key, dict[str, Any]] = field(default_factory=dict)
    calls: list[tuple[str, str, str]] = field(default_factory=list)  # (verb, kind, name)
    _versions: itertools.count[int] = field(default_factory=lambda: itertools.count(100))

    # ------------------------------------------------------------------ what the tests set up and read

    def put(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Store as the API server would (a hand edit, or another writer): a new resourceVersion."""
        stored = copy.deepcopy(dict(obj))
        meta = stored["metadata"]
        meta["resourceVersion"] = str(next(self._versions))
        meta.setdefault("uid", f"uid-{meta['name']}")
        self.objects[(stored["apiVersion"], stored["kind"], meta.get("namespace", ""), meta["name"])] = stored
        return copy.deepcopy(stored)

    def watched(self) -> tuple[dict[Any, list[dict[str, Any]]], dict[Any, list[dict[str, Any]]]]:
        """(deployments, children) as kopf's indexes hold them once the watches caught up."""
        deployments: dict[Any, list[dict[str, Any]]] = {}
        children: dict[Any, list[dict[str, Any]]] = {}
        for (_, kind, namespace, name), obj in self.objects.items():
            if kind == "InferenceDeployment":
                deployments[(namespace, name)] = [copy.deepcopy(obj)]
            elif (owner := obj["metadata"].get("labels", {}).get(LABEL_DEPLOYMENT)) is not None:
                children.setdefault((namespace, owner), []).append(copy.deepcopy(obj))
        return deployments, children

    def verbs(self) -> list[str]:
        return [verb for verb, _, _ in self.calls]

    # ------------------------------------------------------------------ the KubeClient surface

    async def create(self, obj: dict[str, Any], *, field_manager: str) -> dict[str, Any]:
        meta = obj["metadata"]
        self.calls.append(("create", obj["kind"], meta["name"]))
        if (obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"]) in self.objects:
            raise KubeError(409, "AlreadyExists", f"{obj['kind']} {meta['name']} already exists")
        return self.put(obj)

    async def apply(self, obj: dict[str, Any], *, field_manager: str = "") -> tuple[dict[str, Any], bool]:
        meta = obj["metadata"]
        self.calls.append(("apply", obj["kind"], meta["name"]))
        key = (obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        before = self.objects.get(key)
        merged = merge_patch(before or {}, obj)
        return self.put(merged), merged != before

    async def scale(
        self, api_version: str, kind: str, namespace: str, name: str, replicas: int, *, field_manager: str
    ) -> dict[str, Any]:
        self.calls.append(("scale", kind, name))
        stored = self.objects[(api_version, kind, namespace, name)]
        stored["spec"]["replicas"] = replicas
        updated = self.put(stored)
        return {"metadata": {"resourceVersion": updated["metadata"]["resourceVersion"]}, "spec": {"replicas": replicas}}

    async def json_patch(
        self, api_version: str, kind: str, namespace: str, name: str, ops: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """The `test` and `remove` ops the reconciler sends (a failed test answers 422, as a server does)."""
        self.calls.append(("patch", kind, name))
        stored = copy.deepcopy(self.objects[(api_version, kind, namespace, name)])
        for op in ops:
            *parents, last = [int(part) if part.isdigit() else part for part in op["path"].strip("/").split("/")]
            node: Any = stored
            for part in parents:
                node = node[part]
            if op["op"] == "test" and node[last] != op["value"]:
                raise KubeError(422, "Invalid", f"test failed at {op['path']}")
            if op["op"] == "remove":
                del node[last]
        return self.put(stored)

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self.calls.append(("get", kind, name))
        found = self.objects.get((api_version, kind, namespace, name))
        return copy.deepcopy(found) if found is not None else None

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        self.calls.append(("delete", kind, name))
        return self.objects.pop((api_version, kind, namespace, name), None) is not None

    async def patch_status(
        self, api_version: str, kind: str, namespace: str, name: str, status: Mapping[str, Any]
    ) -> dict[str, Any]:
        self.calls.append(("patch_status", kind, name))
        key = (api_version, kind, namespace, name)
        if key not in self.objects:
            raise KubeError(404, "NotFound", f"{kind} {name} not found")
        stored = self.objects[key]
        stored["status"] = merge_patch(stored.get("status") or {}, status)
        return self.put(stored)

    async def aclose(self) -> None:
        return None
