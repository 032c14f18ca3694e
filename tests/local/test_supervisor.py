"""The supervisor against stand-in workers: readiness, start-up failures, clean and forced stops."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from splitserve.local.plan import ProcessSpec
from splitserve.local.ports import is_port_free
from splitserve.local.procs import group_members, is_alive
from splitserve.local.supervisor import StartupError, StopRequested, Supervisor


def _wait_for_members(pgid: int, count: int, seconds: float = 5.0) -> list[int]:
    deadline = time.monotonic() + seconds
    members = group_members(pgid)
    while len(members) < count and time.monotonic() < deadline:
        time.sleep(0.05)
        members = group_members(pgid)
    return members


def test_starts_waits_and_stops_whole_groups(
    supervisor: Supervisor, stand_in: Callable[..., ProcessSpec], progress_output: io.StringIO, tmp_path: Path
) -> None:
    worker = supervisor.start(stand_in("decode-0", "--spawn-child", "--ready-after", "0.5"))
    router = supervisor.start(stand_in("router", ready_path="/ready"))
    supervisor.wait_ready([worker, router], timeout_seconds=20)
    members = _wait_for_members(worker.pid, 2)
    assert len(members) == 2, "the stand-in's grandchild should share its process group"

    assert supervisor.stop_all() is True

    assert all(not is_alive(pid) for pid in [*members, router.pid])
    assert is_port_free(worker.spec.port) and is_port_free(router.spec.port)
    text = progress_output.getvalue()
    assert "decode-0 ready" in text and "router ready" in text and "stopped 2 processes" in text
    state = json.loads((tmp_path / "run.json").read_text())
    assert [entry["name"] for entry in state["processes"]] == ["decode-0", "router"]
    assert state["processes"][0]["pid"] == worker.pid


def test_router_is_stopped_first(
    supervisor: Supervisor, stand_in: Callable[..., ProcessSpec], progress_output: io.StringIO
) -> None:
    supervisor.start(stand_in("decode-0"))
    supervisor.start(stand_in("router"))
    supervisor.wait_ready(supervisor.processes, timeout_seconds=20)
    supervisor.stop_all()
    assert "stopping router, decode-0" in progress_output.getvalue()


def test_worker_dying_at_start_up_is_reported_with_its_log(
    supervisor: Supervisor, stand_in: Callable[..., ProcessSpec]
) -> None:
    healthy = supervisor.start(stand_in("decode-0"))
    broken = supervisor.start(stand_in("prefill-0", "--exit-at-start", "3"))
    with pytest.raises(StartupError) as raised:
        supervisor.wait_ready([healthy, broken], timeout_seconds=20)
    assert "prefill-0 exited with code 3" in str(raised.value)
    assert "out of cheese" in raised.value.log_tail


def test_not_ready_in_time(supervisor: Supervisor, stand_in: Callable[..., ProcessSpec]) -> None:
    slow = supervisor.start(stand_in("decode-0", "--ready-after", "60"))
    started = time.monotonic()
    with pytest.raises(StartupError, match="decode-0 not ready after 1s"):
        supervisor.wait_ready([slow], timeout_seconds=1)
    assert time.monotonic() - started < 30  # gave up at the timeout, not after the 60 s stand-in


def test_sigterm_ignored_means_sigkill_after_grace(
    tmp_path: Path, stand_in: Callable[..., ProcessSpec], progress_output: io.StringIO
) -> None:
    from splitserve.local.supervisor import Progress

    supervisor = Supervisor(tmp_path, Progress(progress_output), stop_grace_seconds=0.5)
    stubborn = supervisor.start(stand_in("decode-0", "--ignore-sigterm"))
    supervisor.wait_ready([stubborn], timeout_seconds=20)

    assert supervisor.stop_all() is False

    assert not is_alive(stubborn.pid)
    assert "SIGKILL" in progress_output.getvalue()


def test_watch_returns_the_child_that_died(supervisor: Supervisor, stand_in: Callable[..., ProcessSpec]) -> None:
    worker = supervisor.start(stand_in("decode-0"))
    supervisor.wait_ready([worker], timeout_seconds=20)
    os.kill(worker.pid, signal.SIGKILL)
    assert supervisor.watch(deadline=time.monotonic() + 10) is worker


def test_watch_until_deadline(supervisor: Supervisor, stand_in: Callable[..., ProcessSpec]) -> None:
    worker = supervisor.start(stand_in("decode-0"))
    supervisor.wait_ready([worker], timeout_seconds=20)
    assert supervisor.watch(deadline=time.monotonic() + 0.3) is None
    assert supervisor.stop_reason == "time limit"


def test_sigterm_during_start_up_interrupts_the_wait(
    supervisor: Supervisor, stand_in: Callable[..., ProcessSpec]
) -> None:
    slow = supervisor.start(stand_in("decode-0", "--ready-after", "60"))
    before = signal.getsignal(signal.SIGTERM)
    with supervisor.signals_handled(), pytest.raises(StopRequested):
        os.kill(os.getpid(), signal.SIGTERM)
        supervisor.wait_ready([slow], timeout_seconds=30)
    assert supervisor.stop_reason == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before, "the previous handler must be restored"


def test_slow_starters_get_a_still_starting_line_with_their_last_log_line(
    supervisor: Supervisor,
    stand_in: Callable[..., ProcessSpec],
    progress_output: io.StringIO,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from splitserve.local import supervisor as supervisor_module

    monkeypatch.setattr(supervisor_module, "STILL_STARTING_EVERY_SECONDS", 0.3)
    slow = supervisor.start(stand_in("decode-0", "--ready-after", "1.5"))
    supervisor.wait_ready([slow], timeout_seconds=20)
    assert re.search(r"decode-0 still starting: stand-in starting on \d+", progress_output.getvalue())


def test_descendants_in_other_process_groups_are_stopped_too(
    tmp_path: Path, stand_in: Callable[..., ProcessSpec], progress_output: io.StringIO
) -> None:
    from splitserve.local.procs import descendants
    from splitserve.local.supervisor import Progress

    supervisor = Supervisor(tmp_path, Progress(progress_output), stop_grace_seconds=0.5)
    worker = supervisor.start(stand_in("decode-0", "--spawn-child-own-group"))
    supervisor.wait_ready([worker], timeout_seconds=20)
    deadline = time.monotonic() + 5
    while not descendants(worker.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    (loner,) = descendants(worker.pid)
    assert loner not in group_members(worker.pid)

    supervisor.stop_all()

    assert not is_alive(loner), "a grandchild that left the worker's group must not outlive `up`"
    assert not is_alive(worker.pid)


def test_a_one_shot_process_finishing_is_not_a_failure(
    supervisor: Supervisor, stand_in: Callable[..., ProcessSpec]
) -> None:
    task = supervisor.start(stand_in("tiny-model", "--exit-at-start", "0"), one_shot=True)
    worker = supervisor.start(stand_in("decode-0"))
    supervisor.wait_ready([worker], timeout_seconds=20)
    assert task.popen.wait(timeout=10) == 0
    assert supervisor.watch(deadline=time.monotonic() + 0.5) is None
    assert supervisor.stop_reason == "time limit"
