"""Fenced code blocks of the project's Markdown, and which of them talk to a local `splitserve up` stack.

A small CommonMark-style fence reader (``` or ~~~, three or more, up to three spaces of indentation,
closed by the same character at least as many times), so the tests need no Markdown library.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from splitserve.local.cli import DEFAULT_ROUTER_PORT

SHELL_LANGUAGES = frozenset({"sh", "bash", "shell", "console"})
PYTHON_LANGUAGES = frozenset({"python", "py", "python3"})

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(?P<title>.*?)\s*#*\s*$")
# The address `splitserve up` serves on by default, as the docs write it.
LOCAL_ENDPOINT = re.compile(rf"(?<![\w.-])(?P<host>127\.0\.0\.1|localhost):{DEFAULT_ROUTER_PORT}(?!\d)")
# A block that runs these reaches a cluster (e.g. `kubectl port-forward` to a router Service), not `up`.
CLUSTER_TOOL = re.compile(r"(?<![\w./-])(kubectl|helm)(?![\w.-])")
# A block that starts a stack itself: long-running, and the test starts the stack.
STARTS_A_STACK = re.compile(r"(?<![\w-])splitserve\s+up(?![\w-])|scripts/quickstart\.sh")
_CURL = re.compile(r"(?<![\w./-])curl(?=[ \t])")
_CURL_FAIL_FLAG = re.compile(r"(?<!\S)(--fail(-with-body)?|-[A-Za-z]*f[A-Za-z]*)(?!\S)")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    section: str  # the nearest heading above, "" before the first
    text: str

    def where(self, root: Path) -> str:
        section = f" (section {self.section!r})" if self.section else ""
        return f"{self.path.relative_to(root)}:{self.line}{section}"

    @property
    def is_shell(self) -> bool:
        return self.language in SHELL_LANGUAGES

    @property
    def is_python(self) -> bool:
        return self.language in PYTHON_LANGUAGES


def fenced_blocks(path: Path) -> Iterator[Block]:
    """Every fenced code block of a Markdown file, with the heading it sits under."""
    lines = path.read_text(encoding="utf-8").splitlines()
    section = ""
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if opening is None or (opening["fence"][0] == "`" and "`" in opening["info"]):
            heading = _HEADING.match(lines[index])
            if heading:
                section = heading["title"]
            index += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        closing = re.compile(rf"^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        body: list[str] = []
        end = index + 1
        while end < len(lines) and not closing.match(lines[end]):
            line = lines[end]
            strip = min(indent, len(line) - len(line.lstrip(" ")))
            body.append(line[strip:])
            end += 1
        info = opening["info"].strip()
        language = info.split()[0].lower() if info else ""
        yield Block(path=path, line=index + 1, language=language, section=section, text="\n".join(body) + "\n")
        index = end + 1


def exclusion(block: Block) -> str | None:
    """Why a block is not run against the local stack; None for a block that is."""
    if not (block.is_shell or block.is_python):
        return f"not a shell or Python block ({block.language or 'no language'})"
    if not LOCAL_ENDPOINT.search(block.text):
        return f"does not address the local stack (127.0.0.1/localhost:{DEFAULT_ROUTER_PORT})"
    if CLUSTER_TOOL.search(block.text):
        return "uses kubectl/helm: its localhost port is a cluster's router, not `splitserve up`"
    if STARTS_A_STACK.search(block.text):
        return "starts a stack itself (long-running); the test provides the stack"
    return None


def console_commands(text: str) -> str:
    """The commands of a `console` block: `$ ` lines and their backslash continuations, not the output."""
    commands: list[str] = []
    continuing = False
    for line in text.splitlines():
        if continuing or line.startswith("$ "):
            commands.append(line if continuing else line[2:])
            continuing = line.endswith("\\")
    return "\n".join(commands) + "\n"


def rewrite_port(text: str, port: int) -> str:
    """The block with the documented local endpoint moved to the port the test's stack listens on."""
    return LOCAL_ENDPOINT.sub(lambda match: f"{match['host']}:{port}", text)


def _logical_line_end(text: str, start: int) -> int:
    """Where the shell command line that contains `start` ends (backslash-newline continues it)."""
    position = start
    while True:
        newline = text.find("\n", position)
        if newline == -1:
            return len(text)
        if newline == 0 or text[newline - 1] != "\\":
            return newline
        position = newline + 1


def add_curl_fail_flag(script: str) -> str:
    """`curl --fail-with-body` for each curl command that has no --fail/-f of its own: HTTP errors exit 22."""
    pieces: list[str] = []
    done = 0
    for match in _CURL.finditer(script):
        rest = script[match.end() : _logical_line_end(script, match.end())]
        if _CURL_FAIL_FLAG.search(rest):
            continue
        pieces += [script[done : match.end()], " --fail-with-body"]
        done = match.end()
    pieces.append(script[done:])
    return "".join(pieces)


def error_objects(output: str) -> list[object]:
    """The OpenAI-style error objects (a JSON object with an "error" key) anywhere in a command's output."""
    decoder = json.JSONDecoder()
    errors: list[object] = []
    position = output.find("{")
    while position != -1:
        try:
            value, end = decoder.raw_decode(output, position)
        except json.JSONDecodeError:
            position = output.find("{", position + 1)
            continue
        if isinstance(value, dict) and "error" in value:
            errors.append(value["error"])
        position = output.find("{", end)
    return errors
