"""Driving `splitserve up` as a subprocess in tests and benchmarks: start it, read its lines, find its children."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from splitserve.local.procs import descendants

REPO = Path(__file__).resolve().parents[1]
ENDPOINT_LINE = re.compile(r"OpenAI endpoint: (http://127\.0\.0\.1:(\d+)/v1)")


@dataclass
class UpRun:
    popen: subprocess.Popen[str]
    run_dir: Path
    # Where stderr is also written as it comes (a long run's post-mortem); stderr() has it either way.
    stderr_log: Path | None = None
    lines: list[str] = field(default_factory=list)
    _queue: queue.Queue[str | None] = field(default_factory=queue.Queue)
    _stderr_text: str = ""
    _stderr_read: threading.Event = field(default_factory=threading.Event)

    def _pump(self) -> None:
        """stdout, line by line, into the queue; the pipe is closed once `up` (and its children) closed it."""
        assert self.popen.stdout is not None
        with self.popen.stdout:
            for line in self.popen.stdout:
                self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def _pump_stderr(self) -> None:
        """stderr, whole, kept for stderr(): read as it comes, so that a full pipe never blocks `up`."""
        assert self.popen.stderr is not None
        chunks: list[str] = []
        mirror = self.stderr_log.open("w") if self.stderr_log is not None else contextlib.nullcontext()
        with self.popen.stderr, mirror as log:
            for line in self.popen.stderr:
                chunks.append(line)
                if log is not None:
                    log.write(line)
                    log.flush()
        self._stderr_text = "".join(chunks)
        self._stderr_read.set()

    def wait_for_line(self, pattern: re.Pattern[str], seconds: float) -> re.Match[str]:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            self.lines.append(line)
            match = pattern.search(line)
            if match:
                return match
        raise AssertionError(f"no line matching {pattern.pattern!r}; output so far:\n" + "\n".join(self.lines))

    def process_state(self) -> list[dict[str, object]]:
        processes: list[dict[str, object]] = json.loads((self.run_dir / "run.json").read_text())["processes"]
        return processes

    def children(self) -> set[int]:
        return descendants(self.popen.pid)

    def stderr(self) -> str:
        """All of stderr: waits until `up` (and its children) closed it, as reading the pipe to its end would."""
        assert self.popen.stderr is not None
        self._stderr_read.wait()
        return self._stderr_text

    def stop(self, grace_s: float = 30) -> None:
        """SIGTERM unless it already exited; SIGKILL if it has not stopped within `grace_s`."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=10)


def start_up(*args: str, run_dir: Path, env: Mapping[str, str] | None = None, stderr_log: Path | None = None) -> UpRun:
    popen = subprocess.Popen(
        [sys.executable, "-m", "splitserve", "up", "--run-dir", str(run_dir), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env} if env is not None else None,
    )
    run = UpRun(popen=popen, run_dir=run_dir, stderr_log=stderr_log)
    threading.Thread(target=run._pump, daemon=True).start()
    threading.Thread(target=run._pump_stderr, daemon=True).start()
    return run


def run_up(*args: str, run_dir: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "splitserve", "up", "--run-dir", str(run_dir), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
