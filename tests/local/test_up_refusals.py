"""`splitserve up` refusing to start: bad files, busy ports, workers that cannot start."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from splitserve.local.procs import is_alive
from testkit.upctl import REPO, run_up

DISAGGREGATED = REPO / "deploy/local/tiny-disaggregated.yaml"


def test_invalid_file_is_refused_before_anything_starts(tmp_path: Path) -> None:
    text = DISAGGREGATED.read_text().replace("replicas: 1\n    minReplicas", "replicas: 3\n    minReplicas", 1)
    text = text.replace("mode: disaggregated", "mode: disaggregated\n  colour: blue")
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    run_dir = tmp_path / "run"

    result = run_up("--engine", "sim", "-f", str(bad), "--port", "0", run_dir=run_dir)

    assert result.returncode == 1
    assert "nothing was started" in result.stderr
    assert "colour" in result.stderr
    assert "Traceback" not in result.stderr
    assert not run_dir.exists(), "no run directory, no process: validation comes first"
    assert "starting" not in result.stdout


def test_invalid_cel_rule_is_reported_with_its_message(tmp_path: Path) -> None:
    text = DISAGGREGATED.read_text().replace("replicas: 1\n    minReplicas", "replicas: 3\n    minReplicas", 1)
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    result = run_up("--engine", "sim", "-f", str(bad), "--port", "0", run_dir=tmp_path / "run")
    assert result.returncode == 1
    assert "replicas must lie between minReplicas and maxReplicas" in result.stderr


def test_missing_file_is_one_clear_line(tmp_path: Path) -> None:
    result = run_up("--engine", "sim", "-f", str(tmp_path / "nope.yaml"), run_dir=tmp_path / "run")
    assert result.returncode == 1
    assert "cannot read" in result.stderr and "Traceback" not in result.stderr


def test_busy_port_is_refused(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = run_up("--engine", "sim", "-f", str(DISAGGREGATED), "--port", str(port), run_dir=tmp_path / "run")
    assert result.returncode == 1
    assert f"port {port} on 127.0.0.1 is in use" in result.stderr
    assert "starting" not in result.stdout


@pytest.mark.slow
def test_worker_failing_at_start_up_exits_non_zero_with_its_log(tmp_path: Path) -> None:
    result = run_up(
        "--engine", "sim", "-f", str(DISAGGREGATED), "--port", "0", "--sim-profile", "no-such-profile",
        run_dir=tmp_path,
    )  # fmt: skip
    assert result.returncode == 1
    assert "exited with code 2 while starting" in result.stderr
    assert "last lines of its log" in result.stderr and "no-such-profile" in result.stderr
    assert "router" not in result.stdout, "the router must not start when a worker cannot"
    pids = [int(line.split("pid ")[1].split(",")[0]) for line in result.stdout.splitlines() if "(pid " in line]
    assert pids, result.stdout
    time.sleep(0.2)
    assert not any(is_alive(pid) for pid in pids)
