"""The docs are executed: every documented command for a local stack runs against `splitserve up --engine sim`.

Scanned: README.md, deploy/local/README.md and every docs/*.md (so a quickstart section added to any of
them is covered). A fenced sh/bash/shell/console or python block is run when it addresses the stack's
default endpoint, 127.0.0.1 or localhost on `up`'s default router port; `docblocks.exclusion` says why
the others are not (cluster tooling, blocks that start a stack themselves). One stack, on the quickstart
file, serves the whole module on a free port; each block is rewritten to that port, so the test runs
beside anything else on the machine. Shell blocks run under `set -euo pipefail` with `curl
--fail-with-body`; any block fails on a non-zero exit or an OpenAI error object in its output.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from testkit.upctl import ENDPOINT_LINE, REPO, start_up
from tests.local.docblocks import (
    Block,
    add_curl_fail_flag,
    console_commands,
    error_objects,
    exclusion,
    fenced_blocks,
    rewrite_port,
)

README = REPO / "README.md"
LOCAL_README = REPO / "deploy/local/README.md"
DOCUMENTS = (README, LOCAL_README, *sorted((REPO / "docs").glob("*.md")))
# The file the README's quickstart (scripts/quickstart.sh) serves.
QUICKSTART_FILE = REPO / "deploy/local/tiny-disaggregated.yaml"
BLOCK_TIMEOUT_SECONDS = 60

ALL_BLOCKS = [block for document in DOCUMENTS for block in fenced_blocks(document)]
RUN_BLOCKS = [block for block in ALL_BLOCKS if exclusion(block) is None]


@dataclass(frozen=True)
class Stack:
    endpoint: str
    port: int


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    run_dir = tmp_path_factory.mktemp("docs-stack")
    # --port 0: `up` picks a free port with the project's allocator and prints it.
    up = start_up("--engine", "sim", "-f", str(QUICKSTART_FILE), "--port", "0", run_dir=run_dir)
    try:
        match = up.wait_for_line(ENDPOINT_LINE, seconds=60)
        yield Stack(endpoint=match.group(1), port=int(match.group(2)))
    finally:
        up.stop()


def _environment() -> dict[str, str]:
    """The block's environment: this venv's `python`/`splitserve` first, no OpenAI settings leaking in."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("OPENAI_")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    return env


def as_run(block: Block, port: int) -> tuple[list[str], str]:
    """The command line that runs a block against the stack on `port`, and the code it runs."""
    if block.is_python:
        code = rewrite_port(block.text, port)
        return [sys.executable, "-c", code], code
    commands = console_commands(block.text) if block.language == "console" else block.text
    script = "set -euo pipefail\n" + add_curl_fail_flag(rewrite_port(commands, port))
    return ["bash", "-c", script], script


def failure(block: Block, port: int) -> str | None:
    """What went wrong running a block against the stack on `port`; None when it ran and got no error."""
    argv, code = as_run(block, port)
    try:
        done = subprocess.run(
            argv, cwd=REPO, env=_environment(), capture_output=True, text=True, timeout=BLOCK_TIMEOUT_SECONDS
        )
        problems = [f"exit code {done.returncode}"] if done.returncode != 0 else []
        stdout, stderr = done.stdout, done.stderr
    except subprocess.TimeoutExpired as expired:
        problems = [f"still running after {BLOCK_TIMEOUT_SECONDS} s"]
        stdout, stderr = str(expired.stdout or ""), str(expired.stderr or "")
    problems += [f"error answer {error!r}" for error in error_objects(stdout + "\n" + stderr)]
    if not problems:
        return None
    return (
        f"{block.where(REPO)}: the documented {block.language} block failed against `splitserve up --engine sim "
        f"-f {QUICKSTART_FILE.relative_to(REPO)}` (port {port}): {'; '.join(problems)}\n"
        f"--- block as documented (line {block.line}) ---\n{block.text}"
        f"--- as run ---\n{code}\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}"
    )


@pytest.mark.slow
@pytest.mark.parametrize("block", RUN_BLOCKS, ids=[f"{b.path.relative_to(REPO)}:{b.line}" for b in RUN_BLOCKS])
def test_documented_block_runs_against_the_local_stack(block: Block, stack: Stack) -> None:
    problem = failure(block, stack.port)
    if problem is not None:
        pytest.fail(problem, pytrace=False)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("language", "text"),
    [
        (
            "sh",
            "curl -s http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\\n"
            '  -d \'{"model": "tiny", "prompt": "Hello", "max_tokens": 16}\'\n',
        ),
        (
            "python",
            "from openai import OpenAI\n"
            'client = OpenAI(base_url="http://localhost:8000/v1", api_key="unused", max_retries=0)\n'
            'client.completions.create(model="tiny", prompt="Hello", max_tokens=4)\n',
        ),
    ],
)
def test_a_block_with_a_wrong_model_name_fails(language: str, text: str, stack: Stack) -> None:
    """The check itself: the README's old `"model": "tiny"` example must be reported, not pass."""
    block = Block(path=README, line=1, language=language, section="example", text=text)
    assert exclusion(block) is None
    problem = failure(block, stack.port)
    assert problem is not None and "README.md:1" in problem and "The model `tiny` does not exist" in problem


def test_the_documented_local_commands_are_found() -> None:
    assert RUN_BLOCKS, "no documented block talks to a local stack: the test would pass without running anything"
    quickstart = [block for block in RUN_BLOCKS if block.path == README and block.section.startswith("Quickstart")]
    assert any(b.is_shell and "curl" in b.text and "/v1/completions" in b.text for b in quickstart)
    assert any(b.is_shell and "curl" in b.text and "/v1/chat/completions" in b.text for b in quickstart)
    assert any(b.is_python and "OpenAI(" in b.text for b in quickstart)
    assert any(b.path == LOCAL_README and "/v1/models" in b.text for b in RUN_BLOCKS)


def test_cluster_and_stack_starting_blocks_are_excluded_by_rule() -> None:
    port_forward = [block for block in ALL_BLOCKS if "kubectl port-forward" in block.text]
    assert port_forward and all("kubectl" in str(exclusion(block)) for block in port_forward)
    quickstart = [block for block in ALL_BLOCKS if block.path == README and "./scripts/quickstart.sh" in block.text]
    assert quickstart and all(exclusion(block) is not None for block in quickstart)
    starts = Block(README, 1, "sh", "", "splitserve up -f deploy/local/tiny-aggregated.yaml &\ncurl localhost:8000\n")
    assert "starts a stack" in str(exclusion(starts))


def test_the_quickstart_script_serves_the_file_the_test_uses() -> None:
    script = (REPO / "scripts/quickstart.sh").read_text()
    assert f"-f {QUICKSTART_FILE.relative_to(REPO)}" in script


def test_fenced_blocks_follow_commonmark_fences(tmp_path: Path) -> None:
    document = tmp_path / "doc.md"
    document.write_text(
        "# Title\n\n## Local\n\n```sh\ncurl -s localhost:8000/v1/models\n```\n\n"
        "  ~~~~ console\n  $ curl -s \\\n      127.0.0.1:8000/v1/models\n  {}\n  ~~~~\n\n"
        "````markdown\n```sh\n# not a heading\n```\n````\n\n## Other\n\n```\nplain\n```\n"
    )
    blocks = list(fenced_blocks(document))
    assert [(b.line, b.language, b.section) for b in blocks] == [
        (5, "sh", "Local"),
        (9, "console", "Local"),
        (15, "markdown", "Local"),
        (23, "", "Other"),
    ]
    assert blocks[1].text.startswith("$ curl -s \\\n    127.0.0.1")
    assert blocks[2].text == "```sh\n# not a heading\n```\n"
    assert [exclusion(b) is None for b in blocks] == [True, True, False, False]


def test_rewriting_and_error_detection() -> None:
    assert rewrite_port("curl localhost:8000/v1 http://127.0.0.1:8000/v1 :80001 10.127.0.0.1:8000", 21234) == (
        "curl localhost:21234/v1 http://127.0.0.1:21234/v1 :80001 10.127.0.0.1:8000"
    )
    assert add_curl_fail_flag("curl -s URL \\\n  -d x\ncurl -sf URL\nx=$(curl --fail URL)\n") == (
        "curl --fail-with-body -s URL \\\n  -d x\ncurl -sf URL\nx=$(curl --fail URL)\n"
    )
    assert console_commands("$ curl -s \\\n  URL\n{}\n$ echo\nout\n") == "curl -s \\\n  URL\necho\n"
    output = 'text {"choices": []}{"error": {"code": "model_not_found"}}\ndata: {"error": "x"}\n{broken'
    assert error_objects(output) == [{"code": "model_not_found"}, "x"]
