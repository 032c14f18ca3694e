"""JSON merge patches (RFC 7386) on an InferenceDeployment spec: what the diagnosis recommends and the
autopilot applies. Pure."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from splitserve.api.spec import InferenceDeploymentSpec


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: objects merge recursively, null deletes, anything else replaces."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result: dict[str, Any] = dict(copy.deepcopy(target)) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def patched_spec(spec: InferenceDeploymentSpec, patch: Mapping[str, Any]) -> InferenceDeploymentSpec | None:
    """The spec with `patch` merged in, or None when the result is not a valid spec."""
    document = merge_patch(spec.model_dump(mode="json", by_alias=True), patch)
    try:
        return InferenceDeploymentSpec.model_validate(document)
    except ValidationError:
        return None


def changes_spec(spec: InferenceDeploymentSpec, patch: Mapping[str, Any] | None) -> bool:
    """Whether applying `patch` gives a valid spec that differs from `spec` (a no-op patch changes nothing)."""
    if not patch:
        return False
    patched = patched_spec(spec, patch)
    return patched is not None and patched != spec
