"""`splitserve diff OLD NEW`: whether changing an InferenceDeployment from OLD to NEW starts a new KV
generation, offline.

A change of a generation field (api/generation.py: model revision, dtype, KV-cache dtype, engine
image, TP layout, connector ...) starts a make-before-break rollout: new prefill and decode pools
come up beside the old ones, and the old drain and are deleted once the new serve. Any other change
rolls pods within the generation, as a Deployment's rolling update does, or rolls none at all.

Exit code 0 either way (2 for unreadable or invalid files); with `--exit-code`, 1 when a new
generation starts, for a CI step that wants a person to look at such a change.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from splitserve.api.generation import generation_changes, generation_inputs
from splitserve.api.spec import InferenceDeploymentSpec
from splitserve.api.topology import LABEL_ROLE, adapters_config_map_name
from splitserve.builders.bundle import build_children
from splitserve.builders.target import Images, Target
from splitserve.commands.common import UserError
from splitserve.commands.deployments import load_one_deployment

EXIT_NEW_GENERATION = 1
EXIT_TROUBLE = 2


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("old", metavar="OLD", help="InferenceDeployment YAML as it is now ('-' for stdin)")
    parser.add_argument("new", metavar="NEW", help="InferenceDeployment YAML as it would be")
    parser.add_argument(
        "--worker-image",
        default=Images.from_environment().worker,
        help="the operator's worker image, which the generation hashes when engine.image is unset "
        "(default: $SPLITSERVE_WORKER_IMAGE or the operator's default, %(default)s)",
    )
    parser.add_argument("--exit-code", action="store_true", help="exit 1 when the change starts a new generation (CI)")


@dataclass(frozen=True)
class SpecDiff:
    """What changes between two specs of one deployment."""

    old_generation: str
    new_generation: str
    generation_changes: list[str]  # `path: old -> new` of each generation input that differs
    other_changes: list[str]  # the same for every other spec field
    rolled: list[str]  # roles whose pods roll within the generation (router included)

    @property
    def new_generation_starts(self) -> bool:
        return self.old_generation != self.new_generation


def _leaves(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path, value) of every leaf of a spec dump; a list is one leaf (extraArgs, env ...)."""
    if isinstance(value, dict) and value:
        for key, item in value.items():
            yield from _leaves(item, f"{path}.{key}" if path else key)
    else:
        yield path, value


def _show(value: Any) -> str:
    if value is None:
        return "(unset)"
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, separators=(",", ":"))
    return text if len(text) <= 80 else text[:77] + "..."


def _governing_input(path: str, inputs: dict[str, Any]) -> str | None:
    """The generation input a spec path is part of (`model.source.huggingFace.revision` -> `model.source`)."""
    return next((key for key in inputs if path == key or path.startswith(key + ".")), None)


def _other_changes(
    old: InferenceDeploymentSpec, new: InferenceDeploymentSpec, old_inputs: dict[str, Any], new_inputs: dict[str, Any]
) -> list[str]:
    """Changed spec paths the generation does not account for: outside its inputs, or inside one whose
    hashed value stayed equal (a non-KV extraArgs flag, the HF token Secret)."""
    before = dict(_leaves(old.model_dump(by_alias=True, mode="json")))
    after = dict(_leaves(new.model_dump(by_alias=True, mode="json")))
    changes = []
    for path in [*after, *(path for path in before if path not in after)]:
        if before.get(path) == after.get(path):
            continue
        governing = _governing_input(path, new_inputs)
        if governing is not None and old_inputs.get(governing) != new_inputs.get(governing):
            continue  # listed with the generation's changes
        if path == "adapters":  # by name: a list of sources reads badly on one line
            old_names, new_names = (", ".join(a.name for a in spec.adapters) or "(none)" for spec in (old, new))
            if old_names != new_names:
                changes.append(f"adapters: {old_names} -> {new_names}")
            else:
                changes.append(f"adapters: {new_names} (their sources changed)")
            continue
        changes.append(f"{path}: {_show(before.get(path))} -> {_show(after.get(path))}")
    return changes


def _templates(target: Target) -> dict[str, Any]:
    return {
        child["metadata"]["labels"][LABEL_ROLE]: child["spec"]["template"]
        for child in build_children(target)
        if child["kind"] == "Deployment"
    }


def spec_diff(old: Target, new: Target) -> SpecDiff:
    old_inputs = generation_inputs(old.spec, old.images.worker)
    new_inputs = generation_inputs(new.spec, new.images.worker)
    if old.generation == new.generation:
        # Within a generation the Deployments stay; a role's pods roll when its template changes.
        before, after = _templates(old), _templates(new)
        rolled = [role for role in after if role in before and before[role] != after[role]]
    else:
        rolled = ["router"] if _templates(old)["router"] != _templates(new)["router"] else []
    return SpecDiff(
        old_generation=old.generation,
        new_generation=new.generation,
        generation_changes=generation_changes(old_inputs, new_inputs),
        other_changes=_other_changes(old.spec, new.spec, old_inputs, new_inputs),
        rolled=rolled,
    )


def _verdict(diff: SpecDiff, old: Target, new: Target) -> str:
    if diff.new_generation_starts:
        return (
            "starts a new generation: make-before-break rollout (new pools beside the old ones; the router "
            "shifts traffic as new pairs become ready, then the old pools drain and are deleted)"
        )
    if old.spec.mode != new.spec.mode:
        return (
            f"same generation, mode switch {old.spec.mode} -> {new.spec.mode}: the new mode's pools come up "
            "beside the old ones, which are deleted once the new serve"
        )
    if diff.rolled:
        return "same generation: pods roll within it (a Deployment rolling update, no new pools)"
    if diff.other_changes:
        return "same generation: no pod rolls (only sizes or settings outside the pod templates change)"
    return "no change"


def render_report(diff: SpecDiff, old: Target, new: Target, old_file: str, new_file: str) -> str:
    lines = [
        f"old generation {diff.old_generation} ({old_file})",
        f"new generation {diff.new_generation} ({new_file})",
        _verdict(diff, old, new),
    ]
    if old.owner != new.owner:
        lines.append(
            f"note: {old_file} is {old.owner.namespace}/{old.owner.name}, {new_file} is "
            f"{new.owner.namespace}/{new.owner.name}: compared as one deployment"
        )
    lines.append("generation fields changed:" if diff.generation_changes else "generation fields changed: none")
    lines += [f"  {change}" for change in diff.generation_changes]
    lines.append("other changes:" if diff.other_changes else "other changes: none")
    lines += [f"  {change}" for change in diff.other_changes]
    if diff.rolled:
        lines.append(f"pods that roll: {', '.join(diff.rolled)}")
    if old.spec.adapters != new.spec.adapters and new.spec.adapters:
        lines.append(
            f"adapters: the workers load and unload them at run time from ConfigMap "
            f"{adapters_config_map_name(new.owner.name)} (docs/lora.md)"
        )
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    try:
        old_deployment = load_one_deployment(args.old)
        new_deployment = load_one_deployment(args.new)
    except UserError as error:
        print(error, file=sys.stderr)
        return EXIT_TROUBLE
    images = Images(worker=args.worker_image)
    # One owner for both: names and namespaces flow into the router's flags, not a change of the spec.
    old = Target(new_deployment.owner, old_deployment.spec, images)
    new = Target(new_deployment.owner, new_deployment.spec, images)
    diff = spec_diff(old, new)
    report_old = Target(old_deployment.owner, old_deployment.spec, images)
    sys.stdout.write(render_report(diff, report_old, new, args.old, args.new))
    if args.exit_code and diff.new_generation_starts:
        return EXIT_NEW_GENERATION
    return 0
