"""Patch formats the API server accepts: JSON merge patch, JSON patch (RFC 6902) and strategic merge."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any


class PatchError(ValueError):
    """The patch cannot be applied; the API server answers 422 Unprocessable Entity."""


# The emulator keeps its own patch semantics rather than importing the operator's
# (splitserve.api.patch.merge_patch): it stands in for the API server the operator is
# tested against, so a bug in the operator's merge must not be mirrored here.
def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: dicts merge recursively, null deletes, everything else (lists too) replaces."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result: dict[str, Any] = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def _split_pointer(pointer: str) -> list[str]:
    if pointer == "":
        return []
    if not pointer.startswith("/"):
        raise PatchError(f"invalid JSON pointer: {pointer!r}")
    return [_unescape(token) for token in pointer[1:].split("/")]


def _list_index(container: list[Any], token: str, *, for_insert: bool) -> int:
    if for_insert and token == "-":
        return len(container)
    try:
        index = int(token)
    except ValueError:
        raise PatchError(f"invalid list index: {token!r}") from None
    limit = len(container) if for_insert else len(container) - 1
    if index < 0 or index > limit:
        raise PatchError(f"list index out of range: {index}")
    return index


def _resolve_parent(document: Any, tokens: list[str]) -> Any:
    current = document
    for token in tokens[:-1]:
        if isinstance(current, dict):
            if token not in current:
                raise PatchError(f"path not found: {token!r}")
            current = current[token]
        elif isinstance(current, list):
            current = current[_list_index(current, token, for_insert=False)]
        else:
            raise PatchError(f"cannot descend into a scalar at {token!r}")
    return current


def _get(document: Any, pointer: str) -> Any:
    tokens = _split_pointer(pointer)
    if not tokens:
        return document
    parent = _resolve_parent(document, tokens)
    last = tokens[-1]
    if isinstance(parent, dict):
        if last not in parent:
            raise PatchError(f"path not found: {pointer}")
        return parent[last]
    if isinstance(parent, list):
        return parent[_list_index(parent, last, for_insert=False)]
    raise PatchError(f"path not found: {pointer}")


def _remove(document: Any, pointer: str) -> Any:
    tokens = _split_pointer(pointer)
    if not tokens:
        raise PatchError("cannot remove the whole document")
    parent = _resolve_parent(document, tokens)
    last = tokens[-1]
    if isinstance(parent, dict):
        if last not in parent:
            raise PatchError(f"path not found: {pointer}")
        return parent.pop(last)
    if isinstance(parent, list):
        return parent.pop(_list_index(parent, last, for_insert=False))
    raise PatchError(f"path not found: {pointer}")


def _add(document: Any, pointer: str, value: Any, *, replace: bool) -> Any:
    tokens = _split_pointer(pointer)
    if not tokens:
        return copy.deepcopy(value)
    parent = _resolve_parent(document, tokens)
    last = tokens[-1]
    if isinstance(parent, dict):
        if replace and last not in parent:
            raise PatchError(f"path not found: {pointer}")
        parent[last] = copy.deepcopy(value)
    elif isinstance(parent, list):
        if replace:
            parent[_list_index(parent, last, for_insert=False)] = copy.deepcopy(value)
        else:
            parent.insert(_list_index(parent, last, for_insert=True), copy.deepcopy(value))
    else:
        raise PatchError(f"path not found: {pointer}")
    return document


def json_patch(document: Any, operations: Any) -> Any:
    """RFC 6902 on a deep copy; a failed `test` or a missing path raises PatchError (-> 422)."""
    if not isinstance(operations, list):
        raise PatchError("a JSON patch must be a list of operations")
    result = copy.deepcopy(document)
    for operation in operations:
        if not isinstance(operation, Mapping) or "op" not in operation or "path" not in operation:
            raise PatchError(f"malformed JSON patch operation: {operation!r}")
        op, path = operation["op"], operation["path"]
        if op == "add":
            result = _add(result, path, operation.get("value"), replace=False)
        elif op == "replace":
            result = _add(result, path, operation.get("value"), replace=True)
        elif op == "remove":
            _remove(result, path)
        elif op == "test":
            if _get(result, path) != operation.get("value"):
                raise PatchError(f"test operation failed at {path}")
        elif op == "move":
            value = _remove(result, operation["from"])
            result = _add(result, path, value, replace=False)
        elif op == "copy":
            result = _add(result, path, _get(result, operation["from"]), replace=False)
        else:
            raise PatchError(f"unknown JSON patch operation: {op!r}")
    return result


def _merge_key(field: str, items: list[Any]) -> str | None:
    """The strategic-merge key of well-known list fields, guessed like the built-in schemas define it."""
    if not items or not all(isinstance(item, Mapping) for item in items):
        return None
    candidates = {
        "ports": ("containerPort", "port"),
        "volumeMounts": ("mountPath",),
        "volumeDevices": ("devicePath",),
        "conditions": ("type",),
        "hostAliases": ("ip",),
        "topologySpreadConstraints": ("topologyKey",),
    }.get(field, ("name",))
    for key in candidates:
        if all(key in item for item in items):
            return key
    return None


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """Strategic merge as kubectl sends it: merge-by-key for well-known lists and the `$` directives.

    Not the full schema-driven algorithm: list fields whose items all carry the conventional merge key
    (`name`, `containerPort`, `mountPath`, `type`) merge by it, other lists replace.
    """
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {key: copy.deepcopy(value) for key, value in patch.items() if key != "$patch"}
    result: dict[str, Any] = dict(target) if isinstance(target, Mapping) else {}
    order_directives: dict[str, list[Any]] = {}
    for key, value in patch.items():
        if key.startswith("$setElementOrder/"):
            order_directives[key.split("/", 1)[1]] = value
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            result[field] = [item for item in result.get(field) or [] if item not in value]
            continue
        if key.startswith("$"):
            continue  # $retainKeys and friends: the plain merge is close enough for tests
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list) and isinstance(result.get(key), list):
            result[key] = _merge_lists(key, result[key], value)
        elif isinstance(value, Mapping):
            result[key] = strategic_merge_patch(result.get(key), value)
        else:
            result[key] = copy.deepcopy(value)
    for field, order in order_directives.items():
        if isinstance(result.get(field), list):
            result[field] = _reorder(field, result[field], order)
    return result


def _merge_lists(field: str, current: list[Any], patch: list[Any]) -> list[Any]:
    merge_key = _merge_key(field, current + patch)
    if merge_key is None:
        return copy.deepcopy(patch)
    merged = [copy.deepcopy(item) for item in current]
    for item in patch:
        position = next(
            (index for index, existing in enumerate(merged) if existing.get(merge_key) == item.get(merge_key)),
            None,
        )
        if item.get("$patch") == "delete":
            if position is not None:
                merged.pop(position)
        elif position is None:
            merged.append(strategic_merge_patch({}, item))
        else:
            merged[position] = strategic_merge_patch(merged[position], item)
    return merged


def _reorder(field: str, items: list[Any], order: list[Any]) -> list[Any]:
    merge_key = _merge_key(field, items)
    if merge_key is None:
        return items
    wanted = [entry.get(merge_key) if isinstance(entry, Mapping) else entry for entry in order]
    ranked = sorted(
        items,
        key=lambda item: wanted.index(item.get(merge_key)) if item.get(merge_key) in wanted else len(wanted),
    )
    return ranked
