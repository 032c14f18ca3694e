"""`splitserve validate -f FILE`: check InferenceDeployments offline, print every problem.

Errors (what a cluster would reject) exit 1; warnings (accepted, but likely not what was meant,
see advice.py) are printed as `WARNING` lines and do not change the exit code.
"""

from __future__ import annotations

import argparse
import sys

from splitserve.commands.common import UserError, read_input
from splitserve.validation.advice import text_advice
from splitserve.validation.checker import validate_text


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-f", "--filename", action="append", required=True, help="YAML file ('-' for stdin); repeatable"
    )


def run(args: argparse.Namespace) -> int:
    failed = False
    for filename in args.filename:
        try:
            text = read_input(filename)
        except UserError as error:
            print(error, file=sys.stderr)
            failed = True
            continue
        problems = validate_text(text)
        for problem in problems:
            print(f"{filename}: {problem}", file=sys.stderr)
        for warning in text_advice(text):
            print(f"{filename}: WARNING: {warning}", file=sys.stderr)
        if problems:
            failed = True
        else:
            print(f"{filename}: valid")
    return 1 if failed else 0
