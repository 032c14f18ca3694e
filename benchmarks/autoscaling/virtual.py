"""Autoscaling evidence in virtual time: the simulator's own continuous-batching scheduler
(`splitserve.sim.scheduler.Scheduler`, the same code the HTTP sim workers run) and its latency
model, driven by a discrete-event loop, with the autoscaler's decision code in the loop.

Why virtual time: on a shared 2-core machine a real-time replay (run.py: HTTP sims, router,
Prometheus) measures CPU starvation more than autoscaling. Here an hour of traffic takes about a
minute, is deterministic for a seed, and uses the real defaults (15 s interval, 300 s scale-down
window, 90 s replica start-up).

What is simplified: the router is least-loaded with an unbounded queue when a pool has no ready
replica; Prometheus is a snapshot of the pool's numbers every scrape interval (15 s) with TTFT /
ITL p90 over the last 60 s of observations, as `histogram_quantile(rate(...[1m]))` would give;
KV transfer takes the latency model's transfer time; scaled-down replicas drain (they finish what
they hold and take no new work) and are billed until empty.

    python benchmarks/autoscaling/virtual.py --out benchmarks/autoscaling/results
    python benchmarks/autoscaling/virtual.py --smoke --out /tmp/virtual   # 5 virtual minutes: does it still run?

Plots need matplotlib (`pip install 'splitserve[bench]'`); without it the JSON is written all the same.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
import json
import math
import random
import sys
import tempfile
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.plots import pyplot  # noqa: E402
from splitserve.api.spec import InferenceDeploymentSpec  # noqa: E402
from splitserve.autoscaling.decision import AutoscalerState, decide_replicas  # noqa: E402
from splitserve.autoscaling.queries import PoolSignals  # noqa: E402
from splitserve.sim.config import PROFILES, LatencyModel  # noqa: E402
from splitserve.sim.scheduler import Scheduler, Sequence  # noqa: E402

POOLS = ("prefill", "decode")
POLICIES = ("builtin", "keda-waiting", "static-peak")
SMOKE_DURATION_S = 300.0  # --smoke: the same trace's shape, 12x shorter


@dataclass(frozen=True)
class Settings:
    duration_s: float = 3600.0
    seed: int = 11
    time_scale: float = 10.0  # the H100-8B profile 10x slower: a decode step of ~16 ms becomes ~160 ms
    decode_max_num_seqs: int = 64
    prefill_max_batched_tokens: int = 2048
    max_replicas: int = 10
    startup_s: float = 90.0
    scrape_s: float = 15.0
    interval_s: int = 15
    down_window_s: int = 300
    max_step: int = 4
    tolerance: float = 0.1
    ttft_slo_s: float = 5.0  # a lone p90 prompt (~2600 tokens) takes ~3 s to prefill at this speed
    itl_slo_s: float = 0.25
    prefill_prompts_per_replica: float = 2.0
    decode_running_per_replica: float = 48.0
    keda_waiting_threshold: float = 5.0
    base_rate: float = 0.6
    peak_rate: float = 4.0
    spike_rate: float = 3.0
    spikes: tuple[tuple[float, float], ...] = ((0.25, 0.05), (0.55, 0.05), (0.8, 0.04))


def rate_at(s: Settings, t: float) -> float:
    frac = t / s.duration_s
    rate = s.base_rate + (s.peak_rate - s.base_rate) * math.sin(math.pi * frac) ** 2
    for start, length in s.spikes:
        if start <= frac < start + length:
            rate += s.spike_rate
    return rate


@dataclass
class Request:
    id: int
    arrival: float
    prompt_tokens: int
    output_tokens: int
    prefill_engine: Engine | None = None
    prefill_seq: Sequence | None = None
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0
    done: float | None = None


def make_trace(s: Settings) -> list[Request]:
    rng = random.Random(s.seed)
    top = s.peak_rate + s.spike_rate
    out: list[Request] = []
    t = 0.0
    while True:
        t += rng.expovariate(top)
        if t >= s.duration_s:
            return out
        if rng.random() * top <= rate_at(s, t):
            prompt = int(min(4000, max(100, rng.lognormvariate(math.log(1200), 0.6))))
            output = int(min(400, max(8, rng.lognormvariate(math.log(100), 0.7))))
            out.append(Request(len(out), t, prompt, output))


class Simulation:
    def __init__(self, s: Settings, policy: str, static: dict[str, int]) -> None:
        self.s = s
        self.policy = policy
        self.events: list[tuple[float, int, Callable[[], None]]] = []
        self.counter = itertools.count()
        self.now = 0.0
        profile = PROFILES["gpu-h100-8b"]
        self.latency: LatencyModel = profile.latency
        self.limits = {
            "prefill": dataclasses.replace(
                profile.limits, max_num_batched_tokens=s.prefill_max_batched_tokens, enable_prefix_caching=False
            ),
            "decode": dataclasses.replace(
                profile.limits, max_num_seqs=s.decode_max_num_seqs, enable_prefix_caching=False
            ),
        }
        self.engines: dict[str, list[Engine]] = {pool: [] for pool in POOLS}
        self.router_queue: dict[str, deque[Request]] = {pool: deque() for pool in POOLS}
        self.ttft_obs: deque[tuple[float, float]] = deque()  # prefill TTFT at the prefill workers
        self.itl_obs: deque[tuple[float, float]] = deque()  # token gaps at the decode workers
        self.snapshot: dict[str, PoolSignals] = {}
        self.state = AutoscalerState()
        self.keda_history: dict[str, list[tuple[float, int]]] = {pool: [] for pool in POOLS}
        self.timeline: list[dict[str, float]] = []
        self.decisions: list[dict[str, Any]] = []
        self.spec = self._spec()
        initial = static if policy == "static-peak" else {"prefill": 1, "decode": 1}
        for pool in POOLS:
            for _ in range(initial[pool]):
                self.engines[pool].append(Engine(self, pool, ready_at=0.0))

    def _spec(self) -> InferenceDeploymentSpec:
        s = self.s
        return InferenceDeploymentSpec.model_validate(
            {
                "model": {"name": "m", "source": {"uri": "/m"}},
                "prefill": {"minReplicas": 1, "maxReplicas": s.max_replicas, "replicas": 1},
                "decode": {"minReplicas": 1, "maxReplicas": s.max_replicas, "replicas": 1},
                "monitoring": {"intervalSeconds": int(s.scrape_s)},
                "autoscaling": {
                    "enabled": True,
                    "intervalSeconds": s.interval_s,
                    "scaleDownStabilizationSeconds": s.down_window_s,
                    "maxStep": s.max_step,
                    "tolerance": s.tolerance,
                    "prefill": {"waitingPerReplica": s.prefill_prompts_per_replica, "ttftSloSeconds": s.ttft_slo_s},
                    "decode": {
                        "runningPerReplica": s.decode_running_per_replica,
                        "waitingPerReplica": 2,
                        "kvCacheUsage": 0.8,
                        "itlSloSeconds": s.itl_slo_s,
                    },
                },
            }
        )

    # --- event loop --------------------------------------------------------------------------

    def at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self.events, (when, next(self.counter), action))

    def run(self, trace: list[Request]) -> None:
        for request in trace:
            self.at(request.arrival, lambda r=request: self.route("prefill", r))  # type: ignore[misc]
        tick = 0.0
        while tick <= self.s.duration_s + 600:
            self.at(tick, self.sample)
            tick += 1.0
        tick = self.s.scrape_s
        while tick <= self.s.duration_s + 600:
            self.at(tick, self.scrape)
            tick += self.s.scrape_s
        tick = float(self.s.interval_s)
        while tick <= self.s.duration_s + 600:
            self.at(tick + 0.5, self.autoscale)
            tick += self.s.interval_s
        while self.events:
            when, _, action = heapq.heappop(self.events)
            if when > self.s.duration_s + 600:
                break
            self.now = when
            action()

    # --- routing -----------------------------------------------------------------------------

    def ready(self, pool: str) -> list[Engine]:
        return [e for e in self.engines[pool] if e.ready_at is not None and e.ready_at <= self.now and not e.draining]

    def route(self, pool: str, request: Request) -> None:
        engines = self.ready(pool)
        if not engines:
            self.router_queue[pool].append(request)
            return
        min(engines, key=lambda e: e.load()).submit(request)

    def flush_queue(self, pool: str) -> None:
        while self.router_queue[pool] and self.ready(pool):
            self.route(pool, self.router_queue[pool].popleft())

    # --- observation -------------------------------------------------------------------------

    def _p90(self, obs: deque[tuple[float, float]]) -> float | None:
        while obs and obs[0][0] < self.now - 60:
            obs.popleft()
        if not obs:
            return None
        values = sorted(v for _, v in obs)
        return values[min(len(values) - 1, int(0.9 * len(values)))]

    def scrape(self) -> None:
        snapshot = {}
        for pool in POOLS:
            engines = self.ready(pool)
            scheds = [e.sched for e in engines]
            snapshot[pool] = PoolSignals(
                router_queue=float(len(self.router_queue[pool])),
                router_inflight=float(sum(e.load() for e in engines)),
                waiting=float(sum(x.num_waiting_for_capacity + x.num_deferred for x in scheds)) if scheds else None,
                running=float(sum(len(x.running) for x in scheds)) if scheds else None,
                kv_cache_usage=sum(x.pool.usage for x in scheds) / len(scheds) if scheds else None,
                ttft_p90=self._p90(self.ttft_obs) if pool == "prefill" else None,
                itl_p90=self._p90(self.itl_obs) if pool == "decode" else None,
                sample_age_seconds=0.0,
            )
        self.snapshot = snapshot

    def sample(self) -> None:
        row: dict[str, float] = {"t": self.now, "rate": rate_at(self.s, min(self.now, self.s.duration_s))}
        for pool in POOLS:
            row[f"{pool}_ready"] = len(self.ready(pool))
            row[f"{pool}_billed"] = len(self.engines[pool])
        self.timeline.append(row)

    # --- autoscaling -------------------------------------------------------------------------

    def size(self, pool: str) -> int:
        return sum(1 for e in self.engines[pool] if not e.draining)

    def autoscale(self) -> None:
        if self.policy == "static-peak" or not self.snapshot:
            return
        current = {pool: self.size(pool) for pool in POOLS}
        reasons: dict[str, str] = {}
        if self.policy == "builtin":
            ready = {pool: len(self.ready(pool)) for pool in POOLS}
            decision = decide_replicas(self.spec, current, self.snapshot, self.state, self.now, ready=ready)
            self.state = decision.state
            desired = decision.desired
            reasons = decision.reasons
        else:
            desired = {pool: self.keda(pool, current[pool]) for pool in POOLS}
        for pool in POOLS:
            if desired[pool] != current[pool]:
                self.decisions.append(
                    {
                        "t": self.now,
                        "pool": pool,
                        "from": current[pool],
                        "to": desired[pool],
                        "reason": reasons.get(pool, ""),
                    }
                )
                self.scale(pool, desired[pool])

    def keda(self, pool: str, size: int) -> int:
        """KEDA's usual recipe: sum(vllm:num_requests_waiting) as AverageValue, HPA's algorithm."""
        s = self.s
        waiting = self.snapshot[pool].waiting
        if waiting is None:
            return size
        ratio = waiting / (s.keda_waiting_threshold * size) if size else math.inf
        raw = size if abs(ratio - 1) <= s.tolerance else math.ceil(waiting / s.keda_waiting_threshold)
        raw = max(1, min(s.max_replicas, raw))
        history = [(t, n) for t, n in self.keda_history[pool] if t >= self.now - s.down_window_s] + [(self.now, raw)]
        self.keda_history[pool] = history
        down = max(n for _, n in history)
        value = raw if raw > size else min(size, down)
        return max(size - s.max_step, min(size + s.max_step, value))

    def scale(self, pool: str, desired: int) -> None:
        live = [e for e in self.engines[pool] if not e.draining]
        if desired > len(live):
            for _ in range(desired - len(live)):
                engine = Engine(self, pool, ready_at=self.now + self.s.startup_s)
                self.engines[pool].append(engine)
                self.at(engine.ready_at or 0.0, lambda p=pool: self.flush_queue(p))  # type: ignore[misc]
        else:
            # Starting replicas first, then the least loaded (a ReplicaSet deletes not-ready pods first).
            order = sorted(live, key=lambda e: (e.ready_at is not None and e.ready_at <= self.now, e.load()))
            for engine in order[: len(live) - desired]:
                engine.drain()


class Engine:
    def __init__(self, sim: Simulation, pool: str, ready_at: float | None) -> None:
        self.sim = sim
        self.pool = pool
        self.sched = Scheduler(sim.limits[pool])
        self.ready_at = ready_at
        self.draining = False
        self.busy = False
        self.requests: dict[str, Request] = {}
        self.rng = random.Random(id(self))

    def load(self) -> int:
        return len(self.requests)

    def drain(self) -> None:
        self.draining = True
        if not self.requests:
            self.retire()

    def retire(self) -> None:
        if self in self.sim.engines[self.pool]:
            self.sim.engines[self.pool].remove(self)

    def submit(self, request: Request) -> None:
        key = f"{self.pool}-{request.id}"
        prompt = [self.rng.randrange(32000) for _ in range(request.prompt_tokens)]
        if self.pool == "prefill":
            seq = Sequence(key, prompt, 1, remote_decode=True)
            request.prefill_engine, request.prefill_seq = self, seq
        else:
            seq = Sequence(key, prompt, request.output_tokens, remote_prefill=True)
        self.requests[key] = request
        self.sched.add(seq)
        self.kick()

    def kick(self) -> None:
        if self.busy:
            return
        plan = self.sched.schedule()
        scale = self.sim.s.time_scale
        for seq in plan.new_pulls:
            seconds = self.sim.latency.transfer_seconds(len(seq.block_ids)) * scale
            self.sim.at(self.sim.now + seconds, lambda q=seq: self.pulled(q))  # type: ignore[misc]
        if plan.has_work:
            self.busy = True
            seconds = self.sim.latency.step_seconds(len(plan.decode), plan.num_prefill_tokens) * scale
            self.sim.at(self.sim.now + seconds, lambda p=plan: self.step_done(p))  # type: ignore[misc]

    def pulled(self, seq: Sequence) -> None:
        request = self.requests.get(seq.request_id)
        if request is not None and request.prefill_engine is not None and request.prefill_seq is not None:
            prefill = request.prefill_engine
            prefill.sched.pool.free(request.prefill_seq.block_ids)
            request.prefill_seq.block_ids = []
            prefill.requests.pop(request.prefill_seq.request_id, None)
            if prefill.draining and not prefill.requests:
                prefill.retire()
            prefill.kick()
        self.sched.pull_done(seq)
        self.kick()

    def step_done(self, plan: Any) -> None:
        self.busy = False
        now = self.sim.now
        result = self.sched.complete(plan)
        for seq, _token in result.tokens:
            request = self.requests.get(seq.request_id)
            if request is None:
                continue
            if self.pool == "prefill":
                self.sim.ttft_obs.append((now, now - request.arrival))
            else:
                if request.first_token is None:
                    request.first_token = now
                else:
                    self.sim.itl_obs.append((now, now - (request.last_token or now)))
                request.last_token = now
                request.tokens += 1
        for seq in result.finished:
            request = self.requests.get(seq.request_id)
            if request is None:
                continue
            if self.pool == "prefill":
                self.sim.route("decode", request)  # the KV stays held here until decode pulled it
            else:
                request.done = now
                self.requests.pop(seq.request_id, None)
        if self.draining and not self.requests:
            self.retire()
        self.kick()


# --------------------------------------------------------------------------- report


def summarize(sim: Simulation, trace: list[Request]) -> dict[str, Any]:
    s = sim.s
    done = [r for r in trace if r.done is not None and r.first_token is not None]
    ttft = sorted((r.first_token or 0) - r.arrival for r in done)
    itl = sorted(((r.last_token or 0) - (r.first_token or 0)) / (r.tokens - 1) for r in done if r.tokens > 1)
    ttft_ok = sum(1 for r in done if (r.first_token or 0) - r.arrival <= s.ttft_slo_s)
    itl_ok = sum(
        1 for r in done if r.tokens <= 1 or ((r.last_token or 0) - (r.first_token or 0)) / (r.tokens - 1) <= s.itl_slo_s
    )
    timeline = [row for row in sim.timeline if row["t"] < s.duration_s]
    replica_seconds = {pool: sum(row[f"{pool}_billed"] for row in timeline) for pool in POOLS}
    reactions: dict[str, list[float | None]] = {pool: [] for pool in POOLS}
    for start, _ in s.spikes:
        spike_t = start * s.duration_s
        for pool in POOLS:
            before = next((row[f"{pool}_ready"] for row in timeline if row["t"] >= spike_t), 0)
            later = [row["t"] for row in timeline if row["t"] > spike_t and row[f"{pool}_ready"] > before]
            reactions[pool].append(round(later[0] - spike_t) if later else None)

    def pct(values: list[float], q: float) -> float | None:
        return round(values[min(len(values) - 1, int(q * len(values)))], 3) if values else None

    def flips(pool: str) -> int:
        moves = [d["to"] - d["from"] for d in sim.decisions if d["pool"] == pool]
        return sum(1 for a, b in itertools.pairwise(moves) if (a > 0) != (b > 0))

    return {
        "policy": sim.policy,
        "requests": len(trace),
        "completed": len(done),
        "ttft_slo_attainment": round(ttft_ok / len(trace), 4),
        "itl_slo_attainment": round(itl_ok / len(trace), 4),
        "ttft_p50_s": pct(ttft, 0.5),
        "ttft_p90_s": pct(ttft, 0.9),
        "ttft_p99_s": pct(ttft, 0.99),
        "itl_p90_s": pct(itl, 0.9),
        "replica_seconds": {pool: round(v) for pool, v in replica_seconds.items()},
        "replica_hours_total": round(sum(replica_seconds.values()) / 3600, 2),
        "max_replicas": {pool: int(max(row[f"{pool}_billed"] for row in timeline)) for pool in POOLS},
        "reaction_s_to_first_new_ready_replica_per_spike": reactions,
        "scale_events": {pool: sum(1 for d in sim.decisions if d["pool"] == pool) for pool in POOLS},
        "direction_reversals": {pool: flips(pool) for pool in POOLS},
    }


def plot(sims: list[Simulation], s: Settings, out: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(len(sims), 1, figsize=(11, 3.0 * len(sims)), sharex=True, squeeze=False)
    for ax, sim in zip(axes[:, 0], sims, strict=True):
        t = [row["t"] / 60 for row in sim.timeline]
        ax.step(t, [row["decode_billed"] for row in sim.timeline], where="post", label="decode replicas")
        ax.step(t, [row["prefill_billed"] for row in sim.timeline], where="post", label="prefill replicas")
        ax.set_ylabel("replicas")
        ax.set_ylim(0, s.max_replicas + 1)
        twin = ax.twinx()
        twin.plot(t, [row["rate"] for row in sim.timeline], color="grey", alpha=0.5, label="offered req/s")
        twin.set_ylabel("req/s")
        twin.set_ylim(0, s.peak_rate + s.spike_rate + 1)
        ax.set_title(sim.policy)
        handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
        ax.legend(handles=handles, loc="upper left", fontsize=8)
    axes[-1, 0].set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(out / "virtual_replicas.png", dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="results folder (default: results/ here)")
    parser.add_argument(
        "--duration", type=float, default=None, help=f"seconds of trace (default {Settings.duration_s:g})"
    )
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument(
        "--smoke", action="store_true", help=f"{SMOKE_DURATION_S:.0f} virtual seconds: does the benchmark still run?"
    )
    args = parser.parse_args()
    if args.smoke:
        args.duration = args.duration or SMOKE_DURATION_S
        args.out = args.out or tempfile.mkdtemp(prefix="virtual-smoke-")
    settings = Settings(duration_s=args.duration or Settings.duration_s, seed=args.seed)
    out = Path(args.out or Path(__file__).parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    sims: list[Simulation] = []
    summaries: list[dict[str, Any]] = []
    static = {pool: settings.max_replicas for pool in POOLS}
    for policy in POLICIES:
        if policy == "static-peak" and summaries:
            static = summaries[0]["max_replicas"]
        trace = make_trace(settings)
        sim = Simulation(settings, policy, static)
        sim.run(trace)
        summary = summarize(sim, trace)
        print(json.dumps(summary), flush=True)
        sims.append(sim)
        summaries.append(summary)
        (out / f"virtual_{policy}.json").write_text(
            json.dumps({"summary": summary, "decisions": sim.decisions, "timeline": sim.timeline[::5]})
        )
    (out / "virtual_summary.json").write_text(
        json.dumps({"settings": dataclasses.asdict(settings), "runs": summaries}, indent=2)
    )
    plot(sims, settings, out)
    print(f"results written to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
