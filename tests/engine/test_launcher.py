"""The worker launcher: environment, checks before start, signals, readiness."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from splitserve.api.spec import Role
from splitserve.engine.launcher import (
    CPU_ENV,
    LaunchError,
    LaunchPlan,
    engine_environment,
    port_in_use,
    preflight,
    wait_ready,
)
from splitserve.local.ports import free_port

NIXL_DECODE = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_buffer_device": "cpu"})


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    return directory


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


# --------------------------------------------------------------------------- environment


def test_environment_precedence() -> None:
    env = engine_environment({"PATH": "/bin"}, {"VLLM_NIXL_SIDE_CHANNEL_PORT": "5600", "A": "1"}, cpu=True)
    assert env["PATH"] == "/bin"
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    for name, value in CPU_ENV.items():
        assert env[name] == value
    inherited = {"POD_IP": "10.1.2.3", "VLLM_NIXL_SIDE_CHANNEL_PORT": "7000", "OMP_NUM_THREADS": "4"}
    env = engine_environment(inherited, {"VLLM_NIXL_SIDE_CHANNEL_PORT": "5600"}, cpu=True)
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.1.2.3"
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "7000"  # the process's own setting wins
    assert env["OMP_NUM_THREADS"] == "4"
    assert engine_environment({"VLLM_NIXL_SIDE_CHANNEL_HOST": "h", "POD_IP": "p"}, {}, cpu=False) == {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "h",
        "POD_IP": "p",
    }
    assert "OMP_NUM_THREADS" not in engine_environment({}, {}, cpu=False)


# --------------------------------------------------------------------------- checks before start


def plan(args: list[str], role: Role = Role.DECODE, env: dict[str, str] | None = None) -> LaunchPlan:
    return LaunchPlan(role=role, vllm_args=args, env=env or {})


def test_preflight_accepts_a_good_plan(model_dir: Path) -> None:
    env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
    args = ["--model", str(model_dir), "--port", str(free_port()), "--kv-transfer-config", NIXL_DECODE]
    preflight(plan(args, env=env), check_vllm=False)
    # A hub id or a remote uri is vLLM's to resolve.
    preflight(plan(["--model", "org/model", "--port", str(free_port())]), check_vllm=False)


@pytest.mark.parametrize(
    ("args", "role", "message"),
    [
        ([], Role.DECODE, "no model"),
        (["--model", "/nonexistent/model"], Role.DECODE, "does not exist"),
        (["--model", "{tmp}"], Role.DECODE, "no config.json"),
        (["--model", "{model}", "--kv-transfer-config", "{{"], Role.DECODE, "not valid JSON"),
        (["--model", "{model}", "--kv-transfer-config", "[1]"], Role.DECODE, "JSON object"),
        (["--model", "{model}", "--kv-transfer-config", '{"kv_connector":"Nope"}'], Role.DECODE, "unknown KV"),
        (["--model", "{model}", "--kv-transfer-config", NIXL_DECODE], Role.PREFILL, "cannot run with kv_role"),
    ],
)
def test_preflight_refuses(tmp_path: Path, model_dir: Path, args: list[str], role: Role, message: str) -> None:
    args = [arg.format(tmp=tmp_path, model=model_dir) if "{" in arg and "kv_" not in arg else arg for arg in args]
    args = [*args, "--port", str(free_port())]
    with pytest.raises(LaunchError, match=message):
        preflight(plan(args, role), check_vllm=False)


def test_preflight_refuses_ports_in_use(model_dir: Path, busy_port: int) -> None:
    assert port_in_use(busy_port)
    with pytest.raises(LaunchError, match=f"port {busy_port} is already in use"):
        preflight(plan(["--model", str(model_dir), "--port", str(busy_port)]), check_vllm=False)
    env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(busy_port)}
    args = ["--model", str(model_dir), "--port", str(free_port()), "--kv-transfer-config", NIXL_DECODE]
    with pytest.raises(LaunchError, match="side-channel port"):
        preflight(plan(args, env=env), check_vllm=False)


# --------------------------------------------------------------------------- running: a stand-in engine

STAND_IN = textwrap.dedent(
    """
    import os, signal, sys, time
    def stop(signum, frame):
        # os.write, not print: the signal may land while print("engine up") still holds stdout's lock.
        os.write(1, f"got {signum}\\n".encode())
        os._exit(int(sys.argv[sys.argv.index("--exit-code") + 1]))
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print("engine up", flush=True)
    time.sleep(60)
    """
)
RUNNER = textwrap.dedent(
    """
    import sys
    from splitserve.api.spec import Role
    from splitserve.engine.launcher import LaunchPlan, run_engine
    env = {"PYTHONPATH": sys.argv[1]}
    plan = LaunchPlan(Role.DECODE, ["--exit-code", sys.argv[2]], env, server_module="stand_in_engine")
    sys.exit(run_engine(plan))
    """
)


@pytest.mark.parametrize(("signum", "exit_code"), [(signal.SIGTERM, 0), (signal.SIGINT, 7)])
def test_run_engine_forwards_signals_and_returns_the_exit_code(tmp_path: Path, signum: int, exit_code: int) -> None:
    (tmp_path / "stand_in_engine.py").write_text(STAND_IN)
    with subprocess.Popen(  # `with`: its pipe is closed on the way out
        [sys.executable, "-c", RUNNER, str(tmp_path), str(exit_code)], stdout=subprocess.PIPE, text=True
    ) as runner:
        try:
            assert runner.stdout is not None
            assert runner.stdout.readline().strip() == "engine up"
            runner.send_signal(signum)
            assert runner.wait(timeout=20) == exit_code
            assert runner.stdout.read().strip() == f"got {signum}"
        finally:
            if runner.poll() is None:
                runner.kill()
                runner.wait()


# --------------------------------------------------------------------------- readiness


class _Health(BaseHTTPRequestHandler):
    ready_at = 0.0

    def do_GET(self) -> None:
        status = 200 if self.path == "/health" and time.monotonic() >= self.ready_at else 503
        self.send_response(status)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_wait_ready_polls_until_healthy() -> None:
    handler = type("Handler", (_Health,), {"ready_at": time.monotonic() + 0.6})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        waited = wait_ready(f"http://127.0.0.1:{server.server_address[1]}", timeout=10)
        assert 0.4 <= waited < 10
    finally:
        server.shutdown()
        server.server_close()


def test_wait_ready_times_out_and_notices_a_dead_process() -> None:
    with pytest.raises(TimeoutError):
        wait_ready(f"http://127.0.0.1:{free_port()}", timeout=0.5)
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    dead.wait()
    with pytest.raises(RuntimeError, match="status 3"):
        wait_ready(f"http://127.0.0.1:{free_port()}", timeout=30, process=dead)
