"""`splitserve crd`: print the generated CustomResourceDefinition."""

from __future__ import annotations

import argparse
import sys

from splitserve.api.crd import render_crd_yaml


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", default="-", help="file to write (default: stdout)")


def run(args: argparse.Namespace) -> int:
    text = render_crd_yaml()
    if args.output == "-":
        sys.stdout.write(text)
    else:
        with open(args.output, "w", encoding="utf-8") as handle:
            handle.write(text)
    return 0
