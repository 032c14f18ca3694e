"""Real vLLM-CPU processes for the tests: start through `splitserve worker`, measure, stop everything.

Every process started here is stopped by its id: SIGTERM to the worker (which forwards it to vLLM),
then SIGKILL to whatever of its process tree is still alive after a grace period.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from splitserve.engine.launcher import wait_ready
from splitserve.local.ports import free_port
from splitserve.local.procs import descendants, is_alive, rss_bytes

MODEL_NAME = "tiny"
STOP_GRACE_SECONDS = 20.0
PORT_CLASH = "already in use"  # vLLM: "Address already in use"; our launcher: "port N is already in use"
PORT_CLASH_CHECK_SECONDS = 5.0
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


def splitserve_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "splitserve", *args]


# --------------------------------------------------------------------------- process trees


def process_tree(pid: int) -> list[int]:
    """`pid` and all its live descendants."""
    return [pid, *descendants(pid)]


def process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def _alive(pids: Iterable[int]) -> list[int]:
    return [pid for pid in pids if is_alive(pid)]


# --------------------------------------------------------------------------- one engine


class PortClash(RuntimeError):
    """An engine could not bind one of its ports: another process took it after we chose it."""


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

    def port_clash(self) -> bool:
        """Whether a socket of the engine (its NIXL side channel, say) found its port taken."""
        try:
            return PORT_CLASH in self.log_path.read_text(errors="replace")
        except OSError:
            return False

    def wait_ready(self, timeout: float) -> None:
        """Wait for /health; raise PortClash at once when a socket could not bind.

        vLLM's NIXL handshake listener is a thread: when its bind fails the engine neither exits
        nor becomes ready, so without this check the wait would run to its timeout.
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                remaining = max(0.0, deadline - time.monotonic())
                wait_ready(self.url, min(PORT_CLASH_CHECK_SECONDS, remaining), process=self.process)
                break
            except TimeoutError as error:
                if self.port_clash():
                    raise PortClash(f"{self.name}: a port was taken\n--- log tail ---\n{self.log_tail()}") from error
                if time.monotonic() >= deadline:
                    message = f"{self.name}: not ready after {timeout:.0f} s\n--- log tail ---\n{self.log_tail()}"
                    raise RuntimeError(message) from error
            except RuntimeError as error:
                clash: type[RuntimeError] = PortClash if self.port_clash() else RuntimeError
                raise clash(f"{self.name}: {error}\n--- log tail ---\n{self.log_tail()}") from error
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
    name: str,
    role: str,
    spec_path: Path,
    model_dir: Path | None,
    log_dir: Path,
    *,
    side_channel_port: int | None = None,
    worker_flags: Sequence[str] = (),
    env_overrides: Mapping[str, str] | None = None,
) -> Engine:
    """`splitserve worker` for `role` from `spec_path`; `model_dir` None loads the spec's model.source."""
    port = free_port()
    env = {**os.environ, **(env_overrides or {})}
    env.pop("VLLM_NIXL_SIDE_CHANNEL_PORT", None)
    if side_channel_port is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
    log_path = log_dir / f"{name}.log"
    command = splitserve_command(
        "worker",
        "--role",
        role,
        "-f",
        str(spec_path),
        "--cpu",
        "--port",
        str(port),
        *(["--model", str(model_dir)] if model_dir is not None else []),
        *worker_flags,
    )
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return Engine(name, role, port, process, log_path, side_channel_port=side_channel_port)


def start_ready_engine(
    name: str,
    role: str,
    spec_path: Path,
    model_dir: Path | None,
    log_dir: Path,
    *,
    timeout: float,
    attempts: int = 3,
    worker_flags: Callable[[], Sequence[str]] = tuple,
    env_overrides: Mapping[str, str] | None = None,
) -> Engine:
    """Start an engine and wait until it is ready, on fresh ports again if one was taken meanwhile.

    Ports are checked free when chosen, but vLLM binds its NIXL side channel some 20 s later; on a
    busy CI machine another process can take one in between. A clash is not what the tests test,
    so it costs a restart rather than the whole group. Any other failure is raised at once.
    """
    for attempt in range(1, attempts + 1):
        side_channel_port = free_port() if role in ("prefill", "decode") else None
        engine = start_engine(
            name,
            role,
            spec_path,
            model_dir,
            log_dir,
            side_channel_port=side_channel_port,
            worker_flags=worker_flags(),
            env_overrides=env_overrides,
        )
        try:
            engine.wait_ready(timeout)
            return engine
        except PortClash:
            stop_all([engine])
            if attempt == attempts:
                raise
            engine.log_path.rename(engine.log_path.with_name(f"{name}.port-clash-{attempt}.log"))
        except BaseException:
            stop_all([engine])
            raise
    raise AssertionError("unreachable")


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
