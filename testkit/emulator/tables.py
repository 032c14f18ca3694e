"""Server-side printing: the meta.k8s.io/v1 Table that `kubectl get` asks for, with CRD printer columns."""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from testkit.emulator.resources import PrinterColumn, ResourceInfo

TABLE_ACCEPT_MARKER = "as=Table"

_TOKEN_RE = re.compile(
    r"""\.(?P<name>[A-Za-z0-9_\-/]+)
      | \[(?P<index>\d+)\]
      | \[\*\]
      | \[\?\(@\.(?P<filter_key>[A-Za-z0-9_.\-]+)\s*==\s*(?P<quote>["'])(?P<filter_value>.*?)(?P=quote)\)\]
    """,
    re.VERBOSE,
)


class JsonPathError(ValueError):
    pass


def evaluate_json_path(obj: Any, path: str) -> list[Any]:
    """The subset of JSONPath used by printer columns: .a.b, [N], [*] and [?(@.key=="value")]."""
    expression = path.strip()
    if expression.startswith("{") and expression.endswith("}"):
        expression = expression[1:-1]
    if expression.startswith("$"):
        expression = expression[1:]
    values: list[Any] = [obj]
    position = 0
    while position < len(expression):
        match = _TOKEN_RE.match(expression, position)
        if match is None:
            raise JsonPathError(f"unsupported JSONPath: {path!r} at {expression[position:]!r}")
        position = match.end()
        values = _step(values, match)
    return values


def _step(values: list[Any], match: re.Match[str]) -> list[Any]:
    stepped: list[Any] = []
    for value in values:
        if match["name"] is not None:
            if isinstance(value, Mapping) and match["name"] in value:
                stepped.append(value[match["name"]])
        elif match["index"] is not None:
            index = int(match["index"])
            if isinstance(value, list) and index < len(value):
                stepped.append(value[index])
        elif match["filter_key"] is not None:
            if isinstance(value, list):
                for item in value:
                    found = evaluate_json_path(item, "." + match["filter_key"])
                    if found and str(found[0]) == match["filter_value"]:
                        stepped.append(item)
        elif isinstance(value, list):
            stepped.extend(value)
        elif isinstance(value, Mapping):
            stepped.extend(value.values())
    return stepped


def human_duration(seconds: float) -> str:
    """Like k8s.io/apimachinery/pkg/util/duration.HumanDuration."""
    total = max(int(seconds), 0)
    minutes, hours, days = total // 60, total // 3600, total // 86400
    if total < 120:
        return f"{total}s"
    if minutes < 10:
        return f"{minutes}m{total % 60}s" if total % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if days < 8:
        return f"{days}d{hours % 24}h" if hours % 24 else f"{days}d"
    return f"{days}d"


def _age(timestamp: Any, now: datetime.datetime) -> str | None:
    if not isinstance(timestamp, str):
        return None
    try:
        moment = datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    except ValueError:
        return None
    return human_duration((now - moment).total_seconds())


def _cell(obj: Mapping[str, Any], column: PrinterColumn, now: datetime.datetime) -> Any:
    try:
        found = evaluate_json_path(obj, column.json_path)
    except JsonPathError:
        return None
    if not found:
        return None
    value = found[0]
    if column.type == "date":
        return _age(value, now)
    if column.type == "integer" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    if column.type == "number" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    if column.type == "boolean" and isinstance(value, bool):
        return value
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"))
    return str(value) if not isinstance(value, bool) else ("true" if value else "false")


_NAME_COLUMN = {
    "name": "Name",
    "type": "string",
    "format": "name",
    "description": "Name must be unique within a namespace.",
    "priority": 0,
}
_AGE_COLUMN = PrinterColumn(
    name="Age",
    type="date",
    json_path=".metadata.creationTimestamp",
    description="CreationTimestamp is a timestamp representing the server time when this object was created.",
)


def _columns(info: ResourceInfo | None) -> Sequence[PrinterColumn]:
    if info is not None and info.printer_columns:
        return info.printer_columns
    return (_AGE_COLUMN,)


def _row_object(obj: Mapping[str, Any], include_object: str) -> Mapping[str, Any] | None:
    if include_object == "None":
        return None
    if include_object == "Object":
        return obj
    return {
        "kind": "PartialObjectMetadata",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": obj.get("metadata") or {},
    }


def to_table(
    objects: Sequence[Mapping[str, Any]],
    info: ResourceInfo | None,
    *,
    resource_version: str,
    include_object: str = "Metadata",
    now: datetime.datetime | None = None,
    continue_token: str | None = None,
) -> dict[str, Any]:
    moment = now or datetime.datetime.now(datetime.UTC)
    columns = _columns(info)
    definitions = [dict(_NAME_COLUMN)] + [
        {
            "name": column.name,
            "type": column.type,
            "format": column.format,
            "description": column.description,
            "priority": column.priority,
        }
        for column in columns
    ]
    rows = []
    for obj in objects:
        row: dict[str, Any] = {
            "cells": [(obj.get("metadata") or {}).get("name")] + [_cell(obj, c, moment) for c in columns]
        }
        row_object = _row_object(obj, include_object)
        if row_object is not None:
            row["object"] = row_object
        rows.append(row)
    metadata: dict[str, Any] = {"resourceVersion": resource_version}
    if continue_token:
        metadata["continue"] = continue_token
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": metadata,
        "columnDefinitions": definitions,
        "rows": rows,
    }


def wants_table(accept_header: str) -> bool:
    """kubectl asks `application/json;as=Table;v=v1;g=meta.k8s.io,...,application/json`: Table comes first."""
    first = accept_header.split(",")[0] if accept_header else ""
    return TABLE_ACCEPT_MARKER in first
