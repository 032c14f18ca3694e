"""`splitserve render -f FILE`: every manifest the operator would apply, as multi-document YAML."""

from __future__ import annotations

import argparse
import sys

import yaml

from splitserve.api.spec import InferenceDeploymentSpec
from splitserve.api.topology import Owner
from splitserve.builders.bundle import build_children
from splitserve.builders.target import Images, Target
from splitserve.commands.common import UserError, read_input
from splitserve.validation import load_documents, validate_text


class _PlainDumper(yaml.SafeDumper):
    """No `&id001` anchors: rendered manifests are read and diffed by people."""

    def ignore_aliases(self, data: object) -> bool:
        return True


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--filename", required=True, help="InferenceDeployment YAML ('-' for stdin)")
    parser.add_argument("-n", "--namespace", default=None, help="namespace when the file does not set one")


def run(args: argparse.Namespace) -> int:
    try:
        text = read_input(args.filename)
    except UserError as error:
        print(error, file=sys.stderr)
        return 1
    problems = validate_text(text)
    if problems:
        for problem in problems:
            print(f"{args.filename}: {problem}", file=sys.stderr)
        return 1
    manifests = []
    for doc in load_documents(text):
        namespace = doc["metadata"].get("namespace") or args.namespace or "default"
        spec = InferenceDeploymentSpec.model_validate(doc["spec"])
        target = Target(Owner(doc["metadata"]["name"], namespace), spec, Images.from_environment())
        manifests.extend(build_children(target))
    sys.stdout.write(yaml.dump_all(manifests, Dumper=_PlainDumper, sort_keys=False, width=120))
    return 0
