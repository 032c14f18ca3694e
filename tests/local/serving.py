"""Killing a process of a running `splitserve up` and seeing it come back: shared by the end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time

import httpx

from splitserve.local.endpoints import all_healthy
from splitserve.local.procs import is_alive
from testkit.upctl import UpRun

RESTART_LINE = re.compile(r"\] (\S+) exited \(([a-z]+ -?\d+)\); restarted \(restart (\d+), pid (\d+)\)")


def pids(up: UpRun) -> dict[str, int]:
    return {str(entry["name"]): int(str(entry["pid"])) for entry in up.process_state()}


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
