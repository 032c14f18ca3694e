"""Autoscaling evidence: replay a bursty trace against simulated prefill/decode pools behind the real
router, with a real Prometheus scraping them, under three policies:

- builtin: splitserve's autoscaler (`splitserve.autoscaling.evaluate`, unchanged) every interval;
- keda-waiting: what the usual KEDA recipe does (vLLM production-stack): per pool, one Prometheus
  trigger `sum(vllm:num_requests_waiting)` with an AverageValue threshold, HPA's algorithm
  (10% tolerance, same windows, step and interval as builtin);
- static-peak: both pools fixed at the largest size the builtin run used.

"Scaling" a pool moves simulated workers in and out of the router's endpoints (after a startup
delay, as a pod that loads a model) and of Prometheus' scrape targets. Time is compressed (see
Settings): windows, startup and the trace are about 10x shorter than in a real cluster.

    python benchmarks/autoscaling/run.py --out benchmarks/autoscaling/results   # ~15 minutes
    python benchmarks/autoscaling/run.py --duration 40 --policies builtin       # a smoke run

Needs the `prometheus` binary and matplotlib (for the plots).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from splitserve.api.spec import InferenceDeploymentSpec  # noqa: E402
from splitserve.autoscaling.decision import AutoscalerState  # noqa: E402
from splitserve.autoscaling.evaluate import evaluate  # noqa: E402
from splitserve.autoscaling.prometheus import PrometheusClient, PrometheusUnavailable  # noqa: E402
from splitserve.router.app import Router, build_app  # noqa: E402
from splitserve.router.config import DiscoveryKind, RouterConfig  # noqa: E402
from splitserve.router.discovery import UpdateCallback  # noqa: E402
from splitserve.sim import Role, SimConfig, SimWorker  # noqa: E402
from tests.support_prometheus import PROMETHEUS_BINARY, PrometheusServer, ScrapeTarget  # noqa: E402

NAMESPACE, NAME = "bench", "bench"
POOLS = ("prefill", "decode")


@dataclass(frozen=True)
class Settings:
    duration_s: float = 240.0
    seed: int = 7
    time_scale: float = 8.0  # sim durations x8: an H100-8B decode step of 12 ms becomes ~100 ms
    decode_max_num_seqs: int = 12
    prefill_max_batched_tokens: int = 2048
    max_replicas: int = 6
    startup_s: float = 8.0  # a new replica serves this long after it is asked for
    interval_s: float = 2.0
    down_window_s: int = 30
    up_window_s: int = 0
    max_step: int = 2
    tolerance: float = 0.1
    ttft_slo_s: float = 2.5
    itl_slo_s: float = 0.2
    keda_waiting_threshold: float = 5.0
    base_rate: float = 0.7
    peak_rate: float = 3.0
    spike_rate: float = 2.5  # added on top during a spike
    spikes: tuple[tuple[float, float], ...] = ((0.30, 0.08), (0.62, 0.08))  # (start, length) as trace fractions


# --------------------------------------------------------------------------- trace


@dataclass(frozen=True)
class Arrival:
    time: float
    prompt_tokens: int
    output_tokens: int


def rate_at(settings: Settings, t: float) -> float:
    """Diurnal ramp (one sine hump over the trace) plus rectangular spikes."""
    frac = t / settings.duration_s
    rate = settings.base_rate + (settings.peak_rate - settings.base_rate) * math.sin(math.pi * frac) ** 2
    for start, length in settings.spikes:
        if start <= frac < start + length:
            rate += settings.spike_rate
    return rate


def make_trace(settings: Settings) -> list[Arrival]:
    """Poisson arrivals (thinning); prompts 100-3000 tokens (log-normal, median 1200), outputs 16-160 (median 50)."""
    rng = random.Random(settings.seed)
    top = settings.peak_rate + settings.spike_rate
    arrivals: list[Arrival] = []
    t = 0.0
    while True:
        t += rng.expovariate(top)
        if t >= settings.duration_s:
            return arrivals
        if rng.random() * top <= rate_at(settings, t):
            prompt = int(min(3000, max(100, rng.lognormvariate(math.log(1200), 0.6))))
            output = int(min(160, max(16, rng.lognormvariate(math.log(50), 0.6))))
            arrivals.append(Arrival(t, prompt, output))


# --------------------------------------------------------------------------- the cluster stand-in


class PushDiscovery:
    """Router discovery whose endpoint sets the benchmark changes (as Kubernetes EndpointSlices would)."""

    def __init__(self) -> None:
        self._callback: UpdateCallback | None = None
        self._pending: dict[str, set[str]] = {pool: set() for pool in POOLS}

    async def run(self, on_update: UpdateCallback) -> None:
        self._callback = on_update
        for pool, urls in self._pending.items():
            on_update(pool, set(urls), set())

    def set(self, pool: str, urls: set[str]) -> None:
        self._pending[pool] = set(urls)
        if self._callback is not None:
            self._callback(pool, set(urls), set())


@dataclass
class Replica:
    worker: SimWorker
    ready_at: float | None = None  # None: not asked for
    removed_at: float | None = None


@dataclass
class Pool:
    name: str
    replicas: list[Replica]

    def active(self) -> list[Replica]:
        return [r for r in self.replicas if r.ready_at is not None]

    def ready(self, now: float) -> list[Replica]:
        return [r for r in self.active() if r.ready_at is not None and r.ready_at <= now]


class Cluster:
    def __init__(self, settings: Settings, prometheus: PrometheusServer, discovery: PushDiscovery, router_port: int):
        self.settings = settings
        self.prometheus = prometheus
        self.discovery = discovery
        self.router_port = router_port
        self.pools: dict[str, Pool] = {}
        self.draining: list[Replica] = []
        self._published: dict[str, set[str]] = {}

    async def start(self) -> None:
        s = self.settings
        for pool in POOLS:
            role = Role.PREFILL if pool == "prefill" else Role.DECODE
            config = SimConfig.from_profile("gpu-h100-8b", role=role, time_scale=s.time_scale, model="sim-model")
            if pool == "decode":
                limits = dataclasses.replace(config.limits, max_num_seqs=s.decode_max_num_seqs)
            else:
                limits = dataclasses.replace(config.limits, max_num_batched_tokens=s.prefill_max_batched_tokens)
            config = dataclasses.replace(config, limits=limits)
            workers = [SimWorker(dataclasses.replace(config, seed=i)) for i in range(s.max_replicas)]
            for worker in workers:
                await worker.start()
            self.pools[pool] = Pool(pool, [Replica(w) for w in workers])

    async def stop(self) -> None:
        for pool in self.pools.values():
            for replica in pool.replicas:
                await replica.worker.stop()

    def size(self, pool: str) -> int:
        return len(self.pools[pool].active())

    def scale(self, pool: str, desired: int, now: float) -> None:
        replicas = self.pools[pool]
        active = replicas.active()
        if desired > len(active):
            idle = [r for r in replicas.replicas if r.ready_at is None]
            for replica in idle[: desired - len(active)]:
                replica.ready_at = now + self.settings.startup_s
                replica.removed_at = None
        elif desired < len(active):
            # Newest first, as a ReplicaSet picks not-ready and youngest pods to delete.
            for replica in sorted(active, key=lambda r: r.ready_at or 0.0, reverse=True)[: len(active) - desired]:
                replica.ready_at = None
                replica.removed_at = now
                self.draining.append(replica)

    async def publish(self, now: float) -> None:
        """Push ready workers to the router and Prometheus when the sets changed."""
        changed = False
        for pool, replicas in self.pools.items():
            urls = {r.worker.url for r in replicas.ready(now)}
            if self._published.get(pool) != urls:
                self._published[pool] = urls
                self.discovery.set(pool, urls)
                changed = True
        self.draining = [r for r in self.draining if r.worker.in_flight > 0]
        if changed:
            targets = [
                ScrapeTarget(url.removeprefix("http://"), {"namespace": NAMESPACE, "deployment": NAME, "role": pool})
                for pool, urls in self._published.items()
                for url in sorted(urls)
            ]
            targets.append(ScrapeTarget(f"127.0.0.1:{self.router_port}", {"namespace": NAMESPACE, "deployment": NAME}))
            self.prometheus.targets = targets
            with contextlib.suppress(Exception):
                await self.prometheus.reload()

    def billed(self, pool: str) -> int:
        """Replicas holding a GPU: asked for (starting or ready) plus removed ones still draining."""
        draining = sum(1 for r in self.draining if r in self.pools[pool].replicas)
        return self.size(pool) + draining


# --------------------------------------------------------------------------- policies


def builtin_spec(settings: Settings) -> InferenceDeploymentSpec:
    s = settings
    return InferenceDeploymentSpec.model_validate(
        {
            "model": {"name": "sim-model", "source": {"uri": "/m"}},
            "prefill": {"minReplicas": 1, "maxReplicas": s.max_replicas, "replicas": 1},
            "decode": {"minReplicas": 1, "maxReplicas": s.max_replicas, "replicas": 1},
            "monitoring": {"intervalSeconds": 1},
            "autoscaling": {
                "enabled": True,
                "intervalSeconds": max(1, int(s.interval_s)),
                "scaleUpStabilizationSeconds": s.up_window_s,
                "scaleDownStabilizationSeconds": s.down_window_s,
                "maxStep": s.max_step,
                "tolerance": s.tolerance,
                "prefill": {"waitingPerReplica": 3, "ttftSloSeconds": s.ttft_slo_s},
                "decode": {
                    "runningPerReplica": 0.75 * s.decode_max_num_seqs,
                    "waitingPerReplica": 2,
                    "kvCacheUsage": 0.8,
                    "itlSloSeconds": s.itl_slo_s,
                },
            },
        }
    )


class KedaWaiting:
    """KEDA's recipe: AverageValue on sum(vllm:num_requests_waiting), HPA's algorithm, per pool."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.history: dict[str, list[tuple[float, int]]] = {pool: [] for pool in POOLS}

    async def decide(self, client: PrometheusClient, current: dict[str, int], now: float) -> dict[str, int]:
        s = self.settings
        desired = {}
        for pool in POOLS:
            query = f'sum(vllm:num_requests_waiting{{namespace="{NAMESPACE}",deployment="{NAME}",role="{pool}"}})'
            waiting = await client.query_scalar(query)
            size = current[pool]
            if waiting is None:
                desired[pool] = size
                continue
            ratio = waiting / (s.keda_waiting_threshold * size) if size else math.inf
            raw = size if abs(ratio - 1) <= s.tolerance else math.ceil(waiting / s.keda_waiting_threshold)
            raw = max(1, min(s.max_replicas, raw))
            history = [(t, n) for t, n in self.history[pool] if t >= now - s.down_window_s] + [(now, raw)]
            self.history[pool] = history
            up = min(n for t, n in history if t >= now - s.up_window_s)
            down = max(n for t, n in history)
            value = max(size, up) if size < up else min(size, down)
            desired[pool] = max(size - s.max_step, min(size + s.max_step, value))
        return desired


# --------------------------------------------------------------------------- load


@dataclass
class Result:
    sent: float
    prompt_tokens: int
    output_tokens: int
    ttft: float | None = None
    itl: float | None = None
    ok: bool = False


def prompt_text(tokens: int, rng: random.Random) -> str:
    return " ".join(f"w{rng.randrange(100000)}" for _ in range(tokens))


async def one_request(session: aiohttp.ClientSession, url: str, arrival: Arrival, start: float, result: Result) -> None:
    rng = random.Random(int(arrival.time * 1000))
    body = {
        "model": "sim-model",
        "prompt": prompt_text(arrival.prompt_tokens, rng),
        "max_tokens": arrival.output_tokens,
        "stream": True,
    }
    t0 = time.monotonic()
    first: float | None = None
    last = t0
    chunks = 0
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                await response.read()
                return
            async for line in response.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                now = time.monotonic()
                if first is None:
                    first = now
                last = now
                chunks += 1
        result.ok = chunks > 0
    except (TimeoutError, aiohttp.ClientError):
        return
    finally:
        if first is not None:
            result.ttft = first - t0
            result.itl = (last - first) / (chunks - 1) if chunks > 1 else 0.0


# --------------------------------------------------------------------------- one run


@dataclass
class RunRecord:
    policy: str
    timeline: list[dict[str, float]] = field(default_factory=list)
    results: list[Result] = field(default_factory=list)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    evaluations: list[dict[str, Any]] = field(default_factory=list)


async def run_policy(
    policy: str, settings: Settings, trace: list[Arrival], static_sizes: dict[str, int], workdir: Path
) -> RunRecord:
    record = RunRecord(policy)
    discovery = PushDiscovery()
    # Kubernetes-style discovery (so the router knows a prefill pool exists even while it is empty);
    # the endpoints come from PushDiscovery, not from DNS.
    router_config = RouterConfig(
        host="127.0.0.1",
        port=0,
        model="sim-model",
        discovery=DiscoveryKind.DNS,
        prefill_service=f"{NAME}-prefill",
        decode_service=f"{NAME}-decode",
        health_interval=0.5,
        queue_timeout=60.0,
        request_timeout=120.0,
    )
    router = Router(router_config, discovery=discovery)
    runner = web.AppRunner(build_app(router), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    router_port = int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
    router_url = f"http://127.0.0.1:{router_port}"
    prometheus = PrometheusServer(workdir / policy)
    cluster = Cluster(settings, prometheus, discovery, router_port)
    await cluster.start()
    initial = static_sizes if policy == "static-peak" else {"prefill": 1, "decode": 1}
    for pool in POOLS:
        cluster.scale(pool, initial[pool], -settings.startup_s)
    await cluster.publish(0.0)
    await prometheus.start()
    await prometheus.wait_for("count(up == 1)", lambda v: v == sum(initial.values()) + 1, limit_s=30)

    spec = builtin_spec(settings)
    keda = KedaWaiting(settings)
    state = AutoscalerState()
    begin = time.monotonic()

    def clock() -> float:
        return time.monotonic() - begin

    async def autoscale(client: PrometheusClient) -> None:
        nonlocal state
        while True:
            await asyncio.sleep(settings.interval_s)
            now = clock()
            current = {pool: cluster.size(pool) for pool in POOLS}
            if policy == "builtin":
                ready = {pool: len(cluster.pools[pool].ready(now)) for pool in POOLS}
                result = await evaluate(spec, NAMESPACE, NAME, current, state, now, client, ready=ready)
                state = result.state
                desired = result.desired
                reasons = result.reasons
                record.evaluations.append({"t": now, "reasons": reasons, "condition": result.condition.reason})
            elif policy == "keda-waiting":
                try:
                    desired = await keda.decide(client, current, now)
                except PrometheusUnavailable:
                    desired = current
                reasons = {}
            else:
                continue
            for pool in POOLS:
                if desired[pool] != current[pool]:
                    record.decisions.append(
                        {
                            "t": now,
                            "pool": pool,
                            "from": current[pool],
                            "to": desired[pool],
                            "reason": reasons.get(pool, ""),
                        }
                    )
                cluster.scale(pool, desired[pool], now)

    async def sample() -> None:
        while True:
            now = clock()
            await cluster.publish(now)
            row: dict[str, float] = {"t": now, "rate": rate_at(settings, min(now, settings.duration_s))}
            for pool in POOLS:
                row[f"{pool}_ready"] = len(cluster.pools[pool].ready(now))
                row[f"{pool}_billed"] = cluster.billed(pool)
                row[f"{pool}_waiting"] = sum(
                    r.worker.metric("vllm:num_requests_waiting") for r in cluster.pools[pool].replicas
                )
                row[f"{pool}_running"] = sum(
                    r.worker.metric("vllm:num_requests_running") for r in cluster.pools[pool].replicas
                )
            record.timeline.append(row)
            await asyncio.sleep(0.5)

    timeout = aiohttp.ClientTimeout(total=120)
    connector = aiohttp.TCPConnector(limit=0)
    async with (
        aiohttp.ClientSession(timeout=timeout, connector=connector) as session,
        PrometheusClient(prometheus.url, timeout=2.0) as client,
    ):
        background = [asyncio.create_task(autoscale(client)), asyncio.create_task(sample())]
        requests = []
        for arrival in trace:
            delay = arrival.time - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            result = Result(arrival.time, arrival.prompt_tokens, arrival.output_tokens)
            record.results.append(result)
            requests.append(asyncio.create_task(one_request(session, router_url, arrival, begin, result)))
        await asyncio.gather(*requests)
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
    prometheus.stop()
    await runner.cleanup()
    await cluster.stop()
    return record


# --------------------------------------------------------------------------- report


def summarize(record: RunRecord, settings: Settings) -> dict[str, Any]:
    results = record.results
    ok = [r for r in results if r.ok]
    ttft_ok = [r for r in ok if r.ttft is not None and r.ttft <= settings.ttft_slo_s]
    itl_ok = [r for r in ok if r.itl is not None and r.itl <= settings.itl_slo_s]
    both = [r for r in ttft_ok if r.itl is not None and r.itl <= settings.itl_slo_s]
    timeline = [row for row in record.timeline if row["t"] <= settings.duration_s]
    step = 0.5
    replica_seconds = {pool: sum(row[f"{pool}_billed"] for row in timeline) * step for pool in POOLS}
    reactions: dict[str, list[float | None]] = {pool: [] for pool in POOLS}
    for start, _length in settings.spikes:
        spike_t = start * settings.duration_s
        for pool in POOLS:
            before = max((row[f"{pool}_ready"] for row in timeline if row["t"] <= spike_t), default=0)
            after = [row["t"] for row in timeline if row["t"] > spike_t and row[f"{pool}_ready"] > before]
            reactions[pool].append(round(after[0] - spike_t, 1) if after else None)

    def pct(values: list[float], q: float) -> float | None:
        if not values:
            return None
        ordered = sorted(values)
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)

    return {
        "policy": record.policy,
        "requests": len(results),
        "succeeded": len(ok),
        "ttft_slo_attainment": round(len(ttft_ok) / len(results), 4) if results else None,
        "itl_slo_attainment": round(len(itl_ok) / len(results), 4) if results else None,
        "both_slo_attainment": round(len(both) / len(results), 4) if results else None,
        "ttft_p50_s": pct([r.ttft for r in ok if r.ttft is not None], 0.5),
        "ttft_p90_s": pct([r.ttft for r in ok if r.ttft is not None], 0.9),
        "ttft_p99_s": pct([r.ttft for r in ok if r.ttft is not None], 0.99),
        "itl_p90_s": pct([r.itl for r in ok if r.itl is not None], 0.9),
        "replica_seconds": {pool: round(v) for pool, v in replica_seconds.items()},
        "replica_seconds_total": round(sum(replica_seconds.values())),
        "max_replicas": {pool: max((row[f"{pool}_billed"] for row in timeline), default=0) for pool in POOLS},
        "reaction_s_to_first_new_ready_replica_per_spike": reactions,
        "scale_events": len(record.decisions),
    }


def plot(records: list[RunRecord], settings: Settings, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(records), 1, figsize=(11, 3.2 * len(records)), sharex=True, squeeze=False)
    for ax, record in zip(axes[:, 0], records, strict=True):
        timeline = record.timeline
        t = [row["t"] for row in timeline]
        ax.step(t, [row["decode_billed"] for row in timeline], where="post", label="decode replicas", color="tab:blue")
        ax.step(
            t, [row["prefill_billed"] for row in timeline], where="post", label="prefill replicas", color="tab:orange"
        )
        ax.set_ylabel("replicas")
        ax.set_ylim(0, settings.max_replicas + 1)
        twin = ax.twinx()
        twin.plot(t, [row["rate"] for row in timeline], color="grey", alpha=0.5, label="offered req/s")
        late = [
            (r.sent, r.ttft) for r in record.results if r.ok and r.ttft is not None and r.ttft > settings.ttft_slo_s
        ]
        failed = [r.sent for r in record.results if not r.ok]
        if late:
            twin.scatter([x for x, _ in late], [0.3] * len(late), marker="|", color="red", s=30, label="TTFT > SLO")
        if failed:
            twin.scatter(failed, [0.15] * len(failed), marker="x", color="black", s=15, label="failed")
        twin.set_ylabel("req/s")
        twin.set_ylim(0, settings.peak_rate + settings.spike_rate + 1)
        ax.set_title(record.policy)
        handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
        ax.legend(handles=handles, loc="upper left", fontsize=8)
    axes[-1, 0].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(out / "replicas.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    for record in records:
        values = sorted(r.ttft for r in record.results if r.ok and r.ttft is not None)
        if values:
            ax.plot(values, [i / len(values) for i in range(len(values))], label=record.policy)
    ax.axvline(settings.ttft_slo_s, color="red", linestyle="--", label="TTFT SLO")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "ttft_cdf.png", dpi=110)
    plt.close(fig)


async def run_all(settings: Settings, policies: list[str], workdir: Path) -> list[RunRecord]:
    trace = make_trace(settings)
    records: list[RunRecord] = []
    static_sizes = {"prefill": settings.max_replicas, "decode": settings.max_replicas}
    for policy in policies:
        builtin = next((r for r in records if r.policy == "builtin"), None)
        if policy == "static-peak" and builtin is not None:
            static_sizes = summarize(builtin, settings)["max_replicas"]
        stamp = time.strftime("%H:%M:%S")
        print(f"[{stamp}] {policy}: {len(trace)} requests over {settings.duration_s:.0f}s", flush=True)
        record = await run_policy(policy, settings, trace, static_sizes, workdir)
        records.append(record)
        print(json.dumps(summarize(record, settings)), flush=True)
    return records


def write_results(records: list[RunRecord], settings: Settings, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    summaries = [summarize(record, settings) for record in records]
    for record, summary in zip(records, summaries, strict=True):
        details = {
            "summary": summary,
            "decisions": record.decisions,
            "evaluations": record.evaluations,
            "timeline": record.timeline,
            "results": [dataclasses.asdict(r) for r in record.results],
        }
        (out / f"{record.policy}.json").write_text(json.dumps(details))
    document = {"settings": dataclasses.asdict(settings), "runs": summaries}
    (out / "summary.json").write_text(json.dumps(document, indent=2))
    plot(records, settings, out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--duration", type=float, default=240.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--policies",
        nargs="+",
        default=["builtin", "keda-waiting", "static-peak"],
        choices=["builtin", "keda-waiting", "static-peak"],
    )
    args = parser.parse_args()
    if shutil.which(PROMETHEUS_BINARY) is None:
        print(f"error: needs the {PROMETHEUS_BINARY!r} binary (apt-get install prometheus)", file=sys.stderr)
        return 2
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("error: needs matplotlib for the plots (pip install matplotlib)", file=sys.stderr)
        return 2
    settings = Settings(duration_s=args.duration, seed=args.seed)
    with tempfile.TemporaryDirectory(prefix="splitserve-bench-") as tmp:
        records = asyncio.run(run_all(settings, args.policies, Path(tmp)))
    write_results(records, settings, Path(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
