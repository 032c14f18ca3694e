"""API semantics independent of HTTP: metadata, writes, subresources, deletion, GC and CRD registration."""

from __future__ import annotations

import copy
import datetime
import random
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from testkit.emulator import errors, managed_fields, patching, selectors
from testkit.emulator.resources import ResourceInfo, ResourceRegistry, ScaleSpec
from testkit.emulator.store import ObjectStore

CRD_KEY = "apiextensions.k8s.io/customresourcedefinitions"
NAMESPACE_KEY = "/namespaces"
INITIAL_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")
_REPLICATED_KINDS = ("Deployment", "StatefulSet")
_IMMUTABLE_METADATA = ("name", "namespace", "uid", "creationTimestamp", "deletionTimestamp", "generation")
_NAME_SUFFIX_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"

PatchKind = str  # "json", "merge", "strategic", "apply"
PATCH_CONTENT_TYPES: dict[str, PatchKind] = {
    "application/json-patch+json": "json",
    "application/merge-patch+json": "merge",
    "application/strategic-merge-patch+json": "strategic",
    "application/apply-patch+yaml": "apply",
    "application/apply-patch+cbor": "apply",
}


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _json_path_keys(path: str) -> tuple[str, ...]:
    return tuple(part for part in path.strip().lstrip(".").split(".") if part)


def _dig(obj: Mapping[str, Any], path: str) -> Any:
    current: Any = obj
    for key in _json_path_keys(path):
        if not isinstance(current, Mapping):
            return None
        current = current.get(key)
    return current


def _set(obj: dict[str, Any], path: str, value: Any) -> None:
    keys = _json_path_keys(path)
    current = obj
    for key in keys[:-1]:
        current = current.setdefault(key, {})
    current[keys[-1]] = value


def _generation_content(obj: Mapping[str, Any], info: ResourceInfo) -> dict[str, Any]:
    """What a generation bump looks at: everything except metadata (and status with a status subresource)."""
    excluded = {"metadata", "apiVersion", "kind"} | ({"status"} if info.has_status else set())
    return {key: value for key, value in obj.items() if key not in excluded}


def _without_volatile(obj: Mapping[str, Any]) -> dict[str, Any]:
    stripped = copy.deepcopy(dict(obj))
    metadata = stripped.get("metadata") or {}
    for key in ("resourceVersion", "managedFields"):
        metadata.pop(key, None)
    return stripped


class KubernetesApi:
    def __init__(
        self,
        store: ObjectStore,
        registry: ResourceRegistry,
        *,
        clock: Callable[[], str] = utc_now,
    ) -> None:
        self.store = store
        self.registry = registry
        self._clock = clock
        for resource_key, obj in list(store.items()):  # CRDs restored from a state file
            if resource_key == CRD_KEY:
                registry.register_crd(obj)
        for name in INITIAL_NAMESPACES:
            if store.get(NAMESPACE_KEY, "", name) is None:
                self._store_new(
                    self._namespace_info(),
                    {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}},
                    manager="emulator",
                )

    def _namespace_info(self) -> ResourceInfo:
        info = self.registry.find("", "v1", "namespaces")
        assert info is not None
        return info

    # ------------------------------------------------------------------ reads
    def get(self, info: ResourceInfo, namespace: str, name: str) -> dict[str, Any]:
        found = self.store.get(info.key, namespace if info.namespaced else "", name)
        if found is None:
            raise errors.not_found(info.group, info.plural, name)
        return self._as_version(found, info)

    def list_objects(
        self,
        info: ResourceInfo,
        namespace: str | None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> list[dict[str, Any]]:
        try:
            labels = selectors.parse_label_selector(label_selector)
            fields = selectors.parse_field_selector(field_selector)
        except selectors.SelectorError as e:
            raise errors.bad_request(str(e)) from None
        return [
            self._as_version(obj, info)
            for obj in self.store.list_objects(info.key, namespace if info.namespaced else None)
            if selectors.labels_match(labels, obj) and selectors.fields_match(fields, obj)
        ]

    def _as_version(self, obj: dict[str, Any], info: ResourceInfo) -> dict[str, Any]:
        # All versions of a group/plural share the stored objects; answer in the requested version.
        obj["apiVersion"] = info.api_version
        obj["kind"] = info.kind
        return obj

    # ------------------------------------------------------------------ create
    def create(self, info: ResourceInfo, namespace: str, body: Any, *, manager: str) -> dict[str, Any]:
        obj = self._prepare_new(info, namespace, body)
        record = self._tracked_fields(info, "")
        return self._store_new(info, obj, manager=manager, record=record)

    def _prepare_new(self, info: ResourceInfo, namespace: str, body: Any) -> dict[str, Any]:
        if not isinstance(body, Mapping):
            raise errors.bad_request("the request body must be a JSON/YAML object")
        obj = copy.deepcopy(dict(body))
        metadata = obj.setdefault("metadata", {})
        if not isinstance(metadata, dict):
            raise errors.bad_request("metadata must be an object")
        if info.namespaced:
            if metadata.get("namespace") not in (None, "", namespace):
                raise errors.bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request"
                )
            metadata["namespace"] = namespace
            if self.store.get(NAMESPACE_KEY, "", namespace) is None:
                raise errors.not_found("", "namespaces", namespace)
        else:
            metadata.pop("namespace", None)
        if not metadata.get("name"):
            if not metadata.get("generateName"):
                raise errors.invalid("metadata.name: Required value: name or generateName is required")
            suffix = "".join(random.choices(_NAME_SUFFIX_ALPHABET, k=5))
            metadata["name"] = metadata["generateName"] + suffix
        return obj

    def _store_new(
        self,
        info: ResourceInfo,
        obj: dict[str, Any],
        *,
        manager: str,
        record: managed_fields.Tracked | None = None,
    ) -> dict[str, Any]:
        """Give a new object its server-set metadata and store it (answers 409 when the name is taken)."""
        metadata = obj["metadata"]
        if self.store.get(info.key, metadata.get("namespace", ""), metadata["name"]) is not None:
            raise errors.already_exists(info.group, info.plural, metadata["name"])
        obj["apiVersion"], obj["kind"] = info.api_version, info.kind
        for key in ("resourceVersion", "deletionTimestamp", "deletionGracePeriodSeconds", "selfLink"):
            metadata.pop(key, None)
        metadata["uid"] = str(uuid.uuid4())
        metadata["creationTimestamp"] = self._clock()
        metadata["generation"] = 1
        if info.has_status:
            obj.pop("status", None)
        self._apply_defaults(info, obj)
        if record is not None:
            metadata.pop("managedFields", None)
            managed_fields.record_update(
                None,
                obj,
                manager=manager,
                subresource="",
                api_version=info.api_version,
                now=self._clock(),
                tracked=record,
            )
        stored = self.store.put(info.key, obj, created=True)
        self._after_write(info, stored)
        return stored

    def _apply_defaults(self, info: ResourceInfo, obj: dict[str, Any]) -> None:
        if info.kind in _REPLICATED_KINDS and info.group == "apps":
            obj.setdefault("spec", {}).setdefault("replicas", 1)
        if info.key == NAMESPACE_KEY:
            obj["status"] = {"phase": "Active"}
        if info.key == CRD_KEY:
            names = (obj.get("spec") or {}).get("names") or {}
            obj["status"] = {
                "acceptedNames": names,
                "conditions": [
                    {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts"},
                    {"type": "Established", "status": "True", "reason": "InitialNamesAccepted"},
                ],
                "storedVersions": [
                    version["name"]
                    for version in (obj.get("spec") or {}).get("versions") or []
                    if version.get("storage")
                ],
            }

    def _after_write(self, info: ResourceInfo, stored: Mapping[str, Any]) -> None:
        if info.key == CRD_KEY:
            self.registry.register_crd(stored)
        # Like kube-controller-manager's GC: an object written with owners that are all gone
        # (an owner deleted while a controller was still applying its children) is collected.
        references = stored["metadata"].get("ownerReferences") or []
        if references and not any(self.store.find_uid(ref.get("uid", "")) for ref in references):
            self.collect_garbage()

    def _tracked_fields(self, info: ResourceInfo, subresource: str) -> managed_fields.Tracked:
        """Which fields a write through this (sub)resource owns in managedFields."""
        if subresource == "status":
            return managed_fields.track_status_subresource
        has_status = info.has_status

        def tracked(path: managed_fields.Path) -> bool:
            return managed_fields.track_main_resource(path, has_status_subresource=has_status)

        return tracked

    # ------------------------------------------------------------------ updates
    def replace(
        self,
        info: ResourceInfo,
        namespace: str,
        name: str,
        body: Any,
        *,
        subresource: str,
        manager: str,
    ) -> dict[str, Any]:
        current = self.get(info, namespace, name)
        if not isinstance(body, Mapping):
            raise errors.bad_request("the request body must be a JSON/YAML object")
        self._check_resource_version(info, current, body)
        body_name = (body.get("metadata") or {}).get("name")
        if body_name not in (None, name):
            raise errors.bad_request(f"the name of the object ({body_name}) does not match the name on the URL")
        if subresource == "scale":
            return self._write_scale(info, current, body, manager=manager)
        return self._write(info, current, dict(copy.deepcopy(body)), subresource=subresource, manager=manager)

    def patch(
        self,
        info: ResourceInfo,
        namespace: str,
        name: str,
        kind: PatchKind,
        body: Any,
        *,
        subresource: str,
        manager: str,
        force: bool,
    ) -> tuple[dict[str, Any], bool]:
        """Returns the object and whether it was created (server-side apply of a new object)."""
        if kind == "apply":
            return self._apply(info, namespace, name, body, subresource=subresource, manager=manager, force=force)
        current = self.get(info, namespace, name)
        base = self.get_scale(info, namespace, name) if subresource == "scale" else current
        try:
            if kind == "json":
                patched = patching.json_patch(base, body)
            elif kind == "strategic":
                patched = patching.strategic_merge_patch(base, body)
            else:
                patched = patching.merge_patch(base, body)
        except patching.PatchError as e:
            raise errors.invalid(str(e)) from None
        if not isinstance(patched, dict):
            raise errors.invalid("the patched object is not a JSON object")
        if subresource == "scale":
            return self._write_scale(info, current, patched, manager=manager), False
        self._check_resource_version(info, current, patched)
        return self._write(info, current, patched, subresource=subresource, manager=manager), False

    def _apply(
        self,
        info: ResourceInfo,
        namespace: str,
        name: str,
        body: Any,
        *,
        subresource: str,
        manager: str,
        force: bool,
    ) -> tuple[dict[str, Any], bool]:
        if not isinstance(body, Mapping):
            raise errors.bad_request("the apply patch must be a YAML/JSON object")
        if not manager:
            raise errors.bad_request("PATCH, application/apply-patch+yaml: fieldManager is required")
        for field in ("apiVersion", "kind"):
            if not body.get(field):
                raise errors.bad_request(f"{field} must be set in a server-side apply request")
        body_name = (body.get("metadata") or {}).get("name")
        if body_name not in (None, name):
            raise errors.bad_request(f"the name of the object ({body_name}) does not match the name on the URL")
        tracked = self._tracked_fields(info, subresource)
        existing = self.store.get(info.key, namespace if info.namespaced else "", name)
        now = self._clock()
        try:
            if existing is None:
                if subresource:
                    raise errors.not_found(info.group, info.plural, name)
                applied = managed_fields.server_side_apply(
                    None,
                    body,
                    manager=manager,
                    force=force,
                    subresource="",
                    api_version=info.api_version,
                    now=now,
                    tracked=tracked,
                )
                applied.setdefault("metadata", {})["name"] = name
                obj = self._prepare_new(info, namespace, applied)
                return self._store_new(info, obj, manager=manager), True
            self._check_resource_version(info, existing, body)
            applied = managed_fields.server_side_apply(
                existing,
                body,
                manager=manager,
                force=force,
                subresource=subresource,
                api_version=info.api_version,
                now=now,
                tracked=tracked,
            )
        except managed_fields.ApplyConflict as e:
            raise errors.ApiError(
                409,
                "Conflict",
                str(e),
                details={
                    "name": name,
                    "group": info.group,
                    "kind": info.plural,
                    "causes": [
                        {
                            "reason": "FieldManagerConflict",
                            "message": f'conflict with "{manager_}"',
                            "field": "." + ".".join(path),
                        }
                        for path, manager_ in e.conflicts
                    ],
                },
            ) from None
        return self._write(info, existing, applied, subresource=subresource, manager=manager, record=False), False

    def _check_resource_version(self, info: ResourceInfo, current: Mapping[str, Any], body: Mapping[str, Any]) -> None:
        wanted = (body.get("metadata") or {}).get("resourceVersion")
        if wanted and str(wanted) != current["metadata"]["resourceVersion"]:
            raise errors.conflict(
                info.group,
                info.plural,
                current["metadata"]["name"],
                "the object has been modified; please apply your changes to the latest version and try again",
            )

    def _write(
        self,
        info: ResourceInfo,
        current: dict[str, Any],
        proposed: dict[str, Any],
        *,
        subresource: str,
        manager: str,
        record: bool = True,
    ) -> dict[str, Any]:
        """Turn a client's proposed object into the stored next version of `current`."""
        if subresource == "status":
            new = copy.deepcopy(current)
            if "status" in proposed:
                new["status"] = proposed["status"]
            else:
                new.pop("status", None)
            if not record:
                new.setdefault("metadata", {})["managedFields"] = (proposed.get("metadata") or {}).get(
                    "managedFields", []
                )
        else:
            new = proposed
            new.setdefault("metadata", {})
            if info.has_status:
                if "status" in current:
                    new["status"] = current["status"]
                else:
                    new.pop("status", None)
        metadata = new["metadata"]
        for key in _IMMUTABLE_METADATA:
            if key in current["metadata"]:
                metadata[key] = current["metadata"][key]
            else:
                metadata.pop(key, None)
        new["apiVersion"], new["kind"] = info.api_version, info.kind
        if record:
            metadata["managedFields"] = copy.deepcopy(current["metadata"].get("managedFields", []))
            managed_fields.record_update(
                current,
                new,
                manager=manager,
                subresource=subresource,
                api_version=info.api_version,
                now=self._clock(),
                tracked=self._tracked_fields(info, subresource),
            )
        if info.key == CRD_KEY and subresource != "status":
            self._apply_defaults(info, new)
        if _without_volatile(new) == _without_volatile(current) and metadata.get("managedFields") == current[
            "metadata"
        ].get("managedFields"):
            return current  # a no-op write does not bump the resourceVersion
        if _generation_content(new, info) != _generation_content(current, info):
            metadata["generation"] = int(current["metadata"].get("generation", 1)) + 1
        namespace = metadata.get("namespace", "")
        if metadata.get("deletionTimestamp") and not metadata.get("finalizers"):
            final = self.store.remove(info.key, namespace, metadata["name"], final=new)
            assert final is not None
            self._after_removal(info, final, propagation="Background")
            return final
        stored = self.store.put(info.key, new, created=False)
        self._after_write(info, stored)
        return stored

    # ------------------------------------------------------------------ scale
    def get_scale(self, info: ResourceInfo, namespace: str, name: str) -> dict[str, Any]:
        obj = self.get(info, namespace, name)
        return self._scale_of(info, obj)

    def _scale_spec(self, info: ResourceInfo) -> ScaleSpec:
        if info.scale is None:
            raise errors.not_found(info.group, f"{info.plural}/scale", "")
        return info.scale

    def _scale_of(self, info: ResourceInfo, obj: Mapping[str, Any]) -> dict[str, Any]:
        spec = self._scale_spec(info)
        metadata = obj["metadata"]
        status: dict[str, Any] = {"replicas": int(_dig(obj, spec.status_replicas_path) or 0)}
        if spec.label_selector_path:
            selector = _dig(obj, spec.label_selector_path)
            if spec.selector_is_structured and isinstance(selector, Mapping):
                status["selector"] = selectors.selector_from_label_selector(selector)
            elif isinstance(selector, str):
                status["selector"] = selector
        return {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": {
                key: metadata[key]
                for key in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                if key in metadata
            },
            "spec": {"replicas": int(_dig(obj, spec.spec_replicas_path) or 0)},
            "status": status,
        }

    def _write_scale(
        self, info: ResourceInfo, current: dict[str, Any], scale: Mapping[str, Any], *, manager: str
    ) -> dict[str, Any]:
        spec = self._scale_spec(info)
        self._check_resource_version(info, current, scale)
        replicas = (scale.get("spec") or {}).get("replicas")
        if not isinstance(replicas, int) or replicas < 0:
            raise errors.invalid(f"spec.replicas: Invalid value: {replicas!r}: must be a non-negative integer")
        new = copy.deepcopy(current)
        _set(new, spec.spec_replicas_path, replicas)
        stored = self._write(info, current, new, subresource="scale", manager=manager)
        return self._scale_of(info, stored)

    # ------------------------------------------------------------------ deletion
    def delete(
        self,
        info: ResourceInfo,
        namespace: str,
        name: str,
        *,
        propagation: str = "Background",
        preconditions: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        current = self.get(info, namespace, name)
        wanted_uid = (preconditions or {}).get("uid")
        if wanted_uid and wanted_uid != current["metadata"]["uid"]:
            raise errors.conflict(info.group, info.plural, name, "Precondition failed: UID in precondition")
        self._check_resource_version(info, current, {"metadata": preconditions or {}})
        metadata = current["metadata"]
        if metadata.get("finalizers"):
            if metadata.get("deletionTimestamp"):
                return current
            new = copy.deepcopy(current)
            new["metadata"]["deletionTimestamp"] = self._clock()
            new["metadata"]["deletionGracePeriodSeconds"] = 0
            return self.store.put(info.key, new, created=False)
        final = self.store.remove(info.key, metadata.get("namespace", ""), name)
        assert final is not None
        self._after_removal(info, final, propagation=propagation)
        return self._as_version(final, info)

    def delete_collection(
        self, info: ResourceInfo, namespace: str | None, *, label_selector: str | None, field_selector: str | None
    ) -> list[dict[str, Any]]:
        deleted = []
        for obj in self.list_objects(info, namespace, label_selector=label_selector, field_selector=field_selector):
            metadata = obj["metadata"]
            try:
                deleted.append(self.delete(info, metadata.get("namespace", ""), metadata["name"]))
            except errors.ApiError as e:
                if e.code != 404:
                    raise
        return deleted

    def _after_removal(self, info: ResourceInfo, final: Mapping[str, Any], *, propagation: str) -> None:
        if info.key == NAMESPACE_KEY:
            self._empty_namespace(final["metadata"]["name"])
        if info.key == CRD_KEY:
            self._drop_custom_resources(final["metadata"]["name"])
        if propagation == "Orphan":
            self._orphan_dependents(final["metadata"]["uid"])
        self.collect_garbage()

    def _empty_namespace(self, namespace: str) -> None:
        for info in self._unique_resources():
            if not info.namespaced:
                continue
            for obj in self.store.list_objects(info.key, namespace):
                self._delete_quietly(info, obj)

    def _drop_custom_resources(self, crd_name: str) -> None:
        for info in self.registry.unregister_crd(crd_name)[:1]:
            for obj in self.store.list_objects(info.key):
                self.store.remove(info.key, obj["metadata"].get("namespace", ""), obj["metadata"]["name"])

    def _orphan_dependents(self, owner_uid: str) -> None:
        for info in self._unique_resources():
            for obj in self.store.list_objects(info.key):
                references = obj["metadata"].get("ownerReferences") or []
                kept = [reference for reference in references if reference.get("uid") != owner_uid]
                if len(kept) != len(references):
                    obj["metadata"]["ownerReferences"] = kept
                    self.store.put(info.key, obj, created=False)

    def _delete_quietly(self, info: ResourceInfo, obj: Mapping[str, Any]) -> None:
        try:
            self.delete(info, obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
        except errors.ApiError as e:
            if e.code != 404:
                raise

    def _unique_resources(self) -> list[ResourceInfo]:
        seen: dict[str, ResourceInfo] = {}
        for info in self.registry.all():
            seen.setdefault(info.key, info)
        return list(seen.values())

    def collect_garbage(self) -> int:
        """Delete (background propagation) every object whose owners are all gone; cascades. Returns count."""
        deleted = 0
        while True:
            uids = {obj["metadata"].get("uid") for _, obj in self.store.items()}
            orphans = [
                (info, obj)
                for info in self._unique_resources()
                for obj in self.store.list_objects(info.key)
                if (references := obj["metadata"].get("ownerReferences"))
                and not obj["metadata"].get("deletionTimestamp")
                and all(reference.get("uid") not in uids for reference in references)
            ]
            if not orphans:
                return deleted
            for info, obj in orphans:
                self._delete_quietly(info, obj)
                deleted += 1
