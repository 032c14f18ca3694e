"""Label and field selectors as the API server parses them (`a=b,c!=d,e in (x,y),!f`)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any


class SelectorError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class Requirement:
    key: str
    operator: str  # one of: =, !=, in, notin, exists, !exists
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.operator == "exists":
            return present
        if self.operator == "!exists":
            return not present
        if self.operator in ("=", "in"):
            return present and value in self.values
        if self.operator in ("!=", "notin"):
            return not present or value not in self.values
        raise AssertionError(self.operator)


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside `in (...)` value sets."""
    parts: list[str] = []
    depth = 0
    current = ""
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [part.strip() for part in parts if part.strip()]


_SET_RE = re.compile(r"^(?P<key>[^\s!=(),]+)\s+(?P<op>in|notin)\s*\((?P<values>[^)]*)\)$")
_EQ_RE = re.compile(r"^(?P<key>[^\s!=(),]+)\s*(?P<op>==|=|!=)\s*(?P<value>[^\s!=(),]*)$")
_KEY_RE = re.compile(r"^(?P<neg>!)?\s*(?P<key>[^\s!=(),]+)$")


def parse_label_selector(text: str | None) -> list[Requirement]:
    if not text:
        return []
    requirements: list[Requirement] = []
    for part in _split_top_level(text):
        if match := _SET_RE.match(part):
            values = tuple(value.strip() for value in match["values"].split(",") if value.strip())
            requirements.append(Requirement(match["key"], match["op"], values))
        elif match := _EQ_RE.match(part):
            operator = "!=" if match["op"] == "!=" else "="
            requirements.append(Requirement(match["key"], operator, (match["value"],)))
        elif match := _KEY_RE.match(part):
            requirements.append(Requirement(match["key"], "!exists" if match["neg"] else "exists"))
        else:
            raise SelectorError(f"unable to parse requirement: {part!r}")
    return requirements


def labels_match(requirements: list[Requirement], obj: Mapping[str, Any]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(requirement.matches(labels) for requirement in requirements)


def parse_field_selector(text: str | None) -> list[Requirement]:
    """Field selectors support only =, == and != on dotted paths (e.g. metadata.name, status.phase)."""
    requirements = parse_label_selector(text)
    for requirement in requirements:
        if requirement.operator not in ("=", "!="):
            raise SelectorError(f"field selectors support only = and !=: {requirement.key}")
    return requirements


def _field_value(obj: Mapping[str, Any], dotted: str) -> str | None:
    current: Any = obj
    for part in dotted.split("."):
        if not isinstance(current, Mapping) or part not in current:
            return None
        current = current[part]
    if current is None:
        return None
    if isinstance(current, bool):
        return "true" if current else "false"
    return str(current)


def fields_match(requirements: list[Requirement], obj: Mapping[str, Any]) -> bool:
    for requirement in requirements:
        value = _field_value(obj, requirement.key) or ""
        if requirement.operator == "=" and value != requirement.values[0]:
            return False
        if requirement.operator == "!=" and value == requirement.values[0]:
            return False
    return True


def selector_from_label_selector(selector: Mapping[str, Any]) -> str:
    """Render a structured LabelSelector (matchLabels/matchExpressions) as the string form used by /scale."""
    parts = [f"{key}={value}" for key, value in sorted((selector.get("matchLabels") or {}).items())]
    for expression in selector.get("matchExpressions") or []:
        operator = expression.get("operator", "")
        key = expression.get("key", "")
        values = ",".join(expression.get("values") or [])
        if operator == "In":
            parts.append(f"{key} in ({values})")
        elif operator == "NotIn":
            parts.append(f"{key} notin ({values})")
        elif operator == "Exists":
            parts.append(key)
        elif operator == "DoesNotExist":
            parts.append(f"!{key}")
    return ",".join(parts)
