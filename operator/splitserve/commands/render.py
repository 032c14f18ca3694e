"""`splitserve render -f FILE [--from OLD_FILE]`: every manifest the operator would apply, as
multi-document YAML.

With `--from OLD_FILE` (the spec the cluster runs now), FILE is rendered in mid-rollout: when the
two specs are of different KV generations (api/generation.py), the new generation's objects plus
the old generation's worker Deployments as OLD_FILE builds them, without the KEDA/HPA autoscalers
the operator withholds while a rollout runs. A YAML comment header says which generation is which
and which fields changed. Deployments are matched by name; one that OLD_FILE lacks renders alone.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import yaml

from splitserve.api.generation import generation_changes, generation_inputs
from splitserve.builders.autoscalers import is_autoscaler
from splitserve.builders.bundle import build_children, build_rollout_children, build_worker_deployments
from splitserve.builders.target import Images, Target
from splitserve.commands.common import UserError
from splitserve.commands.deployments import LoadedDeployment, load_deployments


class _PlainDumper(yaml.SafeDumper):
    """No `&id001` anchors: rendered manifests are read and diffed by people."""

    def ignore_aliases(self, data: object) -> bool:
        return True


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--filename", required=True, help="InferenceDeployment YAML ('-' for stdin)")
    parser.add_argument("-n", "--namespace", default=None, help="namespace when the file does not set one")
    parser.add_argument(
        "--from",
        dest="from_filename",
        default=None,
        metavar="OLD_FILE",
        help="the spec running now: render FILE in mid-rollout from it (both generations' worker Deployments)",
    )


def _names(deployments: list[dict[str, Any]]) -> str:
    return ", ".join(deployment["metadata"]["name"] for deployment in deployments)


def _rollout_header(new: Target, old: Target, new_file: str, old_file: str) -> list[str]:
    """What the comment header says about one deployment: generations, what changed, what is withheld."""
    where = f"{new.owner.namespace}/{new.owner.name}"
    if new.generation == old.generation:
        return [
            f"{where}: same KV generation {new.generation} in {old_file} and {new_file}: no new pools, "
            "any pod change rolls within the generation; one set rendered"
        ]
    changes = generation_changes(
        generation_inputs(old.spec, old.images.worker), generation_inputs(new.spec, new.images.worker)
    )
    withheld = [child for child in build_children(new) if is_autoscaler(child)]
    lines = [
        f"{where}: in mid-rollout from {old_file} to {new_file} (make-before-break)",
        f"  new generation {new.generation} ({new_file}): {_names(build_worker_deployments(new))}",
        f"  old generation {old.generation} ({old_file}): {_names(build_worker_deployments(old))}"
        " - drain once the new pools serve, then deleted",
        "  generation fields changed:",
        *(f"    {change}" for change in changes),
        "  worker sizes are set by the operator through /scale during the rollout (not rendered)",
    ]
    if withheld:
        kinds = ", ".join(f"{child['kind']} {child['metadata']['name']}" for child in withheld)
        lines.append(f"  withheld until the rollout completes (then aimed at the new generation): {kinds}")
    return lines


def _render(
    deployments: list[LoadedDeployment], old: dict[str, LoadedDeployment] | None, args: argparse.Namespace
) -> tuple[list[str], list[dict[str, Any]]]:
    images = Images.from_environment()
    header: list[str] = []
    manifests: list[dict[str, Any]] = []
    for deployment in deployments:
        target = Target(deployment.owner, deployment.spec, images)
        if old is None:
            manifests.extend(build_children(target))
            continue
        previous = old.get(deployment.owner.name)
        if previous is None:
            header.append(f"{deployment.owner.namespace}/{deployment.owner.name}: not in {args.from_filename}")
            manifests.extend(build_children(target))
            continue
        # The old spec's objects as the operator built them for this same deployment.
        old_target = Target(deployment.owner, previous.spec, images)
        header.extend(_rollout_header(target, old_target, args.filename, args.from_filename))
        manifests.extend(build_rollout_children(target, [old_target]))
    return header, manifests


def run(args: argparse.Namespace) -> int:
    try:
        deployments = load_deployments(args.filename, args.namespace)
        old = None
        if args.from_filename is not None:
            old = {loaded.owner.name: loaded for loaded in load_deployments(args.from_filename, args.namespace)}
    except UserError as error:
        print(error, file=sys.stderr)
        return 1
    header, manifests = _render(deployments, old, args)
    # A comment header: the output still applies and parses as the same YAML.
    sys.stdout.write("".join(f"# {line}\n" for line in header))
    sys.stdout.write(yaml.dump_all(manifests, Dumper=_PlainDumper, sort_keys=False, width=120))
    return 0
