"""Small helpers shared by the subcommands."""

from __future__ import annotations

import sys
from pathlib import Path


class UserError(Exception):
    """A mistake in what the user gave us: printed as one line, exit code 1, no traceback."""


def read_input(filename: str) -> str:
    """The text of FILE, or of stdin for '-'."""
    if filename == "-":
        return sys.stdin.read()
    try:
        return Path(filename).read_text(encoding="utf-8")
    except OSError as error:
        raise UserError(f"{filename}: cannot read: {error.strerror}") from error
