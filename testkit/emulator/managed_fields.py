"""Field ownership (metadata.managedFields) and server-side apply.

Simplified from the real structured-merge-diff: a field is a path of map keys down to a leaf, lists are
atomic (owned as a whole), and every entry keeps its fields in the real `FieldsV1` shape
(`{"f:spec": {"f:replicas": {}}}`) so tests and kubectl read them as they would from a real server.
What matters for an operator is preserved:

* an Apply by manager M conflicts (409) with fields another manager owns with a different value,
  unless `force=true`, which moves the ownership to M;
* fields M applied before and leaves out now are removed, unless another manager also owns them
  (e.g. `kubectl scale` took `spec.replicas`): then they are left as they are;
* non-apply writes (create/update/patch, /scale, /status) give the changed fields to their manager
  and take them away from every other manager, like the real server does.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

Path = tuple[str, ...]
Tracked = Callable[[Path], bool]

_UNTRACKED_METADATA = frozenset(
    {
        "name",
        "namespace",
        "uid",
        "resourceVersion",
        "generation",
        "creationTimestamp",
        "managedFields",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "selfLink",
        "generateName",
    }
)


class ApplyConflict(Exception):
    def __init__(self, conflicts: list[tuple[Path, str]]) -> None:
        self.conflicts = conflicts
        described = "; ".join(f'conflict with "{manager}": .{".".join(path)}' for path, manager in conflicts)
        super().__init__(f"Apply failed with {len(conflicts)} conflict(s): {described}")


def track_main_resource(path: Path, *, has_status_subresource: bool) -> bool:
    """Which fields a write to the main resource owns."""
    if not path or path[0] in ("apiVersion", "kind"):
        return False
    if path[0] == "metadata" and (len(path) < 2 or path[1] in _UNTRACKED_METADATA):
        return False
    return not (has_status_subresource and path[0] == "status")


def track_status_subresource(path: Path) -> bool:
    return bool(path) and path[0] == "status"


def leaf_paths(value: Any, prefix: Path = ()) -> set[Path]:
    if isinstance(value, Mapping) and value:
        paths: set[Path] = set()
        for key, child in value.items():
            paths |= leaf_paths(child, (*prefix, str(key)))
        return paths
    return {prefix} if prefix else set()


def value_at(obj: Any, path: Path) -> tuple[bool, Any]:
    current = obj
    for key in path:
        if not isinstance(current, Mapping) or key not in current:
            return False, None
        current = current[key]
    return True, current


def remove_path(obj: dict[str, Any], path: Path) -> None:
    current: Any = obj
    for key in path[:-1]:
        if not isinstance(current, dict) or key not in current:
            return
        current = current[key]
    if isinstance(current, dict):
        current.pop(path[-1], None)


def related(owned: Path, path: Path, obj: Mapping[str, Any]) -> bool:
    """Whether owning `owned` means owning (part of) `path` in obj.

    Equal paths and fields inside `path` count; an ancestor counts only when it is atomic (a list or scalar):
    owning the map `spec` itself (applied as `spec: {}`) says nothing about `spec.replicas`.
    """
    if owned[: len(path)] == path:
        return True
    return path[: len(owned)] == owned and not isinstance(value_at(obj, owned)[1], Mapping)


def fields_v1(paths: Iterable[Path]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path in sorted(paths):
        node = tree
        for key in path:
            node = node.setdefault(f"f:{key}", {})
    return tree


def paths_from_fields_v1(tree: Mapping[str, Any], prefix: Path = ()) -> set[Path]:
    children = {key: value for key, value in tree.items() if key.startswith("f:")}
    if not children:
        return {prefix} if prefix else set()
    paths: set[Path] = set()
    for key, value in children.items():
        paths |= paths_from_fields_v1(value if isinstance(value, Mapping) else {}, (*prefix, key[2:]))
    return paths


@dataclasses.dataclass
class ManagerEntry:
    manager: str
    operation: str  # "Apply" or "Update"
    api_version: str
    subresource: str
    time: str
    paths: set[Path]

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.manager, self.operation, self.subresource)

    def to_json(self) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "manager": self.manager,
            "operation": self.operation,
            "apiVersion": self.api_version,
            "time": self.time,
            "fieldsType": "FieldsV1",
            "fieldsV1": fields_v1(self.paths),
        }
        if self.subresource:
            entry["subresource"] = self.subresource
        return entry


def read_entries(obj: Mapping[str, Any]) -> list[ManagerEntry]:
    entries = []
    for raw in (obj.get("metadata") or {}).get("managedFields") or []:
        entries.append(
            ManagerEntry(
                manager=raw.get("manager", ""),
                operation=raw.get("operation", "Update"),
                api_version=raw.get("apiVersion", ""),
                subresource=raw.get("subresource", ""),
                time=raw.get("time", ""),
                paths=paths_from_fields_v1(raw.get("fieldsV1") or {}),
            )
        )
    return entries


def write_entries(obj: dict[str, Any], entries: list[ManagerEntry]) -> None:
    kept = [entry.to_json() for entry in entries if entry.paths]
    metadata = obj.setdefault("metadata", {})
    if kept:
        metadata["managedFields"] = kept
    else:
        metadata.pop("managedFields", None)


def _entry_for(
    entries: list[ManagerEntry], manager: str, operation: str, subresource: str, api_version: str, now: str
) -> ManagerEntry:
    for entry in entries:
        if entry.key == (manager, operation, subresource):
            return entry
    entry = ManagerEntry(manager, operation, api_version, subresource, now, set())
    entries.append(entry)
    return entry


def changed_paths(old: Mapping[str, Any] | None, new: Mapping[str, Any], tracked: Tracked) -> set[Path]:
    old_leaves = leaf_paths(old or {})
    new_leaves = leaf_paths(new)
    changed = {path for path in new_leaves if value_at(old or {}, path) != value_at(new, path)}
    removed = {path for path in old_leaves if not value_at(new, path)[0]}
    return {path for path in changed | removed if tracked(path)}


def record_update(
    old: Mapping[str, Any] | None,
    new: dict[str, Any],
    *,
    manager: str,
    subresource: str,
    api_version: str,
    now: str,
    tracked: Tracked,
) -> None:
    """A non-apply write: the manager takes every field it changed (no conflicts for updates)."""
    entries = read_entries(old or {})
    changed = changed_paths(old, new, tracked)
    for entry in entries:
        entry.paths = {path for path in entry.paths if not any(related(path, c, new) for c in changed)}
    existing = {path for path in changed if value_at(new, path)[0]}
    if existing:
        mine = _entry_for(entries, manager, "Update", subresource, api_version, now)
        mine.paths |= existing
        mine.api_version, mine.time = api_version, now
    write_entries(new, entries)


def server_side_apply(
    current: Mapping[str, Any] | None,
    applied: Mapping[str, Any],
    *,
    manager: str,
    force: bool,
    subresource: str,
    api_version: str,
    now: str,
    tracked: Tracked,
) -> dict[str, Any]:
    """Return the object after manager's apply of `applied`; raises ApplyConflict unless forced."""
    applied_paths = {path for path in leaf_paths(applied) if tracked(path)}
    base: dict[str, Any] = copy.deepcopy(dict(current)) if current is not None else {}
    entries = read_entries(base)
    mine = _entry_for(entries, manager, "Apply", subresource, api_version, now)
    others = [entry for entry in entries if entry is not mine]

    conflicts: list[tuple[Path, str]] = []
    for path in sorted(applied_paths):
        # An applied (empty) map merges into what is there: it competes only for the map itself.
        applied_map = isinstance(value_at(applied, path)[1], Mapping)
        for entry in others:
            owned = [
                owned
                for owned in entry.paths
                if owned[: len(path)] == path[: len(owned)] and not (applied_map and len(owned) > len(path))
            ]
            if owned and value_at(base, path) != value_at(applied, path):
                conflicts.append((path, entry.manager))
                if force:
                    entry.paths -= set(owned)
    if conflicts and not force:
        raise ApplyConflict(conflicts)

    # Fields this manager applied before and leaves out now go away, unless someone else owns them too.
    for path in mine.paths - applied_paths:
        if any(applied_path[: len(path)] == path for applied_path in applied_paths):
            continue  # still applied, as the parent of what is applied now
        if not any(any(related(owned, path, base) for owned in entry.paths) for entry in others):
            remove_path(base, path)

    result: dict[str, Any] = _apply_merge(base, applied)
    if mine.paths != applied_paths or _content(result) != _content(current or {}):
        mine.api_version, mine.time = api_version, now
    mine.paths = applied_paths
    write_entries(result, entries)
    return result


def _content(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The object without its ownership records, to tell a no-op apply from a real change."""
    content = dict(obj)
    content["metadata"] = {k: v for k, v in (obj.get("metadata") or {}).items() if k != "managedFields"}
    return content


def _apply_merge(target: Any, applied: Any) -> Any:
    if not isinstance(applied, Mapping):
        return copy.deepcopy(applied)
    result: dict[str, Any] = dict(target) if isinstance(target, Mapping) else {}
    for key, value in applied.items():
        if key == "managedFields":
            continue
        result[key] = _apply_merge(result.get(key), value)
    return result


def owners_of(obj: Mapping[str, Any], dotted_path: str) -> list[str]:
    """Managers owning a field, e.g. owners_of(deployment, "spec.replicas") -> ["kubectl"]."""
    path = tuple(dotted_path.split("."))
    return [entry.manager for entry in read_entries(obj) if any(related(owned, path, obj) for owned in entry.paths)]
