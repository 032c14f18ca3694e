"""Generate the InferenceDeployment CRD from the pydantic models.

The models are the single source of truth: this module turns their JSON Schema into a
*structural* OpenAPI v3 schema (no $ref, no nullable unions, no `title`), with the CEL rules
and defaults the models declare, plus the CRD's names, subresources and printer columns.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from splitserve.api.base import API_GROUP, API_VERSION, KIND, PLURAL, SHORT_NAMES, SINGULAR, cel
from splitserve.api.spec import InferenceDeploymentSpec
from splitserve.api.status import InferenceDeploymentStatus

CRD_NAME = f"{PLURAL}.{API_GROUP}"
CRD_FILE_NAME = f"{API_GROUP}_{PLURAL}.yaml"

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Ready", "type": "string", "jsonPath": ".status.ready"},
    {"name": "Mode", "type": "string", "jsonPath": ".status.mode", "description": "mode being served"},
    {
        "name": "Prefill",
        "type": "string",
        "jsonPath": ".status.prefill.summary",
        "description": "ready/desired",
    },
    {
        "name": "Decode",
        "type": "string",
        "jsonPath": ".status.decode.summary",
        "description": "ready/desired",
    },
    {
        "name": "Rollout",
        "type": "string",
        "jsonPath": ".status.rollout.summary",
        "description": "KV generation being rolled out: ready/desired workers, traffic share",
    },
    {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint"},
    {"name": "Generation", "type": "string", "jsonPath": ".status.kvGeneration", "priority": 1},
    {"name": "Diagnosis", "type": "string", "jsonPath": ".status.diagnosis.summary", "priority": 1},
    {
        "name": "Adapters",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="AdaptersReady")].status',
        "description": "spec.adapters: whether every worker serves every adapter (status.adapters says which not)",
        "priority": 1,
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

_DROPPED_KEYS = {"title", "discriminator"}


def _is_null(schema: dict[str, Any]) -> bool:
    return schema.get("type") == "null"


def _structural(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Rewrite one pydantic JSON-Schema node into a structural OpenAPI v3 node."""
    node = {k: v for k, v in schema.items() if k not in _DROPPED_KEYS}
    if "$ref" in node:
        target = defs[node.pop("$ref").rsplit("/", 1)[-1]]
        resolved = _structural(target, defs)
        resolved.update({k: v for k, v in node.items()})  # field-level description/default win
        node = resolved
    if "anyOf" in node and not node.get("x-kubernetes-int-or-string"):
        options = [opt for opt in node.pop("anyOf") if not _is_null(opt)]
        if len(options) != 1:
            raise ValueError(f"unions other than Optional[X] are not structural: {schema}")
        inner = _structural(options[0], defs)
        inner.update(node)
        node = inner
        if node.get("default", ...) is None:
            del node["default"]  # Optional fields are simply absent, not null
    if "const" in node:
        node["enum"] = [node.pop("const")]
    # JSON Schema 2020 writes exclusive bounds as numbers; OpenAPI v3.0 (Kubernetes) as booleans.
    for exclusive, inclusive in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(node.get(exclusive), int | float) and not isinstance(node.get(exclusive), bool):
            node[inclusive] = node.pop(exclusive)
            node[exclusive] = True
    if "properties" in node:
        node["type"] = "object"
        node.pop("additionalProperties", None)  # structural schemas prune unknown fields instead
        required = set(node.get("required", []))
        node["properties"] = {
            name: _with_container_default(_structural(prop, defs), name in required)
            for name, prop in node["properties"].items()
        }
    elif isinstance(node.get("additionalProperties"), dict):
        node["additionalProperties"] = _structural(node["additionalProperties"], defs)
    if isinstance(node.get("items"), dict):
        node["items"] = _structural(node["items"], defs)
    return node


def _with_container_default(node: dict[str, Any], required: bool) -> dict[str, Any]:
    """Give optional objects/lists a `{}`/`[]` default so the API server fills nested defaults.

    Pydantic does not emit defaults produced by default_factory; Kubernetes only defaults the
    fields of an object that exists, so an empty default is what writes the whole tree out.
    """
    if required or "default" in node:
        return node
    if node.get("type") == "object" and "properties" in node:
        node["default"] = {}
    elif node.get("type") == "array":
        node["default"] = []
    return node


def _model_schema(model: type[Any]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return _mark_optional_objects(_structural(raw, defs), model)


def _mark_optional_objects(schema: dict[str, Any], model: type[Any]) -> dict[str, Any]:
    """Drop the `{}` default from objects declared `X | None = None` (absent means "not set")."""
    for name, field in model.model_fields.items():
        alias = field.alias or name
        prop = schema.get("properties", {}).get(alias)
        if prop is None:
            continue
        if field.default is None and prop.get("default") == {}:
            del prop["default"]
        annotation = field.annotation
        for arg in (*getattr(annotation, "__args__", ()), annotation):
            if isinstance(arg, type) and hasattr(arg, "model_fields") and "properties" in prop:
                _mark_optional_objects(prop, arg)
    return schema


def openapi_schema() -> dict[str, Any]:
    spec = _model_schema(InferenceDeploymentSpec)
    spec["description"] = "Desired state: model, engine, KV transfer, pools, router, autoscaling."
    status = _model_schema(InferenceDeploymentStatus)
    status["description"] = "Observed state, written by the operator."
    return {
        "type": "object",
        "x-kubernetes-validations": [
            cel(
                "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$') && size(self.metadata.name) <= 40",
                "metadata.name must be a lowercase DNS label of at most 40 characters "
                "(the operator derives Service names such as <name>-prefill from it)",
            )
        ],
        "description": "A disaggregated (prefill/decode) LLM deployment served by vLLM behind a KV-transfer router.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
    }


def build_crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {"app.kubernetes.io/name": "splitserve", "app.kubernetes.io/part-of": "splitserve"},
        },
        "spec": {
            "group": API_GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": ["splitserve"],
            },
            "versions": [
                {
                    "name": API_VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": copy.deepcopy(PRINTER_COLUMNS),
                }
            ],
        },
    }


def render_crd_yaml() -> str:
    header = "# Generated by `splitserve crd` from splitserve.api; do not edit by hand.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=120)
