"""Restarts of processes that die while the stack serves: the back-off arithmetic, the restarter against
stand-in processes on a fake clock, and the endpoints file's not-ready state."""

from __future__ import annotations

import io
import json
import os
import re
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from splitserve.local.endpoints import EndpointsFile
from splitserve.local.plan import ProcessSpec
from splitserve.local.restarts import CrashLoopBackoff, Restarter, exit_reason
from splitserve.local.supervisor import Progress, RunningProcess, Supervisor

# ---------------------------------------------------------------------------------- the back-off


def test_the_first_restart_is_immediate_then_10s_doubling_up_to_5_minutes() -> None:
    policy = CrashLoopBackoff()
    assert [policy.delay(crashes) for crashes in range(1, 9)] == [0, 10, 20, 40, 80, 160, 300, 300]
    assert policy.delay(10_000) == 300, "no overflow however long it crash-loops"


def test_exits_in_a_row_count_up_and_ten_minutes_of_running_start_over() -> None:
    policy = CrashLoopBackoff()
    crashes, delays = 0, []
    for ran in (0.5, 0.5, 0.5, 30.0):
        crashes, delay = policy.after_exit(crashes, ran)
        delays.append(delay)
    assert (crashes, delays) == (4, [0, 10, 20, 40])
    assert policy.after_exit(crashes, 599.9) == (5, 80)
    assert policy.after_exit(crashes, 600.0) == (1, 0), "a process that ran 10 minutes is restarted at once"


def test_exit_reasons_name_the_code_or_the_signal() -> None:
    assert exit_reason(3) == "code 3"
    assert exit_reason(0) == "code 0"
    assert exit_reason(-9) == "signal 9"


# ---------------------------------------------------------------------------------- the restarter


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def progress(progress_output: io.StringIO, clock: FakeClock) -> Progress:
    return Progress(progress_output, clock=clock)


@pytest.fixture
def own_supervisor(tmp_path: Path, progress: Progress) -> Iterator[Supervisor]:
    supervisor = Supervisor(tmp_path, progress, stop_grace_seconds=5.0)
    yield supervisor
    supervisor.stop_all()


def _restarter(supervisor: Supervisor, processes: list[RunningProcess], events: list[str]) -> Restarter:
    return Restarter(
        supervisor,
        supervisor.progress,
        watched=lambda: processes,
        on_exit=lambda process: events.append(f"exit {process.name}"),
        on_ready=lambda process: events.append(f"ready {process.name}"),
        probe=lambda process: True,
        active=True,
    )


def test_a_killed_process_is_restarted_at_once_on_its_port_and_log_then_ready_again(
    own_supervisor: Supervisor,
    stand_in: Callable[..., ProcessSpec],
    progress_output: io.StringIO,
    tmp_path: Path,
) -> None:
    worker = own_supervisor.start(stand_in("decode-0"))
    own_supervisor.wait_ready([worker], timeout_seconds=20)
    events: list[str] = []
    restarter = _restarter(own_supervisor, [worker], events)
    old_pid = worker.pid

    restarter.tick()
    assert events == [], "nothing to do while it runs"
    os.kill(old_pid, signal.SIGKILL)
    worker.popen.wait(timeout=10)
    restarter.tick()

    assert worker.pid != old_pid and worker.popen.poll() is None and worker.restarts == 1
    assert f"decode-0 exited (signal 9); restarted (restart 1, pid {worker.pid})" in progress_output.getvalue()
    assert events == ["exit decode-0"]
    restarter.tick()
    assert events == ["exit decode-0", "ready decode-0"]
    assert "decode-0 ready again at http://127.0.0.1:" in progress_output.getvalue()
    restarter.tick()
    assert events == ["exit decode-0", "ready decode-0"], "ready again once, not on every look"
    state = json.loads((tmp_path / "run.json").read_text())["processes"]
    assert state == [{**state[0], "pid": worker.pid, "restarts": 1, "port": worker.spec.port}]
    assert "restart 1 of decode-0" in (tmp_path / "decode-0.log").read_text(), "the log is appended to"


def test_a_process_that_keeps_dying_backs_off_10s_then_20s(
    own_supervisor: Supervisor,
    stand_in: Callable[..., ProcessSpec],
    progress_output: io.StringIO,
    clock: FakeClock,
) -> None:
    broken = own_supervisor.start(stand_in("prefill-0", "--exit-at-start", "3"))
    events: list[str] = []
    restarter = _restarter(own_supervisor, [broken], events)

    def exits_and_tick(after: float) -> None:
        broken.popen.wait(timeout=10)
        clock.now += after
        restarter.tick()

    exits_and_tick(0.5)
    assert broken.restarts == 1, "the first restart is immediate"
    exits_and_tick(0.5)
    assert broken.restarts == 1
    assert re.search(
        r"prefill-0 exited \(code 3\) after 0\.5s, 2 exits in a row: back-off, restart 2 in 10s "
        r"\(log: .*prefill-0.log\)",
        progress_output.getvalue(),
    )
    clock.now += 9.0
    restarter.tick()
    assert broken.restarts == 1, "not before its back-off is over"
    clock.now += 1.0
    restarter.tick()
    assert broken.restarts == 2
    assert f"prefill-0 exited (code 3), back-off over; restarted (restart 2, pid {broken.pid})" in (
        progress_output.getvalue()
    )
    exits_and_tick(0.5)
    assert "3 exits in a row: back-off, restart 3 in 20s" in progress_output.getvalue()
    assert events == ["exit prefill-0"] * 3


def test_nothing_restarts_once_a_stop_is_asked_for_or_when_no_longer_watched(
    own_supervisor: Supervisor, stand_in: Callable[..., ProcessSpec]
) -> None:
    worker = own_supervisor.start(stand_in("decode-0", "--exit-at-start", "0"))
    watched = [worker]
    restarter = _restarter(own_supervisor, watched, [])
    worker.popen.wait(timeout=10)

    own_supervisor.stop_reason = "SIGTERM"
    restarter.tick()
    assert worker.restarts == 0, "shutting down: nothing restarts"

    own_supervisor.stop_reason = None
    watched.clear()  # a drained worker, or a one-shot process: not watched
    restarter.tick()
    assert worker.restarts == 0

    restarter.active = False  # still starting up: a death fails `up` instead
    watched.append(worker)
    restarter.tick()
    assert worker.restarts == 0


# ---------------------------------------------------------------------------------- the endpoints file


def _spec(name: str, port: int, role: str) -> ProcessSpec:
    return ProcessSpec(name=name, argv=("x",), port=port, ready_path="/health", role=role, generation="g1")


def test_a_dead_worker_leaves_the_file_until_ready_and_a_terminating_one_stays_terminating(tmp_path: Path) -> None:
    endpoints = EndpointsFile(tmp_path / "endpoints.json")
    prefill, decode = _spec("prefill-0", 8101, "prefill"), _spec("decode-0", 8201, "decode")
    endpoints.add([prefill, decode])

    def urls() -> dict[str, list[tuple[str, str]]]:
        pools = json.loads(endpoints.path.read_text())["pools"]
        return {pool: [(entry["url"], entry["state"]) for entry in entries] for pool, entries in pools.items()}

    endpoints.mark_not_ready([decode.base_url])
    assert urls() == {"prefill": [(prefill.base_url, "ready")], "decode": []}
    endpoints.mark_ready([decode.base_url])
    assert urls()["decode"] == [(decode.base_url, "ready")]

    endpoints.mark_terminating([prefill.base_url])
    endpoints.mark_not_ready([prefill.base_url])
    endpoints.mark_ready([prefill.base_url, "http://127.0.0.1:1"])  # unknown URLs are ignored
    assert urls()["prefill"] == [(prefill.base_url, "terminating")], "draining is not undone by a restart"
