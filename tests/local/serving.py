"""A serving `splitserve up` in end-to-end tests: run until stopped cleanly; a process of it killed and
seen coming back."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from splitserve.local.endpoints import all_healthy
from splitserve.local.procs import is_alive
from testkit.upctl import UpRun, start_up

RESTART_LINE = re.compile(r"\] (\S+) exited \(([a-z]+ -?\d+)\); restarted \(restart (\d+), pid (\d+)\)")


def pids(up: UpRun) -> dict[str, int]:
    return {str(entry["name"]): int(str(entry["pid"])) for entry in up.process_state()}


@contextlib.contextmanager
def serving(*args: str, run_dir: Path) -> Iterator[UpRun]:
    """`splitserve up ARGS`; on the way out a SIGTERM that must stop it with 0 and leave none of the
    processes it ran (run.json's, as they were then) alive."""
    up = start_up(*args, run_dir=run_dir)
    running: set[int] = set()
    try:
        yield up
        running = set(pids(up).values())
        up.popen.send_signal(signal.SIGTERM)
        assert up.popen.wait(timeout=30) == 0, up.stderr()
    finally:
        if up.popen.poll() is None:
            up.popen.kill()
    deadline = time.monotonic() + 5
    while any(is_alive(pid) for pid in running) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(is_alive(pid) for pid in running), "every process `up` ran must be gone"


def kill_and_see_it_back(up: UpRun, name: str, restart: int = 1) -> int:
    """SIGKILL `name`; wait for its one restart line and its ready-again line; its new pid, alive."""
    old = pids(up)[name]
    os.kill(old, signal.SIGKILL)
    restarted = up.wait_for_line(RESTART_LINE, seconds=30)
    assert restarted.group(1, 2, 3) == (name, "signal 9", str(restart)), restarted.group(0)
    up.wait_for_line(re.compile(rf"\] {re.escape(name)} ready again at "), seconds=60)
    new = pids(up)[name]
    assert new == int(restarted.group(4)) != old
    assert is_alive(new)
    return new


def wait_router_takes(router: str, url: str, seconds: float = 15) -> None:
    """Until the router at `router` lists the worker `url` as healthy (it reads the endpoints file every 0.2 s)."""
    deadline = time.monotonic() + seconds
    with httpx.Client(timeout=5) as client:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                if all_healthy(client.get(f"{router}/splitserve/workers").json(), [url]):
                    return
            time.sleep(0.1)
    raise AssertionError(f"the router did not take {url} back within {seconds}s")
