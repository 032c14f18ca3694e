"""The spec the operator serves: the user's spec with dynamic optimization's overrides merged in.

The CR's spec stays the user's intent (a GitOps tool sees no drift); changes the autopilot makes live
in status.autopilot.overrides as a JSON merge patch (RFC 7386) over the spec. Rules:
- overrides count only while spec.optimization.dynamic is on: turning it off serves the spec as written;
- a kind named in spec.optimization.veto drops its override at once (a veto added later wins);
- overrides are kept minimal: a leaf equal to what the spec says is no override and is removed.
Pure functions; the reconciler and the autopilot loop do the I/O.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import ValidationError

from splitserve.api.patch import merge_patch
from splitserve.api.spec import InferenceDeploymentSpec
from splitserve.validation import validate_object

# Where each kind of change lands in the spec (merge patches only ever touch these paths).
# The ratio is the prefill pool's size, or the autoscaler's bounds when an autoscaler owns the sizes.
OVERRIDE_PATHS: dict[str, tuple[tuple[str, ...], ...]] = {
    "mode": (("mode",),),
    "speculativeDecoding": (("engine", "speculativeDecoding"),),
    "ratio": (("prefill", "replicas"), ("autoscaling", "prefillDecodeRatio")),
}


def merge_patch_between(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The merge patch that turns `old` into `new` (null for removed keys): lets a status write drop keys."""
    patch: dict[str, Any] = {key: None for key in old if key not in new}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            nested = merge_patch_between(before, value)
            if nested:
                patch[key] = nested
        elif key not in old or before != value:
            patch[key] = copy.deepcopy(value)
    return patch


def _without_path(tree: Mapping[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    result = dict(tree)
    head, rest = path[0], path[1:]
    if head not in result:
        return result
    if not rest:
        del result[head]
        return result
    child = result[head]
    if isinstance(child, Mapping):
        pruned = _without_path(child, rest)
        if pruned:
            result[head] = pruned
        else:
            del result[head]
    return result


def without_vetoed(overrides: Mapping[str, Any], veto: Iterable[str]) -> dict[str, Any]:
    """Overrides minus the paths of every vetoed kind."""
    result = dict(overrides)
    for kind in veto:
        for path in OVERRIDE_PATHS.get(kind, ()):
            result = _without_path(result, path)
    return result


def minimal(overrides: Mapping[str, Any], spec: Mapping[str, Any]) -> dict[str, Any]:
    """Overrides minus the leaves that equal the spec's own value (and the objects left empty).

    `spec` should be the spec with its defaults filled in, so an override back to a default is dropped too.
    """
    result: dict[str, Any] = {}
    for key, value in overrides.items():
        declared = spec.get(key) if isinstance(spec, Mapping) else None
        if isinstance(value, Mapping):
            nested = minimal(value, declared if isinstance(declared, Mapping) else {})
            if nested:
                result[key] = nested
        elif value is not None and value != declared:
            result[key] = copy.deepcopy(value)
    return result


def in_effect(
    overrides: Mapping[str, Any], spec: Mapping[str, Any], *, dynamic: bool, veto: Iterable[str]
) -> dict[str, Any]:
    """The overrides that apply now: none when dynamic is off, none of a vetoed kind, none equal to the spec."""
    if not dynamic:
        return {}
    return minimal(without_vetoed(overrides, veto), spec)


def effective_spec_dict(
    spec: Mapping[str, Any], overrides: Mapping[str, Any], *, dynamic: bool, veto: Iterable[str]
) -> dict[str, Any]:
    """The spec to render: `spec` deep-merged with the overrides in effect."""
    result: dict[str, Any] = merge_patch(spec, in_effect(overrides, spec, dynamic=dynamic, veto=veto))
    return result


def declared(spec: InferenceDeploymentSpec) -> dict[str, Any]:
    """The spec as JSON with every default filled in (what overrides are compared against)."""
    dumped: dict[str, Any] = spec.model_dump(by_alias=True, mode="json", exclude_none=True)
    return dumped


def active_overrides(spec: InferenceDeploymentSpec, overrides: Mapping[str, Any]) -> dict[str, Any]:
    optimization = spec.optimization
    return in_effect(overrides, declared(spec), dynamic=optimization.dynamic, veto=optimization.veto)


def effective_spec(spec: InferenceDeploymentSpec, overrides: Mapping[str, Any]) -> InferenceDeploymentSpec:
    """The spec with the overrides in effect merged in (pydantic's ValidationError if that is invalid)."""
    active = active_overrides(spec, overrides)
    if not active:
        return spec
    return InferenceDeploymentSpec.model_validate(merge_patch(declared(spec), active))


def served_spec(spec: InferenceDeploymentSpec, overrides: Mapping[str, Any]) -> InferenceDeploymentSpec:
    """What the periodic loops act on: the effective spec, or the spec as written when the overrides
    do not make a valid one (the reconciler then serves the written spec and says why)."""
    try:
        return effective_spec(spec, overrides)
    except ValidationError:
        return spec


def servable(body: Mapping[str, Any], spec: InferenceDeploymentSpec, overrides: Mapping[str, Any]) -> str:
    """'' when `spec` with these overrides is one the operator can serve, else why not (one line).

    The one check both writers of overrides ask: the autopilot before it records a change, and the
    reconciler before it renders one (an override valid yesterday may not be after a spec edit).
    """
    try:
        candidate = effective_spec(spec, overrides)
    except ValidationError as error:
        return str(error)
    return "; ".join(f"{p.path}: {p.message}" for p in validate_object({**body, "spec": declared(candidate)}))
