"""Starting, watching and stopping the processes of a local run.

Every child runs in its own session (so its own process group): vLLM's engine-core subprocesses
land in the same group as their API server, and stopping a group stops them all. Ctrl-C in a
terminal reaches only `up`, which then stops the children in order (router first, so no new
request reaches a worker that is going away). A child that exits while the stack serves is started
again from the same spec by restarts.py, through `respawn`.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import BinaryIO, TextIO

import httpx

from splitserve.local.plan import ProcessSpec
from splitserve.local.procs import group_members, is_alive, process_tree, tree_rss_bytes

PR_SET_PDEATHSIG = 1
POLL_SECONDS = 0.2
# Slow starters (vLLM takes about 30 s) get a line now and then, so a waiting terminal is not a mystery.
STILL_STARTING_EVERY_SECONDS = 10.0
# The order in which `up` signals its children: these first, then the rest as they were started.
STOP_FIRST = {"envoy": 0, "router": 1, "epp": 2}


class Progress:
    """Readable progress lines: elapsed seconds since `up` started, then what happened."""

    def __init__(self, stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._stream = stream
        self._clock = clock
        self._start = clock()
        # Also told every line (as printed): e.g. the `up --apply` waiting for a rollout's progress.
        self.listeners: list[Callable[[str], None]] = []

    def elapsed(self) -> float:
        return self._clock() - self._start

    def say(self, message: str) -> None:
        stream = self._stream or sys.stdout
        line = f"[{self.elapsed():6.1f}s] {message}"
        print(line, file=stream, flush=True)
        for listener in list(self.listeners):
            listener(line)


@dataclass
class RunningProcess:
    spec: ProcessSpec
    popen: subprocess.Popen[bytes]
    log_path: Path
    started_at: float  # Progress.elapsed() at the (latest) start
    restarts: int = 0  # how often `respawn` started it again

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def name(self) -> str:
        return self.spec.name


class StartupError(Exception):
    """The stack could not come up; the message says which process and why."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(message)
        self.log_tail = log_tail


class StopRequested(Exception):
    """Ctrl-C or SIGTERM arrived while the stack was starting."""


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        with path.open("rb") as log:
            log.seek(0, os.SEEK_END)
            size = log.tell()
            log.seek(max(0, size - 64 * 1024))
            text = log.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM if `up` itself dies (even by SIGKILL), so nothing leaks."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class Supervisor:
    """Owns the children of one local run, from start to the last one stopped."""

    def __init__(self, run_dir: Path, progress: Progress, *, stop_grace_seconds: float = 10.0) -> None:
        self.run_dir = run_dir
        self.progress = progress
        self.stop_grace_seconds = stop_grace_seconds
        self.processes: list[RunningProcess] = []
        # Processes expected to finish (the tiny-model build): their exit is not a failure of the stack.
        self._one_shot: set[str] = set()
        self.stop_reason: str | None = None
        self._hurry = False
        # Called on every poll of a wait (readiness, a rollout's router checks): what must go on while
        # `up` waits, such as restarting a process that died (restarts.py).
        self.on_wait: Callable[[], None] | None = None

    # ------------------------------------------------------------------ signals

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self.stop_reason is not None:
            self._hurry = True  # a second Ctrl-C: do not wait for graceful exits
            return
        self.stop_reason = signal.Signals(signum).name

    @contextlib.contextmanager
    def signals_handled(self) -> Iterator[None]:
        # SIGHUP too: closing the terminal `up` runs in stops the stack cleanly instead of orphaning it.
        handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    # ------------------------------------------------------------------ start

    def start(self, spec: ProcessSpec, *, one_shot: bool = False) -> RunningProcess:
        log_path = self.run_dir / f"{spec.name}.log"
        with log_path.open("ab") as log:
            try:
                popen = self._spawn(spec, log)
            except OSError as error:
                raise StartupError(f"cannot start {spec.name} ({spec.argv[0]}): {error.strerror or error}") from error
        process = RunningProcess(spec=spec, popen=popen, log_path=log_path, started_at=self.progress.elapsed())
        self.processes.append(process)
        if one_shot:
            self._one_shot.add(spec.name)
        self._write_state()
        where = f" on port {spec.port}" if spec.port else ""
        self.progress.say(f"starting {spec.name}{where} (pid {popen.pid}, log {log_path.name})")
        return process

    def respawn(self, process: RunningProcess) -> None:
        """Start a process that exited again, in place: the same spec (ports, arguments), its log
        appended to, a new pid. What was left of its process group is killed first, as a kubelet
        ends a container before its restart. OSError when it cannot be started."""
        if process.popen.poll() is None:
            raise RuntimeError(f"{process.name} (pid {process.pid}) is still running")
        self._kill_group(process.pid)
        with process.log_path.open("ab") as log:
            log.write(f"---- splitserve up: restart {process.restarts + 1} of {process.name} ----\n".encode())
            log.flush()
            process.popen = self._spawn(process.spec, log)
        process.started_at = self.progress.elapsed()
        process.restarts += 1
        self._write_state()

    @staticmethod
    def _kill_group(pgid: int, seconds: float = 2.0) -> None:
        """SIGKILL what is left of a process group (an engine core whose API server died), briefly
        waiting for it to go so that it no longer holds the ports the restarted process needs."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        deadline = time.monotonic() + seconds
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)

    @staticmethod
    def _spawn(spec: ProcessSpec, log: BinaryIO) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            spec.argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **spec.env, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )

    def _write_state(self) -> None:
        """run.json: what runs where, for people and scripts looking at a live run."""
        state = [
            {
                "name": process.name,
                "pid": process.pid,
                "port": process.spec.port,
                "url": process.spec.base_url,
                "log": str(process.log_path),
                "argv": list(process.spec.argv),
                **({"role": process.spec.role} if process.spec.role else {}),
                **({"generation": process.spec.generation} if process.spec.generation else {}),
                **({"restarts": process.restarts} if process.restarts else {}),
            }
            for process in self.processes
        ]
        # Written under another name and renamed: a reader never sees half of it.
        partial = self.run_dir / ".run.json.tmp"
        partial.write_text(json.dumps({"processes": state}, indent=2) + "\n")
        os.replace(partial, self.run_dir / "run.json")

    def _check_exited(self, process: RunningProcess, when: str) -> None:
        code = process.popen.poll()
        if code is not None:
            raise StartupError(
                f"{process.name} exited with code {code} {when} (log: {process.log_path})",
                log_tail(process.log_path),
            )

    def wait_ready(self, processes: Sequence[RunningProcess], timeout_seconds: float) -> None:
        """Poll each process's ready URL until all answer 200; raise if one dies or time runs out."""
        pending = list(processes)
        deadline = time.monotonic() + timeout_seconds
        next_note = time.monotonic() + STILL_STARTING_EVERY_SECONDS
        noted: dict[str, tuple[str, float]] = {}
        with httpx.Client(timeout=httpx.Timeout(2.0, connect=0.5)) as client:
            while pending:
                if self.stop_reason is not None:
                    raise StopRequested(self.stop_reason)
                for process in list(pending):
                    self._check_exited(process, "while starting")
                    if self._answers(client, process.spec.ready_url):
                        pending.remove(process)
                        took = self.progress.elapsed() - process.started_at
                        self.progress.say(f"{process.name} ready at {process.spec.base_url} ({took:.1f}s)")
                if pending and time.monotonic() >= next_note:
                    next_note += STILL_STARTING_EVERY_SECONDS
                    for process in pending:
                        self._note_still_starting(process, noted)
                if pending and time.monotonic() > deadline:
                    names = ", ".join(process.name for process in pending)
                    raise StartupError(
                        f"{names} not ready after {timeout_seconds:.0f}s (see --startup-timeout)",
                        log_tail(pending[0].log_path),
                    )
                if pending:
                    self.waiting()
                    time.sleep(POLL_SECONDS)

    def _note_still_starting(self, process: RunningProcess, noted: dict[str, tuple[str, float]]) -> None:
        """Say what a slow starter is doing: when its log moved on, or once a minute if it did not."""
        last = log_tail(process.log_path, lines=1).strip()[:120]
        previous, when = noted.get(process.name, (None, 0.0))
        if last == previous and self.progress.elapsed() - when < 60:
            return
        noted[process.name] = (last, self.progress.elapsed())
        self.progress.say(f"{process.name} still starting" + (f": {last}" if last else ""))

    @staticmethod
    def _answers(client: httpx.Client, url: str) -> bool:
        try:
            return client.get(url).status_code == 200
        except httpx.HTTPError:
            return False

    def waiting(self) -> None:
        """One poll of a wait: run on_wait, if set."""
        if self.on_wait is not None:
            self.on_wait()

    def memory_bytes(self) -> int:
        """Resident memory of everything this supervisor runs now."""
        return sum(tree_rss_bytes(process.pid) for process in self.processes)

    # ------------------------------------------------------------------ run

    def watch(self, deadline: float | None) -> RunningProcess | None:
        """Block until a stop is requested, the deadline passes, or a serving child exits (returned)."""
        serving = [process for process in self.processes if process.name not in self._one_shot]
        while self.stop_reason is None:
            for process in serving:
                if process.popen.poll() is not None:
                    return process
            if deadline is not None and time.monotonic() >= deadline:
                self.stop_reason = "time limit"
                return None
            time.sleep(POLL_SECONDS)
        return None

    # ------------------------------------------------------------------ stop

    def _signal_group(self, process: RunningProcess, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, sig)

    @staticmethod
    def _remaining(process: RunningProcess, known: set[int]) -> set[int]:
        """What is left of a process: the pids seen before the stop, plus anything new in its group."""
        process.popen.poll()  # reap the leader so it does not linger as a zombie
        return {pid for pid in known if is_alive(pid)} | set(group_members(process.pid))

    def _wait_gone(self, trees: dict[str, tuple[RunningProcess, set[int]]], seconds: float) -> list[str]:
        """Names of the processes with something still running after up to `seconds`."""
        deadline = time.monotonic() + seconds
        while True:
            live = [name for name, (process, known) in trees.items() if self._remaining(process, known)]
            if not live or time.monotonic() >= deadline or self._hurry:
                return live
            time.sleep(0.05)

    def stop_all(self) -> bool:
        """Stop every child and everything below it; True when all left on SIGTERM within the grace time.

        run.json keeps listing them: it describes the run that just ended."""
        return self._stop(self.processes)

    def stop(self, processes: Sequence[RunningProcess]) -> bool:
        """Stop some children (workers a rollout replaced) as stop_all does, and forget them."""
        try:
            return self._stop(processes)
        finally:
            gone = {id(process) for process in processes}
            self.processes = [process for process in self.processes if id(process) not in gone]
            self._write_state()

    def _stop(self, processes: Sequence[RunningProcess]) -> bool:
        # Front doors first (Envoy, the router, then the picker): they stop taking requests before the
        # workers behind them go away.
        ordered = sorted(processes, key=lambda process: STOP_FIRST.get(process.name, len(STOP_FIRST)))
        # Snapshot the trees now: once a worker exits, its orphans no longer show up as its descendants.
        trees = {process.name: (process, process_tree(process.pid)) for process in ordered}
        trees = {name: tree for name, tree in trees.items() if self._remaining(*tree)}
        if not trees:
            return True
        started = time.monotonic()
        self.progress.say("stopping " + ", ".join(trees))
        for process, _ in trees.values():
            self._signal_group(process, signal.SIGTERM)
        stragglers = self._wait_gone(trees, self.stop_grace_seconds)
        for name in stragglers:
            process, known = trees[name]
            self.progress.say(f"{name} still running after {self.stop_grace_seconds:.0f}s: SIGKILL")
            self._signal_group(process, signal.SIGKILL)
            for pid in self._remaining(process, known):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        self._hurry = False
        leftovers = self._wait_gone({name: trees[name] for name in stragglers}, 5.0)
        for process in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.popen.wait(timeout=1.0)
        if leftovers:
            pids = sorted(pid for name in leftovers for pid in self._remaining(*trees[name]))
            self.progress.say(f"could not stop processes {pids}")
            return False
        self.progress.say(f"stopped {len(trees)} processes in {time.monotonic() - started:.1f}s")
        return not stragglers
