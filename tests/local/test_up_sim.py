"""`splitserve up --engine sim` end to end, as a user runs it: a subprocess, real simulators and router."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import openai
import pytest

from splitserve.local.ports import is_port_free
from splitserve.local.procs import is_alive
from testkit.upctl import ENDPOINT_LINE, REPO, start_up
from tests.local.serving import RESTART_LINE, kill_and_see_it_back, serving, wait_router_takes

# Each test starts three Python processes; on a shared 2-core machine that takes seconds.
pytestmark = pytest.mark.slow

DISAGGREGATED = str(REPO / "deploy/local/tiny-disaggregated.yaml")
AGGREGATED = str(REPO / "deploy/local/tiny-aggregated.yaml")


def _wait_gone(pids: set[int], seconds: float) -> set[int]:
    deadline = time.monotonic() + seconds
    alive = {pid for pid in pids if is_alive(pid)}
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = {pid for pid in alive if is_alive(pid)}
    return alive


@pytest.mark.parametrize(
    ("file", "workers", "stop_signal"),
    [
        (DISAGGREGATED, {"prefill-0", "decode-0"}, signal.SIGTERM),
        (AGGREGATED, {"worker-0"}, signal.SIGINT),  # Ctrl-C
    ],
)
def test_up_serves_through_the_router_and_stops_cleanly_on_a_signal(
    file: str, workers: set[str], stop_signal: signal.Signals, tmp_path: Path
) -> None:
    up = start_up("--engine", "sim", "-f", file, "--port", "0", run_dir=tmp_path)
    try:
        endpoint = up.wait_for_line(ENDPOINT_LINE, seconds=60).group(1)
        state = up.process_state()
        assert {entry["name"] for entry in state} == {*workers, "router"}
        children = up.children()
        assert {int(str(entry["pid"])) for entry in state} <= children
        ports = [int(str(entry["port"])) for entry in state]

        client = openai.OpenAI(base_url=endpoint, api_key="unused", max_retries=0, timeout=30)
        completion = client.completions.create(model="tiny-llama", prompt="Hello, my name is", max_tokens=8)
        assert completion.choices[0].text.strip(), "the stack should generate text"
        assert completion.usage is not None and completion.usage.completion_tokens == 8

        up.popen.send_signal(stop_signal)
        assert up.popen.wait(timeout=30) == 0
    finally:
        if up.popen.poll() is None:
            up.popen.kill()
    assert _wait_gone(children, 5) == set(), "every process `up` started must be gone"
    assert all(is_port_free(port) for port in ports)
    up.wait_for_line(re.compile(r"stopped 3 processes|stopped 2 processes"), seconds=5)


def test_smoke_sends_one_request_and_exits(tmp_path: Path) -> None:
    up = start_up("--engine", "sim", "-f", DISAGGREGATED, "--port", "0", "--smoke", run_dir=tmp_path)
    assert up.popen.wait(timeout=60) == 0, up.stderr()
    up.wait_for_line(re.compile(r"^answer: '.+'$"), seconds=5)
    assert _wait_gone(up.children() | {int(str(e["pid"])) for e in up.process_state()}, 5) == set()


def test_a_worker_and_the_router_killed_while_serving_are_restarted(tmp_path: Path) -> None:
    with serving("--engine", "sim", "-f", DISAGGREGATED, "--port", "0", run_dir=tmp_path) as up:
        endpoint = up.wait_for_line(ENDPOINT_LINE, seconds=60).group(1)
        decode_url = next(str(entry["url"]) for entry in up.process_state() if entry["name"] == "decode-0")
        client = openai.OpenAI(base_url=endpoint, api_key="unused", max_retries=0, timeout=30)
        for name in ("decode-0", "router"):
            kill_and_see_it_back(up, name)
            wait_router_takes(endpoint.removesuffix("/v1"), decode_url)
            completion = client.completions.create(model="tiny-llama", prompt="Hello, my name is", max_tokens=8)
            assert completion.usage is not None and completion.usage.completion_tokens == 8
        assert up.popen.poll() is None, "`up` serves on"
    assert sum(bool(RESTART_LINE.search(line)) for line in up.lines) == 2, "no restart while stopping"


def test_exit_after_stops_by_itself(tmp_path: Path) -> None:
    up = start_up("--engine", "sim", "-f", AGGREGATED, "--port", "0", "--exit-after", "0.5", run_dir=tmp_path)
    assert up.popen.wait(timeout=60) == 0, up.stderr()
    up.wait_for_line(re.compile(r"time limit: stopping"), seconds=5)


def test_children_do_not_outlive_up_killed_outright(tmp_path: Path) -> None:
    up = start_up("--engine", "sim", "-f", AGGREGATED, "--port", "0", run_dir=tmp_path)
    try:
        up.wait_for_line(ENDPOINT_LINE, seconds=60)
        children = up.children()
        assert len(children) >= 2
        up.popen.kill()  # SIGKILL: no handler runs, only the kernel's parent-death signal
        up.popen.wait(timeout=10)
    finally:
        if up.popen.poll() is None:
            up.popen.kill()
    assert _wait_gone(children, 30) == set()


def test_verbose_prints_one_line_per_request(tmp_path: Path) -> None:
    up = start_up("--engine", "sim", "-f", DISAGGREGATED, "--port", "0", "--verbose", run_dir=tmp_path)
    try:
        endpoint = up.wait_for_line(ENDPOINT_LINE, seconds=60).group(1)
        client = openai.OpenAI(base_url=endpoint, api_key="unused", max_retries=0, timeout=30)
        client.completions.create(model="tiny-llama", prompt="Hello, my name is", max_tokens=8)
        line = up.wait_for_line(re.compile(r"request \w+ \|.*"), seconds=15).group(0)
    finally:
        up.popen.send_signal(signal.SIGTERM)
        up.popen.wait(timeout=30)
    assert "/v1/completions" in line
    assert "disaggregated (prefill-0 -> decode-0)" in line, "worker URLs are shown as process names"
    assert "200 success" in line and "8 completion tokens" in line
