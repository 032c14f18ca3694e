"""Routing quality: which router puts each prompt where its prefix is cached, side by side, one trace.

    python benchmarks/router/routing.py [--vllm-router PATH] [--seconds 60] [--rate 9] [--sim-workers 4]
    python benchmarks/router/routing.py --smoke --out /tmp/routing.json   # seconds: does it still run?

Workers: ``--sim-workers`` aggregated engine simulators (``splitserve sim-worker``) with a small KV cache
(``--num-kv-blocks``), so the pool can hold every tenant's prefix but one worker cannot: evictions
happen and where a prompt goes decides whether it hits. The simulators tokenize with the tiny model's
real tokenizer (as vLLM would) and publish vLLM's KV events, so splitserve's precise-prefix router
reads them exactly as it reads a vLLM worker's. They are restarted for each router under test, so
every row starts from empty caches and zeroed counters.

Trace (seeded, the same for every row): ``--tenants`` system prompts with Zipf popularity; sessions
start as a Poisson process at ``--rate`` per second, each a conversation of 1 to ``--max-turns``
turns that grows (each turn resends the whole history plus the answer it got), the next turn sent a
think time after the previous answer. Measured: TTFT p50/p90/p99 at the client (streaming), requests
finished per second, failures, and the engines' own prefix hit rate
(``vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total`` summed over workers).

Routers, each with 1 replica and with 2 (two router processes; the client alternates between them
request by request, as a Kubernetes Service without session affinity would):
  * splitserve round-robin, prefix-aware (the approximate table of what it sent), precise-prefix
    (the index built from the engines' KV events);
  * vllm-router ``cache_aware`` (its approximate radix tree of the prompts it sent), regular mode,
    ``--worker-urls``;
  * the gateway (``gateway:POLICY``, one replica only; skipped without Envoy): Envoy
    (``--concurrency 1``) in front of ``splitserve epp`` with the router's flags and policy, the
    workers as the pool's endpoints (aggregated: no sidecars). Its hit rate beside the router's with
    the same policy says whether the picker places requests as the router does.

``--smoke``: splitserve prefix-aware and precise-prefix (or the ``--routers`` named), one replica, 2 workers,
2 seconds of a small trace, no vllm-router; the JSON to ``--out`` (a temporary file without it, never the
committed results).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script: `python benchmarks/router/routing.py`
    sys.path.insert(0, str(REPO))

from benchmarks.router import gateway  # noqa: E402
from benchmarks.router.bench import LOG_DIR, hit_rate, markdown_table, percentile, start, stop  # noqa: E402
from splitserve.local.ports import free_port  # noqa: E402

HERE = Path(__file__).resolve().parent
MODEL = "sim-model"
ROUTERS = ["splitserve:round-robin", "splitserve:prefix-aware", "splitserve:precise-prefix", "vllm-router:cache_aware",
           "gateway:prefix-aware", "gateway:precise-prefix"]  # fmt: skip
# --smoke: a few seconds of the same kind of run (flags as on the command line, applied over the parsed ones).
SMOKE = {
    "vllm_router": None,
    "routers": ["splitserve:prefix-aware", "splitserve:precise-prefix"],
    "replicas": ["1"],
    "sim_workers": 2,
    "seconds": 2.0,
    "rate": 2.0,
    "tenants": 3,
    "max_turns": 2,
    "think_seconds": 0.2,
    "max_tokens": 4,
}
# Words made of the syllables the tiny model's tokenizer was trained on: about 1.6 tokens each.
SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "zu", "pe", "ga", "do")


def words(rng: random.Random, count: int) -> str:
    return " ".join("".join(rng.choices(SYLLABLES, k=rng.randint(1, 3))) for _ in range(count))


# ---- the trace ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Session:
    start: float
    tenant: int
    turns: tuple[str, ...]
    think: tuple[float, ...]


def zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (rank + 1) ** s for rank in range(n)]


def build_trace(args: argparse.Namespace) -> tuple[list[str], list[Session]]:
    rng = random.Random(args.seed)
    systems = [
        f"You are assistant number {t} of tenant {t}. " + words(rng, args.system_words) for t in range(args.tenants)
    ]
    weights = zipf_weights(args.tenants, args.zipf)
    sessions: list[Session] = []
    clock = 0.0
    while True:
        clock += rng.expovariate(args.rate)
        if clock >= args.seconds:
            break
        turns = rng.randint(1, args.max_turns)
        questions = tuple(f"Question {len(sessions)}.{k}: " + words(rng, args.turn_words) for k in range(turns))
        think = tuple(rng.expovariate(1.0 / args.think_seconds) for _ in range(turns))
        tenant = rng.choices(range(args.tenants), weights)[0]
        sessions.append(Session(clock, tenant, questions, think))
    return systems, sessions


# ---- one run ------------------------------------------------------------------------------------


@dataclass
class Outcome:
    ttft: list[float] = field(default_factory=list)
    failures: int = 0
    finished: int = 0


async def stream_once(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int, out: Outcome) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0}
    sent = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    try:
        async with session.post(url + "/v1/completions", json=body) as response:
            if response.status != 200:
                out.failures += 1
                return ""
            async for line in response.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.failures += 1
                    return ""
                if first is None:
                    first = time.perf_counter() - sent
                text.append(chunk["choices"][0].get("text", ""))
    except (aiohttp.ClientError, TimeoutError):
        out.failures += 1
        return ""
    if first is None:
        out.failures += 1
        return ""
    out.ttft.append(first)
    out.finished += 1
    return "".join(text)


async def drive(urls: list[str], systems: list[str], sessions: list[Session], max_tokens: int) -> tuple[Outcome, float]:
    out = Outcome()
    counter = 0

    def next_url() -> str:
        nonlocal counter
        counter += 1
        return urls[counter % len(urls)]

    async def converse(http: aiohttp.ClientSession, s: Session, begin: float) -> None:
        await asyncio.sleep(max(0.0, begin + s.start - time.perf_counter()))
        history = systems[s.tenant]
        for question, think in zip(s.turns, s.think, strict=True):
            history += f"\nUser: {question}\nAssistant:"
            answer = await stream_once(http, next_url(), history, max_tokens, out)
            history += answer
            await asyncio.sleep(think)

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        begin = time.perf_counter()
        await asyncio.gather(*(converse(http, s, begin) for s in sessions))
        elapsed = time.perf_counter() - begin
    return out, elapsed


async def ready(url: str, path: str = "/health", seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    async with aiohttp.ClientSession() as http:
        while True:
            try:
                async with http.get(url + path) as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url}{path} not ready")
            await asyncio.sleep(0.2)


def start_workers(args: argparse.Namespace, tokenizer: Path) -> tuple[subprocess.Popen[bytes], list[str]]:
    http, events = free_port(), free_port()
    while http + args.sim_workers > 65000 or abs(http - events) < args.sim_workers:
        http, events = free_port(), free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events}", "topic": "kv"}
    argv = [sys.executable, "-m", "splitserve.cli", "sim-worker", "--role", "aggregated",
            "--count", str(args.sim_workers), "--port", str(http), "--profile", "cpu-tiny",
            "--time-scale", str(args.time_scale),
            "--num-kv-blocks", str(args.num_kv_blocks), "--tokenizer", str(tokenizer), "--model", MODEL,
            "--kv-events-config", json.dumps(config), "--log-level", "ERROR"]  # fmt: skip
    return start(argv, core=None, nice=args.nice), [f"http://127.0.0.1:{http + i}" for i in range(args.sim_workers)]


def start_router(
    kind: str, policy: str, workers: list[str], args: argparse.Namespace, tokenizer: Path, processes: int = 1
) -> tuple[list[subprocess.Popen[bytes]], str, list[str]]:
    """The router's processes, its URL, and URLs to wait for (GET 200) before the trace starts."""
    port = free_port()
    if kind == "gateway":
        # Envoy + `splitserve epp` with the router's flags; aggregated workers, so no sidecars: the
        # pool's endpoints are the workers themselves. One Envoy worker thread (~20 req/s here).
        path = gateway.start_gateway(
            lambda argv: start(argv, core=None, nice=args.nice), workers, [],
            ["--decode-policy", policy, "--model", MODEL, "--tokenizer", str(tokenizer)],
            concurrency=1, config_dir=LOG_DIR,
        )  # fmt: skip
        return path.all(), path.url, [path.epp_url + "/ready", path.admin_url + "/ready"]
    if kind == "splitserve":
        argv = [sys.executable, "-m", "splitserve.cli", "router", "--host", "127.0.0.1", "--port", str(port),
                "--decode", ",".join(workers), "--decode-policy", policy, "--model", MODEL, "--workers", str(processes),
                "--tokenizer", str(tokenizer), "--log-level", "warning"]  # fmt: skip
    else:
        argv = [args.vllm_router, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
                "--policy", policy, "--prometheus-port", str(free_port()), "--log-level", "warning"]  # fmt: skip
    return [start(argv, core=None, nice=args.nice)], f"http://127.0.0.1:{port}", []


async def run_one(kind: str, policy: str, layout: str, args: argparse.Namespace, tokenizer: Path) -> dict[str, object]:
    """One row; ``layout`` is "N" (N router replicas, one process each) or "1xP" (one router, --workers P)."""
    replicas, _, processes = layout.partition("x")
    systems, sessions = build_trace(args)
    sims, workers = start_workers(args, tokenizer)
    routers: list[subprocess.Popen[bytes]] = []
    try:
        for url in workers:
            await ready(url)
        urls = []
        waits: list[str] = []
        for _ in range(int(replicas)):
            started, url, before = start_router(kind, policy, workers, args, tokenizer, int(processes or 1))
            routers += started
            urls.append(url)
            waits += before
        for url in waits:
            await ready(url, path="")
        for url in urls:
            await ready(url)
        await asyncio.sleep(1.0)  # subscriptions connected, health checks done
        base_hits, base_queries = await hit_rate(workers)
        out, elapsed = await drive(urls, systems, sessions, args.max_tokens)
        hits, queries = await hit_rate(workers)
        hits, queries = hits - base_hits, queries - base_queries
    finally:
        for process in routers:
            stop(process)
        stop(sims)
    row: dict[str, object] = {
        "router": f"{kind} {policy}",
        "replicas": layout if "x" not in layout else f"1 (--workers {processes})",
        "requests": out.finished + out.failures,
        "failures": out.failures,
        "ttft_p50_ms": percentile(out.ttft, 50) * 1e3,
        "ttft_p90_ms": percentile(out.ttft, 90) * 1e3,
        "ttft_p99_ms": percentile(out.ttft, 99) * 1e3,
        "throughput_rps": out.finished / elapsed,
        "prefix_hit_rate": hits / queries if queries else float("nan"),
    }
    print(f"  {row}", file=sys.stderr, flush=True)
    return row


def table(rows: list[dict[str, Any]]) -> str:
    header = ["router", "replicas", "requests", "failures", "TTFT p50 / p90 / p99 (ms)", "throughput (req/s)",
              "engine prefix hit rate"]  # fmt: skip
    cells = []
    for r in rows:
        ttft = f"{r['ttft_p50_ms']:.0f} / {r['ttft_p90_ms']:.0f} / {r['ttft_p99_ms']:.0f}"
        cells.append([r["router"], r["replicas"], r["requests"], r["failures"], ttft, f"{r['throughput_rps']:.2f}",
                      f"{r['prefix_hit_rate']:.1%}"])  # fmt: skip
    return markdown_table(header, cells)


def ensure_tokenizer(directory: Path) -> Path:
    if not (directory / "tokenizer.json").exists():
        subprocess.run([sys.executable, "-m", "splitserve.cli", "tiny-model", str(directory)], check=True)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--vllm-router", default=None, help="path of the vllm-router binary (0.1.17); its row is skipped without it")
    add(
        "--routers",
        nargs="+",
        default=None,
        help="KIND:POLICY, KIND one of splitserve, gateway, vllm-router (default: " + " ".join(ROUTERS) + ")",
    )
    add("--replicas", nargs="+", default=["1", "2", "1x2"],
        help="router layouts: N replicas, or 1xP for one router with --workers P (splitserve only)")  # fmt: skip
    add("--sim-workers", type=int, default=4, help="aggregated engine simulators")
    add("--num-kv-blocks", type=int, default=24, help="per worker, of 128 tokens (cpu-tiny's block size)")
    add("--time-scale", type=float, default=1.0)
    add("--seconds", type=float, default=60.0, help="sessions start during this long")
    add("--rate", type=float, default=9.0, help="new sessions per second (round-robin saturates near 9)")
    add("--tenants", type=int, default=24)
    add("--zipf", type=float, default=1.0)
    add("--system-words", type=int, default=250)
    add("--turn-words", type=int, default=25)
    add("--max-turns", type=int, default=4)
    add("--think-seconds", type=float, default=1.0)
    add("--max-tokens", type=int, default=24)
    add("--seed", type=int, default=7)
    add("--nice", type=int, default=0)
    add("--tokenizer-dir", type=Path, default=Path.home() / ".cache" / "splitserve" / "tiny-model")
    add("--out", type=Path, default=None, help="the JSON's path (default: results-routing.json here)")
    add("--smoke", action="store_true", help="a few seconds: does the benchmark still run?")
    args = parser.parse_args()
    named = args.routers
    if args.smoke:
        vars(args).update(SMOKE)
        args.out = args.out or Path(tempfile.mkdtemp(prefix="routing-smoke-")) / "results-routing.json"
    # --routers wins over the smoke run's choice too
    args.routers = named or args.routers or ROUTERS
    args.out = args.out or HERE / "results-routing.json"
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    tokenizer = ensure_tokenizer(args.tokenizer_dir)
    rows: list[dict[str, Any]] = []
    for replicas in args.replicas:
        for spec in args.routers:
            kind, _, policy = spec.partition(":")
            if kind == "vllm-router" and not args.vllm_router:
                print(f"  skipping {spec}: no --vllm-router", file=sys.stderr)
                continue
            if kind == "gateway" and (replicas != "1" or gateway.available() is None):
                # One picker per gateway (GAIE runs one active EPP); replicas are the router's question.
                if replicas == "1":
                    print(f"  skipping {spec}: envoy is not installed (splitserve[gateway])", file=sys.stderr)
                continue
            if kind == "vllm-router" and "x" in replicas:
                continue  # one vllm-router process already uses every core (tokio threads)
            if "x" in replicas and policy == "round-robin":
                continue  # nothing to lose across processes
            rows.append(asyncio.run(run_one(kind, policy, replicas, args, tokenizer)))
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2))
    print(table(rows))
    print(f"results written to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
