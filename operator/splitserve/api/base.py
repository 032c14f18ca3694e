"""Shared pieces of the API models: camelCase wire names and CRD-only schema hints."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, JsonValue
from pydantic.alias_generators import to_camel

API_GROUP = "splitserve.io"
API_VERSION = "v1alpha1"
KIND = "InferenceDeployment"
PLURAL = "inferencedeployments"
SINGULAR = "inferencedeployment"
SHORT_NAMES = ["idep"]


def cel(
    rule: str,
    message: str,
    *,
    field_path: str | None = None,
    reason: str | None = None,
    message_expression: str | None = None,
) -> dict[str, str]:
    """One `x-kubernetes-validations` entry (a CEL rule with the message a person reads).

    `message_expression`: a CEL expression giving the message from the object (naming the offending
    value); `message` stays as the fallback when it fails to evaluate."""
    entry = {"rule": rule, "message": message}
    if message_expression:
        entry["messageExpression"] = message_expression
    if field_path:
        entry["fieldPath"] = field_path
    if reason:
        entry["reason"] = reason
    return entry


def cel_rules(*rules: dict[str, str]) -> ConfigDict:
    """Model config adding CEL rules to the object's schema (pydantic merges it with the parent's)."""
    validations: list[JsonValue] = [dict(rule) for rule in rules]
    return ConfigDict(json_schema_extra={"x-kubernetes-validations": validations})


def immutable(message: str) -> dict[str, Any]:
    """A transition rule: the field may be set at creation but never changed afterwards."""
    return {"x-kubernetes-validations": [cel("self == oldSelf", message)]}


class ApiModel(BaseModel):
    """Base for every spec/status object: camelCase on the wire, unknown fields rejected.

    Unknown fields are rejected (not ignored) because a typo in a YAML key that silently does
    nothing is the worst kind of configuration error; the CRD schema is structural and prunes
    them on a real API server, and `splitserve validate` reports them.
    """

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_default=True,
    )

    def to_wire(self) -> dict[str, Any]:
        """The object as it appears in YAML/JSON: camelCase keys, defaults written out."""
        return self.model_dump(by_alias=True, mode="json", exclude_none=True)
