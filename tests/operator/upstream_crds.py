"""Other projects' custom resources the builders emit (spec.gateway's InferencePool and HTTPRoute),
checked against those projects' own CRDs, vendored in tests/data/upstream-crds (see its README).

kubernetes-validate knows only built-in kinds, and no API server runs here, so this does what one
would do at admission: apply the schema's defaults, validate against its openAPIV3Schema (strict:
an unknown field fails here, where a server would silently prune it), then evaluate every
`x-kubernetes-validations` CEL rule on the defaulted object with the CEL library the operator's own
validation uses.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jsonschema
import yaml

# The extension module itself, not the package: xds-protos (Envoy's protos, for `splitserve epp`) ships
# cel/expr and an empty cel/__init__.py that may replace common-expression-language's when installed after it.
from cel.cel import evaluate as cel_evaluate

from splitserve.validation.checker import rules_at, tighten

UPSTREAM_CRDS = Path(__file__).resolve().parents[1] / "data" / "upstream-crds"


@functools.cache
def upstream_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> openAPIV3Schema of every served version of the vendored CRDs."""
    schemas: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(UPSTREAM_CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        spec = crd["spec"]
        for version in spec["versions"]:
            if version.get("served"):
                key = (f"{spec['group']}/{version['name']}", spec["names"]["kind"])
                schemas[key] = version["schema"]["openAPIV3Schema"]
    return schemas


def is_upstream_kind(obj: Mapping[str, Any]) -> bool:
    return (obj["apiVersion"], obj["kind"]) in upstream_schemas()


def with_defaults(schema: Mapping[str, Any], value: Any) -> Any:
    """The value as the API server stores it: each absent property with a default gets it, recursively."""
    if isinstance(value, dict):
        filled = dict(value)
        for name, sub in schema.get("properties", {}).items():
            if name not in filled and "default" in sub:
                filled[name] = copy.deepcopy(sub["default"])
            if name in filled:
                filled[name] = with_defaults(sub, filled[name])
        return filled
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        return [with_defaults(schema["items"], item) for item in value]
    return value


def upstream_problems(obj: Mapping[str, Any]) -> list[str]:
    """Everything the object's own CRD would reject; [] when it is valid."""
    schema = upstream_schemas()[(obj["apiVersion"], obj["kind"])]
    stored = with_defaults(schema, obj)
    validator = jsonschema.Draft4Validator(tighten(schema))
    problems = [f"{list(error.absolute_path)}: {error.message}" for error in validator.iter_errors(stored)]
    if problems:
        return problems  # CEL rules assume a schema-valid object, as on a real API server
    for rule, value, _old, path in rules_at(schema, stored, None, []):
        if "oldSelf" in rule["rule"]:
            continue  # transition rules: only on updates
        try:
            ok = cel_evaluate(rule["rule"], {"self": value})
        except Exception as error:  # a rule this CEL library cannot run must not pass silently
            problems.append(f"{path}: cannot evaluate {rule['rule']!r}: {error}")
            continue
        if ok is not True:
            problems.append(f"{path}: {rule.get('message', rule['rule'])}")
    return problems
