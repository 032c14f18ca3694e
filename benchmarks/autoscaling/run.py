"""Autoscaling evidence in real time: replay a bursty trace against HTTP simulator pools behind the
real router, with a real Prometheus scraping them, under three policies:

- builtin: splitserve's autoscaler (`splitserve.io.signals.evaluate`, unchanged) every interval;
- keda-waiting: what the usual KEDA recipe does (vLLM production-stack): per pool, one Prometheus
  trigger `sum(vllm:num_requests_waiting)` with an AverageValue threshold, HPA's algorithm
  (10% tolerance, same windows, step and interval as builtin);
- static-peak: both pools fixed at the largest size the builtin run asked for.

"Scaling" a pool moves simulated workers in and out of the router's endpoints (ready after a
start-up delay, as a pod that loads a model; removed ones are reported as terminating, refuse new
requests with 503 and drain) and of Prometheus' scrape targets.

Cost control (this runs on a small shared machine): each pool's simulators live in one process
(a SimFleet), the router in another, the clients and the autoscaler in this one, all on uvloop;
the engine is slowed (time_scale 25: a decode step of ~0.31 s) and the trace's rate is scaled to
it, with short outputs, so the harness streams well under 100 tokens per second. The control loop
is compressed 5x against production defaults (interval 3 s, scale-down window 60 s, start-up 18 s,
p90 windows 12 s) and the whole trace takes 6 minutes per policy. Every run records the machine's
load, each process's CPU time and the simulators' step lag, so a CPU-starved run shows itself.

    python benchmarks/autoscaling/run.py --out benchmarks/autoscaling/results      # ~21 minutes
    python benchmarks/autoscaling/run.py --duration 60 --policies builtin --out /tmp/short
    python benchmarks/autoscaling/run.py --smoke --out /tmp/smoke      # seconds: does it still run?

`--smoke`: the builtin policy (or --policies) over a SMOKE_DURATION_S trace, the engine 5x faster (so
the last answers are not long after the trace), the files to a temporary folder unless --out says where.

Needs the `prometheus` binary; the plots need matplotlib (`pip install 'splitserve[bench]'`), and
without it the JSON is written all the same.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.plots import pyplot  # noqa: E402
from splitserve.api.spec import InferenceDeploymentSpec  # noqa: E402
from splitserve.autoscaling.decision import AutoscalerState  # noqa: E402
from splitserve.io.prometheus import PrometheusClient, PrometheusUnavailable  # noqa: E402
from splitserve.io.signals import evaluate  # noqa: E402
from splitserve.local.procs import busy_ticks, cpu_seconds  # noqa: E402
from splitserve.router.discovery import UpdateCallback  # noqa: E402
from splitserve.sim import Role, SimConfig  # noqa: E402
from splitserve.sim.server import SimFleet, run_event_loop  # noqa: E402
from testkit.prometheus import PROMETHEUS_BINARY, PrometheusServer, ScrapeTarget  # noqa: E402

NAMESPACE, NAME = "bench", "bench"
POOLS = ("prefill", "decode")
POLICIES = ("builtin", "keda-waiting", "static-peak")
PROFILE = "gpu-h100-8b"
SMOKE_DURATION_S = 6.0


@dataclass(frozen=True)
class Settings:
    duration_s: float = 360.0
    seed: int = 7
    # Engine: gpu-h100-8b slowed 25x. Decode step = 25 * (12 ms + 0.06 ms * n) ~= 0.31 s at n <= 6;
    # prefill ~600 prompt tokens/s per replica (2048-token chunks of ~3.7 s).
    time_scale: float = 25.0
    decode_max_num_seqs: int = 6
    prefill_max_batched_tokens: int = 2048
    min_replicas: int = 1
    max_replicas: int = 8
    spare_replicas: int = 4  # extra simulators per pool so a draining one is never reused
    # Control loop, compressed 5x against production defaults (15 s, 300 s, ~90 s pod start, 1m windows).
    startup_s: float = 18.0
    interval_s: float = 3.0
    down_window_s: int = 60
    up_window_s: int = 0
    latency_window: str = "12s"
    max_step: int = 4
    tolerance: float = 0.1
    scrape_interval: str = "1s"
    # SLOs for attainment and the builtin's latency targets.
    ttft_slo_s: float = 6.0
    itl_slo_s: float = 0.45  # mean ITL per request (clients)
    # The autoscaler's ITL target is on the engines' per-token p90, which has a floor of ~0.55 s here:
    # a decode step in which a pulled request joins also computes its last prompt token and pays
    # the profile's prefill overhead (12 + 10 ms, x25). A target under that floor scales on noise.
    autoscaler_itl_slo_s: float = 0.65
    prefill_waiting_per_replica: float = 2.0
    decode_running_per_replica: float = 4.5  # 0.75 of the 6 slots, as virtual.py's 48 of 64
    keda_waiting_threshold: float = 5.0
    # Trace: diurnal hump base -> peak -> base, plus spikes; the shape of virtual.py's, 5x shorter.
    base_rate: float = 0.4
    peak_rate: float = 1.6
    spike_rate: float = 1.2  # added on top during a spike
    spikes: tuple[tuple[float, float], ...] = ((0.25, 30.0), (0.55, 30.0), (0.80, 24.0))  # (start fraction, seconds)
    prompt_median: int = 600
    output_median: int = 24
    sample_interval_s: float = 1.0

    @property
    def decode_step_s(self) -> float:
        """The profile's decode step at a full batch: the ITL an unstarved run should show."""
        from splitserve.sim.config import PROFILES

        latency = PROFILES[PROFILE].latency
        return self.time_scale * (latency.decode_base_s + latency.decode_per_seq_s * self.decode_max_num_seqs)


# --------------------------------------------------------------------------- trace


@dataclass(frozen=True)
class Arrival:
    time: float
    prompt_tokens: int
    output_tokens: int


def spike_windows(settings: Settings) -> list[tuple[float, float]]:
    return [(start * settings.duration_s, start * settings.duration_s + length) for start, length in settings.spikes]


def rate_at(settings: Settings, t: float) -> float:
    """Diurnal ramp (one sine hump over the trace) plus rectangular spikes."""
    frac = t / settings.duration_s
    rate = settings.base_rate + (settings.peak_rate - settings.base_rate) * math.sin(math.pi * frac) ** 2
    for start, end in spike_windows(settings):
        if start <= t < end:
            rate += settings.spike_rate
    return rate


def make_trace(settings: Settings) -> list[Arrival]:
    """Poisson arrivals (thinning); log-normal prompts (100-2048 tokens, one chunk) and outputs (8-64)."""
    rng = random.Random(settings.seed)
    top = settings.peak_rate + settings.spike_rate
    arrivals: list[Arrival] = []
    t = 0.0
    while True:
        t += rng.expovariate(top)
        if t >= settings.duration_s:
            return arrivals
        if rng.random() * top <= rate_at(settings, t):
            prompt = int(min(2048, max(100, rng.lognormvariate(math.log(settings.prompt_median), 0.6))))
            output = int(min(64, max(8, rng.lognormvariate(math.log(settings.output_median), 0.5))))
            arrivals.append(Arrival(t, prompt, output))


# --------------------------------------------------------------------------- child processes


def sim_configs(settings: Settings, pool: str) -> list[SimConfig]:
    role = Role.PREFILL if pool == "prefill" else Role.DECODE
    config = SimConfig.from_profile(PROFILE, role=role, time_scale=settings.time_scale, model="sim-model")
    if pool == "decode":
        limits = dataclasses.replace(config.limits, max_num_seqs=settings.decode_max_num_seqs)
    else:
        limits = dataclasses.replace(config.limits, max_num_batched_tokens=settings.prefill_max_batched_tokens)
    config = dataclasses.replace(config, limits=limits)
    return [dataclasses.replace(config, seed=i) for i in range(settings.max_replicas + settings.spare_replicas)]


async def serve_sims(settings: Settings, pool: str) -> None:
    """Child process: every simulator of one pool plus a control endpoint for the harness."""
    fleet = SimFleet(sim_configs(settings, pool))
    await fleet.start()
    by_url = {worker.url: worker for worker in fleet.workers}

    def sample(name: str, worker: Any) -> float:
        value = worker.engine.metrics.registry.get_sample_value(name) if worker.engine else None
        return float(value or 0.0)

    async def state(request: web.Request) -> web.Response:
        workers = [
            {
                "url": url,
                "in_flight": worker.in_flight,
                "held": worker.engine.num_held if worker.engine else 0,
                "waiting": worker.metric("vllm:num_requests_waiting"),
                "running": worker.metric("vllm:num_requests_running"),
                "steps": sample("splitserve_sim_steps_total", worker),
                "step_lag_s": sample("splitserve_sim_step_lag_seconds_total", worker),
            }
            for url, worker in by_url.items()
        ]
        return web.json_response({"workers": workers, "cpu_s": time.process_time()})

    async def set_draining(request: web.Request) -> web.Response:
        body = await request.json()
        for url, draining in body.items():
            by_url[url].draining = bool(draining)  # a terminating pod: 503 to new requests, in-flight ones finish
        return web.json_response({})

    await announce_and_wait(
        [web.get("/_bench/state", state), web.post("/_bench/draining", set_draining)], {"urls": list(by_url)}
    )
    await fleet.stop()


class PushDiscovery:
    """Router discovery whose endpoint sets the harness changes (as Kubernetes EndpointSlices would)."""

    def __init__(self) -> None:
        self._callback: UpdateCallback | None = None
        self._pending: dict[str, tuple[set[str], set[str]]] = {pool: (set(), set()) for pool in POOLS}

    async def run(self, on_update: UpdateCallback) -> None:
        self._callback = on_update
        for pool, (ready, terminating) in self._pending.items():
            on_update(pool, set(ready), set(terminating))

    def set(self, pool: str, ready: set[str], terminating: set[str]) -> None:
        self._pending[pool] = (set(ready), set(terminating))
        if self._callback is not None:
            self._callback(pool, set(ready), set(terminating))


async def serve_router(settings: Settings) -> None:
    """Child process: the real router, its endpoints pushed by the harness."""
    from splitserve.router.app import Router, RouterServer
    from splitserve.router.config import DiscoveryKind, RouterConfig
    from splitserve.router.httpserver import Request

    discovery = PushDiscovery()
    # Kubernetes-style discovery (so the router knows a prefill pool exists even while it is empty);
    # the endpoints come from PushDiscovery, not from DNS.
    config = RouterConfig(
        host="127.0.0.1",
        port=0,
        model="sim-model",
        discovery=DiscoveryKind.DNS,
        prefill_service=f"{NAME}-prefill",
        decode_service=f"{NAME}-decode",
        queue_timeout=120.0,
        request_timeout=300.0,
    )

    async def endpoints(request: Request) -> None:
        for pool, sets in orjson.loads(request.body).items():
            discovery.set(pool, set(sets["ready"]), set(sets["terminating"]))
        request.respond_json({})

    async def cpu(request: Request) -> None:
        request.respond_json({"cpu_s": time.process_time()})

    bench_routes = {"/_bench/endpoints": {"POST": endpoints}, "/_bench/cpu": {"GET": cpu}}
    server = RouterServer(Router(config, discovery=discovery), extra_routes=bench_routes)
    port = await server.start("127.0.0.1", 0)
    print(json.dumps({"url": f"http://127.0.0.1:{port}"}), flush=True)
    await wait_for_signal()
    await server.close()


async def announce_and_wait(routes: list[web.RouteDef], announcement: dict[str, Any]) -> None:
    app = web.Application()
    app.add_routes(routes)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
    print(json.dumps({**announcement, "control": f"http://127.0.0.1:{port}"}), flush=True)
    await wait_for_signal()
    await runner.cleanup()


async def wait_for_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()


@dataclass
class Child:
    name: str
    process: asyncio.subprocess.Process
    info: dict[str, Any]

    @classmethod
    async def start(cls, name: str, role: str, settings: Settings) -> Child:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--serve",
            role,
            "--settings",
            json.dumps(dataclasses.asdict(settings)),
            stdout=asyncio.subprocess.PIPE,
        )
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), 60)
        if not line:
            raise RuntimeError(f"{name} process exited before it was ready")
        return cls(name, process, json.loads(line))

    async def stop(self) -> None:
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), 15)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()


# --------------------------------------------------------------------------- the cluster stand-in


@dataclass
class Replica:
    url: str
    ready_at: float | None = None  # None: not asked for
    removed_at: float | None = None
    draining: bool = False  # removed and still has work (in flight or KV held for a decode pull)


@dataclass
class Pool:
    name: str
    replicas: list[Replica]

    def active(self) -> list[Replica]:
        return [r for r in self.replicas if r.ready_at is not None]

    def ready(self, now: float) -> list[Replica]:
        return [r for r in self.active() if r.ready_at is not None and r.ready_at <= now]


class Cluster:
    """Deployments stand-in: which simulators are asked for, ready, or terminating."""

    def __init__(self, settings: Settings, sims: dict[str, Child], router: Child, prometheus: PrometheusServer):
        self.settings = settings
        self.sims = sims
        self.router = router
        self.prometheus = prometheus
        self.pools = {pool: Pool(pool, [Replica(url) for url in sims[pool].info["urls"]]) for pool in POOLS}
        self.events: list[dict[str, Any]] = []  # replica asked for / ready / removed / drained
        self._published: dict[str, tuple[frozenset[str], frozenset[str]]] = {}
        self.last_state: dict[str, list[dict[str, Any]]] = {pool: [] for pool in POOLS}

    def size(self, pool: str) -> int:
        return len(self.pools[pool].active())

    def scale(self, pool: str, desired: int, now: float) -> None:
        replicas = self.pools[pool]
        active = replicas.active()
        if desired > len(active):
            idle = [r for r in replicas.replicas if r.ready_at is None and not r.draining]
            if len(idle) < desired - len(active):
                raise RuntimeError(f"{pool}: not enough idle simulators (raise spare_replicas)")
            for replica in idle[: desired - len(active)]:
                replica.ready_at = now + self.settings.startup_s
                replica.removed_at = None
                self.events.append({"t": now, "pool": pool, "event": "asked", "url": replica.url})
        elif desired < len(active):
            # Not-ready first, then the youngest, as a ReplicaSet picks pods to delete.
            def order(r: Replica) -> tuple[bool, float]:
                return (r.ready_at is not None and r.ready_at <= now, -(r.ready_at or 0.0))

            for replica in sorted(active, key=order)[: len(active) - desired]:
                was_ready = replica.ready_at is not None and replica.ready_at <= now
                replica.ready_at = None
                replica.removed_at = now
                replica.draining = was_ready
                self.events.append({"t": now, "pool": pool, "event": "removed", "url": replica.url})

    async def refresh(self, session: aiohttp.ClientSession, now: float) -> None:
        """Read the simulators' state, finish drains, push endpoint changes to the router and Prometheus."""
        for pool in POOLS:
            async with session.get(f"{self.sims[pool].info['control']}/_bench/state") as reply:
                state = await reply.json()
            self.last_state[pool] = state["workers"]
            busy = {w["url"] for w in state["workers"] if w["in_flight"] > 0 or w["held"] > 0}
            for replica in self.pools[pool].replicas:
                if replica.draining and replica.url not in busy:
                    replica.draining = False
                    self.events.append({"t": now, "pool": pool, "event": "drained", "url": replica.url})
        changed = False
        for pool, replicas in self.pools.items():
            ready = frozenset(r.url for r in replicas.ready(now))
            terminating = frozenset(r.url for r in replicas.replicas if r.draining)
            previous = self._published.get(pool)
            if previous == (ready, terminating):
                continue
            changed = True
            for url in ready - (previous[0] if previous else frozenset()):
                self.events.append({"t": now, "pool": pool, "event": "ready", "url": url})
            self._published[pool] = (ready, terminating)
        if changed:
            # A replica joins: its engine accepts work before the router sends any. A replica leaves:
            # the router stops sending before the engine refuses (a pod's preStop delay does that).
            await self._set_draining(session, draining=False)
            body = {pool: {"ready": sorted(r), "terminating": sorted(t)} for pool, (r, t) in self._published.items()}
            async with session.post(f"{self.router.info['url']}/_bench/endpoints", json=body) as reply:
                reply.raise_for_status()
            # Terminating pods leave the PodMonitor's targets; only ready ones are scraped.
            targets = [
                ScrapeTarget(url.removeprefix("http://"), {"namespace": NAMESPACE, "deployment": NAME, "role": pool})
                for pool, (ready_urls, _) in self._published.items()
                for url in sorted(ready_urls)
            ]
            router_address = self.router.info["url"].removeprefix("http://")
            targets.append(ScrapeTarget(router_address, {"namespace": NAMESPACE, "deployment": NAME}))
            self.prometheus.targets = targets
            with contextlib.suppress(Exception):
                await self.prometheus.reload()
            await self._set_draining(session, draining=True)

    async def _set_draining(self, session: aiohttp.ClientSession, draining: bool) -> None:
        for pool, (ready, _) in self._published.items():
            flags = {r.url: True for r in self.pools[pool].replicas if r.url not in ready} if draining else {}
            flags.update({url: False for url in ready} if not draining else {})
            async with session.post(f"{self.sims[pool].info['control']}/_bench/draining", json=flags) as reply:
                reply.raise_for_status()

    def billed(self, pool: str) -> int:
        """Replicas holding a GPU: asked for (starting or ready) plus removed ones still draining."""
        return self.size(pool) + sum(1 for r in self.pools[pool].replicas if r.draining)


# --------------------------------------------------------------------------- policies


def builtin_spec(settings: Settings) -> InferenceDeploymentSpec:
    s = settings
    window = s.latency_window
    return InferenceDeploymentSpec.model_validate(
        {
            "model": {"name": "sim-model", "source": {"uri": "/m"}},
            "prefill": {"minReplicas": s.min_replicas, "maxReplicas": s.max_replicas, "replicas": 1},
            "decode": {"minReplicas": s.min_replicas, "maxReplicas": s.max_replicas, "replicas": 1},
            "monitoring": {"intervalSeconds": 1},
            "autoscaling": {
                "enabled": True,
                "intervalSeconds": max(1, int(s.interval_s)),
                "scaleUpStabilizationSeconds": s.up_window_s,
                "scaleDownStabilizationSeconds": s.down_window_s,
                "maxStep": s.max_step,
                "tolerance": s.tolerance,
                "prefill": {"waitingPerReplica": s.prefill_waiting_per_replica, "ttftSloSeconds": s.ttft_slo_s},
                "decode": {
                    "runningPerReplica": s.decode_running_per_replica,
                    "waitingPerReplica": 2,
                    "kvCacheUsage": 0.8,
                    "itlSloSeconds": s.autoscaler_itl_slo_s,
                },
                # The default p90 windows are [1m]; compressed with the rest of the control loop.
                "queries": {
                    "ttftP90": "histogram_quantile(0.9, sum by (le) "
                    f"(rate(vllm:time_to_first_token_seconds_bucket{{$workers}}[{window}])))",
                    "itlP90": "histogram_quantile(0.9, sum by (le) "
                    f"(rate(vllm:inter_token_latency_seconds_bucket{{$workers}}[{window}])))",
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
            raw = max(s.min_replicas, min(s.max_replicas, raw))
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
    tokens: int = 0
    ok: bool = False
    error: str = ""


async def one_request(session: aiohttp.ClientSession, url: str, arrival: Arrival, result: Result) -> None:
    # Token ids, not text: no tokenizer work in the simulators, and no prefix shared between prompts.
    rng = random.Random(int(arrival.time * 1000))
    body = {
        "model": "sim-model",
        "prompt": [rng.randrange(32000) for _ in range(arrival.prompt_tokens)],
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
                result.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
                return
            async for line in response.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                if b'"error"' in line:
                    result.error = line[:200].decode(errors="replace")
                    return
                now = time.monotonic()
                if first is None:
                    first = now
                last = now
                chunks += 1
        result.ok = chunks == arrival.output_tokens
        if not result.ok:
            result.error = f"{chunks} of {arrival.output_tokens} tokens"
    except (TimeoutError, aiohttp.ClientError) as error:
        result.error = repr(error)[:200]
    finally:
        result.tokens = chunks
        if first is not None:
            result.ttft = first - t0
            result.itl = (last - first) / (chunks - 1) if chunks > 1 else None


# --------------------------------------------------------------------------- one run


@dataclass
class RunRecord:
    policy: str
    timeline: list[dict[str, float]] = field(default_factory=list)
    results: list[Result] = field(default_factory=list)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    evaluations: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    cpu: dict[str, Any] = field(default_factory=dict)


async def run_policy(
    policy: str, settings: Settings, trace: list[Arrival], static_sizes: dict[str, int], workdir: Path
) -> RunRecord:
    record = RunRecord(policy)
    # The children start side by side (each imports splitserve: seconds on a small machine).
    *pools, router = await asyncio.gather(
        *(Child.start(f"{pool} sims", f"sims-{pool}", settings) for pool in POOLS),
        Child.start("router", "router", settings),
    )
    sims = dict(zip(POOLS, pools, strict=True))
    prometheus = PrometheusServer(workdir / policy, scrape_interval=settings.scrape_interval)
    cluster = Cluster(settings, sims, router, prometheus)
    timeout = aiohttp.ClientTimeout(total=300)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session,
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as control,
            PrometheusClient(prometheus.url, timeout=2.0) as client,
        ):
            initial = static_sizes if policy == "static-peak" else {pool: settings.min_replicas for pool in POOLS}
            for pool in POOLS:
                cluster.scale(pool, initial[pool], -settings.startup_s)
            await prometheus.start()
            await cluster.refresh(control, 0.0)
            await prometheus.wait_for("count(up == 1)", lambda v: v == sum(initial.values()) + 1, limit_s=30)
            cluster.events.clear()
            await run_trace(record, policy, settings, trace, cluster, session, control, client)
    finally:
        prometheus.stop()
        for child in [router, *sims.values()]:
            await child.stop()
    record.events = cluster.events
    return record


async def run_trace(
    record: RunRecord,
    policy: str,
    settings: Settings,
    trace: list[Arrival],
    cluster: Cluster,
    session: aiohttp.ClientSession,
    control: aiohttp.ClientSession,
    client: PrometheusClient,
) -> None:
    spec = builtin_spec(settings)
    keda = KedaWaiting(settings)
    state = AutoscalerState()
    pids = {"harness": os.getpid(), "router": cluster.router.process.pid}
    pids.update({f"sims-{pool}": child.process.pid for pool, child in cluster.sims.items()})
    if cluster.prometheus.process is not None:
        pids["prometheus"] = cluster.prometheus.process.pid
    cpu_start = {name: cpu_seconds([pid]) for name, pid in pids.items()}
    busy_start = busy_ticks()
    begin = time.monotonic()
    router_url = cluster.router.info["url"]

    def clock() -> float:
        return time.monotonic() - begin

    async def autoscale() -> None:
        nonlocal state
        while True:
            await asyncio.sleep(settings.interval_s - (clock() % settings.interval_s))
            now = clock()
            current = {pool: cluster.size(pool) for pool in POOLS}
            reasons: dict[str, str] = {}
            if policy == "builtin":
                ready = {pool: len(cluster.pools[pool].ready(now)) for pool in POOLS}
                result = await evaluate(spec, NAMESPACE, NAME, current, state, now, client, ready=ready)
                state = result.state
                desired = result.desired
                reasons = result.reasons
                record.evaluations.append(
                    {"t": now, "reasons": reasons, "condition": result.condition.reason, "signals": result.signals}
                )
            elif policy == "keda-waiting":
                try:
                    desired = await keda.decide(client, current, now)
                except PrometheusUnavailable:
                    desired = current
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
                            "reason": reasons.get(pool),
                        }
                    )
                    cluster.scale(pool, desired[pool], now)

    async def sample() -> None:
        previous_busy = busy_ticks()
        while True:
            now = clock()
            await cluster.refresh(control, now)
            busy = busy_ticks()
            row: dict[str, float] = {
                "t": now,
                "rate": rate_at(settings, now) if now < settings.duration_s else 0.0,
                "load1": os.getloadavg()[0],
                "machine_busy": (busy[0] - previous_busy[0]) / max(1, busy[1] - previous_busy[1]),
                "awaiting_first_token": sum(1 for r in record.results if r.ttft is None and not r.error and not r.ok),
            }
            previous_busy = busy
            for pool in POOLS:
                workers = cluster.last_state[pool]
                row[f"{pool}_size"] = cluster.size(pool)
                row[f"{pool}_ready"] = len(cluster.pools[pool].ready(now))
                row[f"{pool}_billed"] = cluster.billed(pool)
                row[f"{pool}_waiting"] = sum(w["waiting"] for w in workers)
                row[f"{pool}_running"] = sum(w["running"] for w in workers)
                row[f"{pool}_steps"] = sum(w["steps"] for w in workers)
                row[f"{pool}_step_lag_s"] = sum(w["step_lag_s"] for w in workers)
            record.timeline.append(row)
            await asyncio.sleep(settings.sample_interval_s - (clock() % settings.sample_interval_s))

    background = [asyncio.create_task(autoscale()), asyncio.create_task(sample())]
    requests = []
    for arrival in trace:
        delay = arrival.time - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        result = Result(arrival.time, arrival.prompt_tokens, arrival.output_tokens)
        record.results.append(result)
        requests.append(asyncio.create_task(one_request(session, router_url, arrival, result)))
    await asyncio.gather(*requests)
    wall = clock()
    for task in background:
        task.cancel()
    await asyncio.gather(*background, return_exceptions=True)
    busy_end = busy_ticks()
    cores = os.cpu_count() or 1
    record.cpu = {
        "wall_s": round(wall, 1),
        "cores": cores,
        "cpu_s": {name: round(cpu_seconds([pid]) - cpu_start[name], 1) for name, pid in pids.items()},
        "machine_busy_fraction": round((busy_end[0] - busy_start[0]) / max(1, busy_end[1] - busy_start[1]), 3),
    }
    record.cpu["harness_share_of_machine"] = round(sum(record.cpu["cpu_s"].values()) / (wall * cores), 3)


# --------------------------------------------------------------------------- report


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def reactions(record: RunRecord, settings: Settings) -> dict[str, list[dict[str, float | None]]]:
    """Per spike and pool: seconds from the spike's start to the first scale-up decision that could
    have seen it (one scrape interval later or more; the ticks are aligned with the spike starts) and
    to the first replica asked for by that decision being ready. None: no scale-up before the next spike."""
    windows = spike_windows(settings)
    scrape_s = float(settings.scrape_interval.removesuffix("s"))
    out: dict[str, list[dict[str, float | None]]] = {pool: [] for pool in POOLS}
    for index, (start, _end) in enumerate(windows):
        horizon = windows[index + 1][0] if index + 1 < len(windows) else settings.duration_s + 60
        for pool in POOLS:
            ups = [
                d["t"]
                for d in record.decisions
                if d["pool"] == pool and d["to"] > d["from"] and start + scrape_s <= d["t"] < horizon
            ]
            if not ups:
                out[pool].append({"to_decision_s": None, "to_ready_s": None})
                continue
            asked = {
                e["url"] for e in record.events if e["pool"] == pool and e["event"] == "asked" and e["t"] == ups[0]
            }
            readies = [
                e["t"]
                for e in record.events
                if e["pool"] == pool and e["event"] == "ready" and e["url"] in asked and e["t"] >= ups[0]
            ]
            ready = round(min(readies) - start, 1) if readies else None
            out[pool].append({"to_decision_s": round(ups[0] - start, 1), "to_ready_s": ready})
    return out


def reversals(decisions: list[dict[str, Any]], pool: str) -> int:
    signs = [1 if d["to"] > d["from"] else -1 for d in decisions if d["pool"] == pool]
    return sum(1 for a, b in itertools.pairwise(signs) if a != b)


def summarize(record: RunRecord, settings: Settings) -> dict[str, Any]:
    results = record.results
    ok = [r for r in results if r.ok]
    n = len(results) or 1
    ttft_ok = [r for r in ok if r.ttft is not None and r.ttft <= settings.ttft_slo_s]
    itl_ok = [r for r in ok if r.itl is None or r.itl <= settings.itl_slo_s]
    both = [r for r in ttft_ok if r.itl is None or r.itl <= settings.itl_slo_s]
    timeline = [row for row in record.timeline if row["t"] <= settings.duration_s]
    replica_seconds = {pool: 0.0 for pool in POOLS}
    for row, following in itertools.pairwise(timeline):
        for pool in POOLS:
            replica_seconds[pool] += row[f"{pool}_billed"] * (following["t"] - row["t"])
    first, last = (record.timeline[0], record.timeline[-1]) if record.timeline else ({}, {})
    steps = {pool: last.get(f"{pool}_steps", 0.0) - first.get(f"{pool}_steps", 0.0) for pool in POOLS}
    lags = {pool: last.get(f"{pool}_step_lag_s", 0.0) - first.get(f"{pool}_step_lag_s", 0.0) for pool in POOLS}
    itls = [r.itl for r in ok if r.itl is not None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    loads = [row["load1"] for row in record.timeline]
    busy = [row["machine_busy"] for row in record.timeline[1:]]
    return {
        "policy": record.policy,
        "requests": len(results),
        "succeeded": len(ok),
        "failed": len(results) - len(ok),
        # Timeouts are overload (a request that waited longer than the router's or the client's limit);
        # anything else (a 503 from a terminating replica, a cut stream) would be a scaling fault.
        "failed_timeouts": sum(1 for r in results if not r.ok and "Timeout" in r.error),
        "failures": sorted({r.error for r in results if not r.ok})[:5],
        "ttft_slo_attainment": round(len(ttft_ok) / n, 4),
        "itl_slo_attainment": round(len(itl_ok) / n, 4),
        "both_slo_attainment": round(len(both) / n, 4),
        "ttft_p50_s": pct(ttfts, 0.5),
        "ttft_p90_s": pct(ttfts, 0.9),
        "ttft_p99_s": pct(ttfts, 0.99),
        "itl_p50_s": pct(itls, 0.5),
        "itl_p90_s": pct(itls, 0.9),
        "itl_p99_s": pct(itls, 0.99),
        "profile_decode_step_s": round(settings.decode_step_s, 3),
        "replica_seconds": {pool: round(v) for pool, v in replica_seconds.items()},
        "replica_seconds_total": round(sum(replica_seconds.values())),
        "max_size": {pool: max((int(row[f"{pool}_size"]) for row in timeline), default=0) for pool in POOLS},
        "reaction_per_spike": reactions(record, settings),
        "scale_events": {pool: sum(1 for d in record.decisions if d["pool"] == pool) for pool in POOLS},
        "direction_reversals": {pool: reversals(record.decisions, pool) for pool in POOLS},
        "sim_mean_step_lag_ms": {pool: round(1000 * lags[pool] / max(1.0, steps[pool]), 1) for pool in POOLS},
        "load1_mean_max": [round(sum(loads) / max(1, len(loads)), 2), round(max(loads, default=0.0), 2)],
        "machine_busy_mean": round(sum(busy) / max(1, len(busy)), 3),
        "cpu": record.cpu,
    }


def plot(records: list[RunRecord], settings: Settings, out: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(len(records), 1, figsize=(11, 3.0 * len(records)), sharex=True, squeeze=False)
    for ax, record in zip(axes[:, 0], records, strict=True):
        timeline = record.timeline
        t = [row["t"] for row in timeline]
        for pool, color in (("decode", "tab:blue"), ("prefill", "tab:orange")):
            ax.step(t, [row[f"{pool}_billed"] for row in timeline], where="post", color=color, label=f"{pool} billed")
            ax.step(
                t,
                [row[f"{pool}_ready"] for row in timeline],
                where="post",
                color=color,
                linestyle=":",
                label=f"{pool} ready",
            )
        ax.set_ylabel("replicas")
        ax.set_ylim(0, settings.max_replicas + 1)
        twin = ax.twinx()
        twin.plot(t, [row["rate"] for row in timeline], color="grey", alpha=0.6, label="offered req/s")
        for start, end in spike_windows(settings):
            ax.axvspan(start, end, color="grey", alpha=0.12)
        twin.set_ylabel("req/s")
        twin.set_ylim(0, settings.peak_rate + settings.spike_rate + 0.5)
        ax.set_title(record.policy)
        handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
        ax.legend(handles=handles, loc="upper left", fontsize=7, ncol=5)
    axes[-1, 0].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(out / "run_replicas.png", dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(len(records), 1, figsize=(11, 2.6 * len(records)), sharex=True, squeeze=False)
    for ax, record in zip(axes[:, 0], records, strict=True):
        good = [(r.sent, r.ttft) for r in record.results if r.ok and r.ttft is not None]
        ax.scatter([x for x, _ in good], [y for _, y in good], s=4, color="tab:green", label="TTFT")
        failed = [r.sent for r in record.results if not r.ok]
        if failed:
            ax.scatter(failed, [settings.ttft_slo_s] * len(failed), marker="x", color="black", s=20, label="failed")
        ax.axhline(settings.ttft_slo_s, color="red", linestyle="--", label="TTFT SLO")
        for start, end in spike_windows(settings):
            ax.axvspan(start, end, color="grey", alpha=0.12)
        ax.set_yscale("log")
        ax.set_ylabel("TTFT (s)")
        ax.set_title(record.policy)
        ax.legend(loc="upper left", fontsize=7)
    axes[-1, 0].set_xlabel("request sent at (s)")
    fig.tight_layout()
    fig.savefig(out / "run_ttft.png", dpi=100)
    plt.close(fig)


async def run_all(settings: Settings, policies: list[str], workdir: Path, out: Path) -> list[RunRecord]:
    trace = make_trace(settings)
    records: list[RunRecord] = []
    static_sizes = {pool: settings.max_replicas for pool in POOLS}
    for policy in policies:
        builtin = next((r for r in records if r.policy == "builtin"), None)
        if policy == "static-peak" and builtin is not None:
            static_sizes = summarize(builtin, settings)["max_size"]
        stamp = time.strftime("%H:%M:%S")
        print(f"[{stamp}] {policy}: {len(trace)} requests over {settings.duration_s:.0f}s", flush=True)
        record = await run_policy(policy, settings, trace, static_sizes, workdir)
        records.append(record)
        print(json.dumps(summarize(record, settings)), flush=True)
        write_results(records, settings, out)  # after every policy, so a cut-short run keeps what it has
    return records


def settings_from_json(raw: dict[str, Any]) -> Settings:
    raw = dict(raw)
    raw["spikes"] = tuple(tuple(spike) for spike in raw["spikes"])
    return Settings(**raw)


def load_records(out: Path) -> tuple[Settings, list[RunRecord], str]:
    """The runs a previous invocation wrote to `out`, to summarize and plot them again."""
    document = json.loads((out / "run_summary.json").read_text())
    records = []
    for summary in document["runs"]:
        details = json.loads((out / f"run_{summary['policy']}.json").read_text())
        records.append(
            RunRecord(
                policy=summary["policy"],
                timeline=details["timeline"],
                results=[Result(**r) for r in details["results"]],
                decisions=details["decisions"],
                evaluations=details["evaluations"],
                events=details["events"],
                cpu=summary["cpu"],
            )
        )
    return settings_from_json(document["settings"]), records, document["command"]


def write_results(records: list[RunRecord], settings: Settings, out: Path, command: str | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    summaries = [summarize(record, settings) for record in records]
    for record, summary in zip(records, summaries, strict=True):
        details = {
            "summary": summary,
            "decisions": record.decisions,
            "events": record.events,
            "evaluations": record.evaluations,
            "timeline": record.timeline,
            "results": [dataclasses.asdict(r) for r in record.results],
        }
        (out / f"run_{record.policy}.json").write_text(json.dumps(details))
    document = {
        "command": command or " ".join(sys.argv),
        "settings": dataclasses.asdict(settings),
        "profile_decode_step_s": round(settings.decode_step_s, 3),
        "runs": summaries,
    }
    (out / "run_summary.json").write_text(json.dumps(document, indent=2))
    plot(records, settings, out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="results folder (default: results/ here)")
    parser.add_argument("--duration", type=float, default=Settings.duration_s)
    parser.add_argument("--seed", type=int, default=Settings.seed)
    parser.add_argument(
        "--policies",
        nargs="+",
        default=None,
        choices=POLICIES,
        help=f"default: {' '.join(POLICIES)} (--smoke: builtin)",
    )
    parser.add_argument(
        "--from-json", action="store_true", help="summarize and plot the runs already in --out again (no new run)"
    )
    parser.add_argument("--smoke", action="store_true", help="a few seconds: does the benchmark still run?")
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # child process roles: sims-prefill, sims-decode, router
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.duration, args.policies = SMOKE_DURATION_S, args.policies or ["builtin"]
        args.out = args.out or tempfile.mkdtemp(prefix="autoscaling-run-smoke-")
    args.policies = args.policies or list(POLICIES)
    out = Path(args.out or Path(__file__).parent / "results")
    if args.serve:
        child_settings = settings_from_json(json.loads(args.settings))
        if args.serve == "router":
            run_event_loop(lambda: serve_router(child_settings))
        else:
            run_event_loop(lambda: serve_sims(child_settings, args.serve.removeprefix("sims-")))
        return 0
    if args.from_json:
        try:
            settings, records, command = load_records(out)
        except (OSError, ValueError, KeyError) as error:
            print(f"error: cannot read the runs in {out}: {error}", file=sys.stderr)
            return 2
        write_results(records, settings, out, command)
        return 0
    if shutil.which(PROMETHEUS_BINARY) is None:
        print(f"error: needs the {PROMETHEUS_BINARY!r} binary (apt-get install prometheus)", file=sys.stderr)
        return 2
    settings = Settings(duration_s=args.duration, seed=args.seed)
    if args.smoke:
        settings = dataclasses.replace(settings, time_scale=5.0)
    if args.duration != Settings.duration_s:
        # A shorter smoke run keeps spikes proportionate.
        factor = args.duration / Settings.duration_s
        settings = dataclasses.replace(settings, spikes=tuple((s, length * factor) for s, length in settings.spikes))
    with tempfile.TemporaryDirectory(prefix="splitserve-bench-") as tmp:
        run_event_loop(lambda: run_all(settings, args.policies, Path(tmp), out))
    print(f"results written to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
