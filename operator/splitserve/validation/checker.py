"""Offline validation of InferenceDeployments with the CRD's own schema and CEL rules.

A real API server checks a custom resource in three steps: the structural OpenAPI schema, the
defaults, then every `x-kubernetes-validations` CEL rule against the defaulted object. This
module does the same with the generated CRD (jsonschema for the schema, a Python CEL library
for the rules), so `splitserve validate`, `splitserve up` and the operator all reject what a
cluster would reject, with the same messages.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import jsonschema
import yaml

# The extension module itself, not the package: xds-protos (Envoy's protos, for `splitserve epp`) ships
# cel/expr and an empty cel/__init__.py that may replace common-expression-language's when installed after it.
from cel.cel import evaluate as cel_evaluate

from splitserve.api.base import API_GROUP, API_VERSION, KIND
from splitserve.api.crd import openapi_schema
from splitserve.api.spec import InferenceDeploymentSpec
from splitserve.autoscaling.queries import check_query_overrides

API_VERSION_FULL = f"{API_GROUP}/{API_VERSION}"


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a document: where (a field path) and what, in words."""

    document: str  # "#1 (my-llm)" style label for multi-document files
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.document}: {self.path}: {self.message}"


def tighten(node: Mapping[str, Any]) -> dict[str, Any]:
    """A structural schema made strict for offline checks: unknown fields are reported, not pruned (any
    CRD's: the tests check other projects' custom resources with it too)."""
    node = dict(node)
    if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
        node["properties"] = {k: tighten(v) for k, v in node["properties"].items()}
        node["additionalProperties"] = False
    if isinstance(node.get("additionalProperties"), dict):
        node["additionalProperties"] = tighten(node["additionalProperties"])
    if isinstance(node.get("items"), dict):
        node["items"] = tighten(node["items"])
    if "anyOf" in node:
        node["anyOf"] = [tighten(option) for option in node["anyOf"]]
    return node


@functools.cache
def _strict_schema() -> dict[str, Any]:
    """The CRD schema made strict for offline checks: unknown fields are reported, not pruned."""
    schema = tighten(openapi_schema())
    schema["properties"]["metadata"] = {
        "type": "object",
        "required": ["name"],
        "properties": {"name": {"type": "string", "minLength": 1}},
    }
    return schema


def _json_path(parts: Iterator[Any] | list[Any]) -> str:
    path = ""
    for part in parts:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path.lstrip(".") or "<root>"


def _schema_problems(obj: Mapping[str, Any], label: str) -> list[Problem]:
    validator = jsonschema.Draft4Validator(_strict_schema())
    problems = []
    for error in sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path)):
        message = error.message
        if error.validator == "additionalProperties":
            message = f"unknown field(s): {message.split('(')[-1].rstrip(')')}"
        problems.append(Problem(label, _json_path(list(error.absolute_path)), message))
    return problems


def with_defaults(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The object as the API server stores it: every default written out (schema-valid input)."""
    defaulted = copy.deepcopy(dict(obj))
    defaulted["spec"] = InferenceDeploymentSpec.model_validate(obj["spec"]).to_wire()
    return defaulted


def rules_at(
    schema: Mapping[str, Any], value: Any, old: Any, path: list[Any]
) -> Iterator[tuple[dict[str, str], Any, Any, list[Any]]]:
    """Walk schema and value together, yielding each CEL rule with the value it guards (any CRD's
    schema: the tests check other projects' custom resources with it too)."""
    for rule in schema.get("x-kubernetes-validations", []):
        yield rule, value, old, path
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                sub_old = old.get(name) if isinstance(old, dict) else None
                yield from rules_at(sub, value[name], sub_old, [*path, name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name, item in value.items():
                yield from rules_at(extra, item, None, [*path, name])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            yield from rules_at(schema["items"], item, None, [*path, index])


@functools.cache
def _crd_schema() -> dict[str, Any]:
    return openapi_schema()


def _cel_problems(obj: dict[str, Any], old: dict[str, Any] | None, label: str) -> list[Problem]:
    problems = []
    for rule, value, old_value, path in rules_at(_crd_schema(), obj, old, []):
        is_transition = "oldSelf" in rule["rule"]
        if is_transition and old_value is None:
            continue  # transition rules only apply to updates of a field that existed
        context: dict[str, Any] = {"self": value}
        if is_transition:
            context["oldSelf"] = old_value
        try:
            ok = cel_evaluate(rule["rule"], context)
        except Exception as error:  # a rule that cannot evaluate is a bug in our CRD, say so plainly
            problems.append(Problem(label, _json_path(path), f"rule {rule['rule']!r} failed to evaluate: {error}"))
            continue
        if ok is not True:
            field_path = rule.get("fieldPath", "")
            problems.append(Problem(label, _json_path(path) + field_path, _message(rule, context)))
    return problems


def _message(rule: Mapping[str, str], context: dict[str, Any]) -> str:
    """A failed rule's message: its messageExpression's when it gives a non-empty string, as on an API server,
    else its message."""
    expression = rule.get("messageExpression")
    if expression:
        try:
            text = cel_evaluate(expression, context)
        except Exception:  # an API server falls back to `message` the same way
            text = None
        if isinstance(text, str) and text.strip():
            return text
    return rule["message"]


def label_for(index: int, obj: Any) -> str:
    name = obj.get("metadata", {}).get("name") if isinstance(obj, dict) else None
    return f"document {index + 1}" + (f" ({name})" if isinstance(name, str) else "")


def validate_object(obj: Any, *, old: Mapping[str, Any] | None = None, index: int = 0) -> list[Problem]:
    """Every problem with one InferenceDeployment, as a cluster would report them."""
    label = label_for(index, obj)
    if not isinstance(obj, dict):
        return [Problem(label, "<root>", "expected a YAML mapping (an object)")]
    if obj.get("kind") != KIND or obj.get("apiVersion") != API_VERSION_FULL:
        found = f"{obj.get('apiVersion')}/{obj.get('kind')}"
        return [Problem(label, "apiVersion/kind", f"expected {API_VERSION_FULL} {KIND}, found {found}")]
    problems = _schema_problems(obj, label)
    if problems:
        return problems  # CEL rules assume a schema-valid object, as on a real API server
    defaulted = with_defaults(obj)
    old_defaulted = with_defaults(old) if old is not None else None
    problems = _cel_problems(defaulted, old_defaulted, label)
    if problems:
        return problems
    return _operator_problems(defaulted, label)


def _operator_problems(defaulted: dict[str, Any], label: str) -> list[Problem]:
    """What the schema cannot express but the operator refuses (reported as InvalidSpec): PromQL
    overrides with unknown signals or placeholders would otherwise fail every autoscaling evaluation."""
    spec = InferenceDeploymentSpec.model_validate(defaulted["spec"])
    prefix = "autoscaling.queries"
    return [
        Problem(label, "spec." + prefix, message.removeprefix(prefix).removeprefix(": "))
        for message in check_query_overrides(spec.autoscaling)
    ]


def load_documents(text: str) -> list[Any]:
    """YAML documents of a file, skipping empty ones (a trailing `---` is common)."""
    return [doc for doc in yaml.safe_load_all(text) if doc is not None]


def validate_text(text: str) -> list[Problem]:
    """Every problem in a (multi-document) YAML text of InferenceDeployments."""
    try:
        documents = load_documents(text)
    except yaml.YAMLError as error:
        return [Problem("file", "<yaml>", f"not valid YAML: {error}")]
    if not documents:
        return [Problem("file", "<root>", "no YAML documents found")]
    return [problem for index, doc in enumerate(documents) for problem in validate_object(doc, index=index)]
