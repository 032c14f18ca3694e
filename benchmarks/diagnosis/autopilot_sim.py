"""Autopilot simulation report: the production `decide_optimization()` driving a simulated deployment in virtual time.

For each workload the same request trace is served twice: by the initial configuration left alone
("fixed") and with the autopilot on ("autopilot"): every `interval_s` (60 s, the operator's default)
the telemetry the diagnosis would read from Prometheus over a 5 m window is computed from the
simulation, turned into a `Sample` by the production `sample_from_input`, and handed to the
production `decide_optimization()` with the serving state and the history of applied changes. Its actions (a
JSON merge patch on the spec, undo included) change the simulated fleet make-before-break: engines of
the new shape start (`startup_s`), then the old ones drain.

Engines are the simulator's continuous-batching `Scheduler` (the code the HTTP sim workers run) with
the `gpu-h100-8b` latency profile, driven by a discrete-event loop as in
benchmarks/autoscaling/virtual.py; speculative decoding is `splitserve.sim.speculative` (its docstring
states the cost model). Prefill/decode (P/D) disaggregation moves the KV cache with the profile's
transfer time. What the telemetry does like vLLM: `vllm:inter_token_latency_seconds` is one
observation per request per engine step (so with speculation it measures steps, not tokens), and
`vllm:request_time_per_output_token_seconds` is each request's decode time / (output tokens - 1), which
the autopilot judges speculative decoding on. `--no-tpot` leaves TPOT out of the telemetry (an engine
that does not export it): the autopilot then falls back to the per-step ITL, as it did before.

    python benchmarks/diagnosis/autopilot_sim.py --out benchmarks/diagnosis/results
    python benchmarks/diagnosis/autopilot_sim.py --workload low-load-chat --no-tpot --tag no-tpot
    python benchmarks/diagnosis/autopilot_sim.py --workload prompt-heavy-shift \
        --policy '{"settle_s": 0, "evaluation_s": 600}' --tag no-settle
    python benchmarks/diagnosis/autopilot_sim.py --smoke --out /tmp/autopilot   # seconds: does it still run?

`--smoke`: every workload for 10 virtual minutes under a policy compressed to fit them (SMOKE_POLICY),
the files to a temporary folder unless --out says where. Plots need matplotlib
(`pip install 'splitserve[bench]'`); without it the JSON is written all the same.
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
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.plots import pyplot  # noqa: E402
from splitserve.api.patch import merge_patch  # noqa: E402  (what the operator applies)
from splitserve.api.spec import InferenceDeploymentSpec, Mode  # noqa: E402
from splitserve.diagnosis.findings import DiagnosisInput  # noqa: E402
from splitserve.diagnosis.model_facts import model_facts  # noqa: E402
from splitserve.diagnosis.report import gpu_choices  # noqa: E402
from splitserve.diagnosis.telemetry import Reading, Telemetry  # noqa: E402
from splitserve.optimization.autopilot import (  # noqa: E402
    Action,
    AppliedAction,
    AutopilotPolicy,
    Sample,
    decide_optimization,
    sample_from_input,
    state_from_spec,
)
from splitserve.sim.config import PROFILES, EngineLimits, LatencyModel  # noqa: E402
from splitserve.sim.scheduler import Scheduler, Sequence  # noqa: E402
from splitserve.sim.speculative import SpeculativeModel, SpeculativeScheduler  # noqa: E402

WINDOW_S = 300.0  # the telemetry window ("5m"), as the operator's autopilot reads it
BATCH_SAMPLE_S = 5.0  # how often the running-requests gauge is sampled (a scrape)
# --smoke: 10 virtual minutes per workload, and a policy that may act (and judge its action) in them.
SMOKE_DURATION_S = 600.0
SMOKE_POLICY = {"window_s": 120, "min_interval_s": 600, "settle_s": 120, "evaluation_s": 300}


# --------------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class Phase:
    start_s: float
    rate: float  # requests/s (Poisson)
    prompt_median: int
    output_median: int


@dataclass(frozen=True)
class Workload:
    name: str
    story: str
    spec: Mapping[str, Any]  # the InferenceDeployment spec it starts from (wire form)
    phases: tuple[Phase, ...]
    duration_s: float = 3600.0
    max_num_seqs: int = 256
    speculative: SpeculativeModel = field(default_factory=SpeculativeModel)
    seed: int = 5
    # Every engine duration multiplied by this. 6 makes the H100 profile roughly an L4 for an 8B model
    # (prefill 2,500 tokens/s and a 72 ms decode step, against the diagnosis's L4 estimates of ~3,000
    # tokens/s and ~90 ms), so the autopilot's capacity estimates and the simulated engines agree, and
    # the event count (run time) stays small.
    slowdown: float = 1.0

    def phase_at(self, t: float) -> Phase:
        return [p for p in self.phases if p.start_s <= t][-1]


L4 = {"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-L4"}}


def base_spec(ttft_slo: float = 1.0, itl_slo: float = 0.010, **parts: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"name": "llama-8b", "source": {"uri": "/models/llama-8b"}, "parameterCount": 8_030_000_000},
        "kvTransfer": {"connector": "NixlConnector"},
        "optimization": {"dynamic": True},
        "autoscaling": {"decode": {"itlSloSeconds": itl_slo}, "prefill": {"ttftSloSeconds": ttft_slo}},
    }
    for key, value in parts.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    return spec


WORKLOADS: tuple[Workload, ...] = (
    Workload(
        "low-load-chat",
        "One aggregated replica, 0.4 chat requests/s (prompt ~300, answer ~250 tokens): decode runs at batch ~1-3, "
        "bandwidth-bound; speculative decoding (n-gram, k=3, acceptance 0.6) should cut the time per token.",
        base_spec(mode="aggregated", decode={"replicas": 1}),
        (Phase(0, 0.4, 300, 250),),
    ),
    Workload(
        "surge-aggregated",
        "L4-class GPUs. Two aggregated replicas (max-num-seqs 32) serving RAG prompts (~2000 tokens, answers ~150) "
        "at 0.17 req/s, then a surge to 1.33 req/s from minute 5: prefill chunks stall the decode steps, slots fill "
        "up and prompts queue. The spec declares prefill.replicas 2 for disaggregated serving (2 prefill + 2 decode "
        "GPUs after a switch, against 2 before: see gpu_hours).",
        base_spec(
            ttft_slo=10.0, itl_slo=0.25, mode="aggregated", decode={"replicas": 2, **L4}, prefill={"replicas": 2, **L4}
        ),
        (Phase(0, 0.17, 2000, 150), Phase(300, 1.33, 2000, 150)),
        max_num_seqs=32,
        slowdown=6.0,
    ),
    Workload(
        "prompt-heavy-shift",
        "L4-class GPUs. Disaggregated 1 prefill : 4 decode sized for chat (prompt ~400, answer ~500 at 0.8 req/s); "
        "from minute 5 the prompts grow to ~3200 tokens (RAG), same rate and answers: one prefill engine is just "
        "short, prompts queue and TTFT grows; more prefill replicas (the prefill:decode ratio) should cut it. "
        "Speculative decoding is vetoed here (optimization.veto) so the ratio is the only lever; without the veto "
        "the decode pool, starved by prefill, runs at batch < 8 and only the prefill-bound guard keeps the autopilot "
        "from turning speculative decoding on first.",
        base_spec(
            ttft_slo=10.0,
            itl_slo=0.25,
            mode="disaggregated",
            decode={"replicas": 4, **L4},
            prefill={"replicas": 1, **L4},
            optimization={"dynamic": True, "veto": ["speculativeDecoding"]},
        ),
        (Phase(0, 0.8, 400, 500), Phase(300, 0.8, 3200, 500)),
        slowdown=6.0,
    ),
)


@dataclass
class Request:
    id: int
    arrival: float
    prompt_tokens: int
    output_tokens: int
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0
    done: float | None = None
    prefill_engine: Engine | None = None
    prefill_seq: Sequence | None = None


def make_trace(w: Workload) -> list[Request]:
    rng = random.Random(w.seed)
    out: list[Request] = []
    top = max(p.rate for p in w.phases)
    t = 0.0
    while True:
        t += rng.expovariate(top)
        if t >= w.duration_s:
            return out
        phase = w.phase_at(t)
        if rng.random() * top <= phase.rate:
            prompt = int(min(7000, max(20, rng.lognormvariate(math.log(phase.prompt_median), 0.5))))
            output = int(min(1000, max(4, rng.lognormvariate(math.log(phase.output_median), 0.6))))
            out.append(Request(len(out), t, prompt, output))


# --------------------------------------------------------------------------- the simulated fleet


Signature = tuple[str, bool]  # (role, speculative decoding on)


@dataclass
class Observations:
    """Time-stamped observations, as the engines' histograms and counters would record them."""

    ttft: deque[tuple[float, float]] = field(default_factory=deque)
    prefill_time: deque[tuple[float, float]] = field(default_factory=deque)
    itl_step: deque[tuple[float, float]] = field(default_factory=deque)  # per request per step (vLLM's ITL)
    tpot: deque[tuple[float, float]] = field(default_factory=deque)  # per request: decode time / (tokens - 1)
    # The router's histograms: prompt length when a request arrives, output length when it finishes.
    arrived: deque[tuple[float, int]] = field(default_factory=deque)  # (t, prompt tokens)
    finished: deque[tuple[float, int]] = field(default_factory=deque)  # (t, output tokens)
    batch: dict[int, deque[tuple[float, int]]] = field(default_factory=dict)  # engine -> running samples

    def trim(self, since: float) -> None:
        for series in (self.ttft, self.prefill_time, self.itl_step, self.tpot, self.arrived, self.finished):
            while series and series[0][0] < since:
                series.popleft()
        for samples in self.batch.values():
            while samples and samples[0][0] < since:
                samples.popleft()


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Simulation:
    def __init__(
        self,
        w: Workload,
        autopilot: bool,
        export_tpot: bool = True,
        interval_s: float = 60.0,
        startup_s: float = 90.0,
        policy: AutopilotPolicy | None = None,
    ) -> None:
        self.w = w
        self.autopilot = autopilot
        self.export_tpot = export_tpot
        self.interval_s = interval_s
        self.startup_s = startup_s
        self.policy = policy or AutopilotPolicy()
        profile = PROFILES["gpu-h100-8b"]
        self.latency: LatencyModel = LatencyModel(
            **{name: value * w.slowdown for name, value in dataclasses.asdict(profile.latency).items()}
        )
        self.speculative = dataclasses.replace(
            w.speculative,
            compute_s_per_token=w.speculative.compute_s_per_token * w.slowdown,
            overhead_s=w.speculative.overhead_s * w.slowdown,
        )
        self.limits: EngineLimits = dataclasses.replace(
            profile.limits, max_num_seqs=w.max_num_seqs, enable_prefix_caching=False
        )
        self.events: list[tuple[float, int, Callable[[], None]]] = []
        self.counter = itertools.count()
        self.now = 0.0
        self.spec_doc: dict[str, Any] = json.loads(json.dumps(w.spec))
        self.spec = InferenceDeploymentSpec.model_validate(self.spec_doc)
        self.facts = model_facts(self.spec, None, [])
        self.engines: list[Engine] = []
        self.queue: deque[Request] = deque()
        self.obs = Observations()
        self.samples: deque[Sample] = deque(maxlen=200)
        self.history: list[AppliedAction] = []
        self.actions: list[dict[str, Any]] = []
        self.timeline: list[dict[str, Any]] = []
        self.gpu_seconds = 0.0
        self.all_itl: list[tuple[float, float]] = []  # (arrival of the request, step gap): the whole run
        self.serving_mode = self.spec.mode
        self._reconfigure(initial=True)

    # --- layout -------------------------------------------------------------------------------

    def _desired(self) -> Counter[Signature]:
        spec = self.spec
        speculative = spec.engine.speculative_decoding.method != "off"
        if spec.mode is Mode.AGGREGATED:
            return Counter({("aggregated", speculative): spec.decode.replicas})
        return Counter({("prefill", False): spec.prefill.replicas, ("decode", speculative): spec.decode.replicas})

    def _reconfigure(self, initial: bool = False) -> None:
        """Start the engines the spec asks for; retire the surplus once they are ready (make-before-break)."""
        desired = self._desired()
        live = [e for e in self.engines if not e.draining and not e.retiring]
        surplus: list[Engine] = []
        started = False
        for signature in set(desired) | {e.signature for e in live}:
            have = [e for e in live if e.signature == signature]
            want = desired.get(signature, 0)
            for engine in have[want:]:
                surplus.append(engine)
            for _ in range(max(0, want - len(have))):
                ready = 0.0 if initial else self.now + self.startup_s
                self.engines.append(Engine(self, signature, ready))
                started = True
        for engine in surplus:
            engine.retiring = True  # still serves until the new shape is ready
        switch_at = self.now + (self.startup_s if started and not initial else 0.0)
        mode = self.spec.mode
        self.at(switch_at, lambda: self._switch(mode, surplus))

    def _switch(self, mode: Mode, surplus: list[Engine]) -> None:
        self.serving_mode = mode
        for engine in surplus:
            engine.drain()
        self.flush()

    def ready(self, role: str) -> list[Engine]:
        return [
            e
            for e in self.engines
            if e.role == role and e.ready_at <= self.now and not e.draining and (not e.retiring or self._old_serving(e))
        ]

    def _old_serving(self, engine: Engine) -> bool:
        # A retiring engine serves while nothing of its role and the serving mode is ready to replace it.
        replacements = [
            e
            for e in self.engines
            if e.role == engine.role and not e.retiring and not e.draining and e.ready_at <= self.now
        ]
        return not replacements

    # --- event loop ---------------------------------------------------------------------------

    def at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self.events, (when, next(self.counter), action))

    def run(self, trace: list[Request]) -> None:
        end = self.w.duration_s
        for request in trace:
            self.at(request.arrival, lambda r=request: self.arrive(r))  # type: ignore[misc]
        for tick in itertools.takewhile(lambda t: t <= end, itertools.count(BATCH_SAMPLE_S, BATCH_SAMPLE_S)):
            self.at(tick, self.sample_batch)
        for tick in itertools.takewhile(lambda t: t <= end, itertools.count(self.interval_s, self.interval_s)):
            self.at(tick + 0.5, self.tick)
        while self.events:
            when, _, action = heapq.heappop(self.events)
            if when > end:
                break
            self.now = when
            action()

    # --- routing ------------------------------------------------------------------------------

    def arrive(self, request: Request) -> None:
        self.obs.arrived.append((self.now, request.prompt_tokens))
        self.route(request)

    def route(self, request: Request) -> None:
        role = "aggregated" if self.serving_mode is Mode.AGGREGATED else "prefill"
        engines = self.ready(role)
        if not engines:
            self.queue.append(request)
            return
        min(engines, key=lambda e: e.load()).submit(request)

    def route_decode(self, request: Request) -> None:
        engines = self.ready("decode")
        if not engines:
            # The decode pool is gone (switched back to aggregated while this prompt was prefilled): an
            # aggregated engine recomputes the prompt, like the router's fallback without KV transfer.
            release_prefill(request)
            engines = self.ready("aggregated")
        if not engines:
            self.at(self.now + 1.0, lambda: self.route_decode(request))
            return
        min(engines, key=lambda e: e.load()).submit(request)

    def flush(self) -> None:
        pending, self.queue = self.queue, deque()
        for request in pending:
            self.route(request)

    # --- telemetry ----------------------------------------------------------------------------

    def sample_batch(self) -> None:
        for engine in self.engines:
            if engine.role in ("aggregated", "decode") and engine.ready_at <= self.now:
                self.obs.batch.setdefault(id(engine), deque()).append((self.now, len(engine.sched.running)))
        self.gpu_seconds += BATCH_SAMPLE_S * len(self.engines)

    def telemetry(self) -> Telemetry:
        """What collect() would read from Prometheus over the last WINDOW_S (None where there is no data)."""
        self.obs.trim(self.now - WINDOW_S)
        o = self.obs
        tpot = quantile([v for _, v in o.tpot], 0.9) if self.export_tpot else None
        batches = [sum(n for _, n in s) / len(s) for s in o.batch.values() if s and s[-1][0] >= self.now - 10]
        arrived = len(o.arrived)

        def reading(value: float | None, name: str) -> Reading:
            return Reading(value, f"simulated {name} over {WINDOW_S:.0f}s")

        return Telemetry(
            window="5m",
            itl_p90=reading(quantile([v for _, v in o.itl_step], 0.9), "ITL p90"),
            tpot_p90=reading(tpot, "TPOT p90"),
            running_per_replica=reading(max(batches) if batches else None, "running"),
            ttft_p90=reading(quantile([v for _, v in o.ttft], 0.9), "TTFT p90"),
            prefill_time_p90=reading(quantile([v for _, v in o.prefill_time], 0.9), "prefill time p90"),
            request_rate=reading(arrived / WINDOW_S if arrived else None, "requests/s"),
            prompt_tokens_rate=reading(sum(p for _, p in o.arrived) / WINDOW_S if arrived else None, "prompt/s"),
            generation_tokens_rate=reading(sum(g for _, g in o.finished) / WINDOW_S if arrived else None, "gen/s"),
        )

    def tick(self) -> None:
        telemetry = self.telemetry()
        inp = DiagnosisInput(self.spec, self.facts, gpu_choices(self.spec, None), telemetry, "simulated")
        sample = sample_from_input(inp, self.now)
        self.samples.append(sample)
        row: dict[str, Any] = {
            "t": self.now,
            "batch": sample.batch_per_replica,
            "itl_p90": sample.itl_p90,
            "ttft_p90": sample.ttft_p90,
            "ttft_inflation": sample.ttft_inflation,
            "needed_ratio": sample.needed_ratio,
            "tpot_p90": quantile([v for _, v in self.obs.tpot], 0.9),
            "itl_step_p90": quantile([v for _, v in self.obs.itl_step], 0.9),
            "engines": dict(Counter(f"{e.role}{'+spec' if e.speculative else ''}" for e in self.engines)),
        }
        self.timeline.append(row)
        if not self.autopilot:
            return
        decision = decide_optimization(
            dynamic=self.spec.optimization.dynamic,
            veto=self.spec.optimization.veto,
            state=state_from_spec(self.spec),
            samples=list(self.samples),
            history=self.history,
            now=self.now,
            policy=self.policy,
        )
        if decision.action is not None:
            self.apply(decision.action)

    def apply(self, action: Action) -> None:
        if action.reverts is not None:
            for index in range(len(self.history) - 1, -1, -1):
                if self.history[index].action is action.reverts:
                    self.history[index] = dataclasses.replace(self.history[index], reverted=True)
                    break
        self.history.append(AppliedAction(action, self.now))
        self.spec_doc = merge_patch(self.spec_doc, action.patch)
        self.spec = InferenceDeploymentSpec.model_validate(self.spec_doc)
        self.actions.append(
            {
                "t": self.now,
                "action": action.what,
                "why": action.why,
                "target_metric": action.target_metric,
                "baseline": action.baseline,
                "numbers": action.numbers,
                "undo": action.reverts is not None,
            }
        )
        self._reconfigure()


def release_prefill(request: Request) -> None:
    """The prefill engine frees the KV blocks it held for this request (pulled, or no longer wanted)."""
    prefill, seq = request.prefill_engine, request.prefill_seq
    if prefill is None or seq is None:
        return
    prefill.sched.pool.free(seq.block_ids)
    seq.block_ids = []
    prefill.requests.pop(seq.request_id, None)
    request.prefill_engine = request.prefill_seq = None
    if prefill.draining and not prefill.requests:
        prefill.retire()
    prefill.kick()


class Engine:
    def __init__(self, sim: Simulation, signature: Signature, ready_at: float) -> None:
        self.sim = sim
        self.role, self.speculative = signature
        self.signature = signature
        self.ready_at = ready_at
        self.retiring = False
        self.draining = False
        self.busy = False
        self.requests: dict[str, Request] = {}
        self.rng = random.Random(f"{sim.w.seed}-{len(sim.engines)}-{ready_at}")
        self.model: SpeculativeModel | None = sim.speculative if self.speculative else None
        self.sched: Scheduler = (
            SpeculativeScheduler(sim.limits, self.model, self.rng) if self.model is not None else Scheduler(sim.limits)
        )

    def load(self) -> int:
        return len(self.requests)

    def drain(self) -> None:
        self.draining = True
        if not self.requests:
            self.retire()

    def retire(self) -> None:
        if self in self.sim.engines:
            self.sim.engines.remove(self)

    def submit(self, request: Request) -> None:
        key = f"{self.role}-{request.id}"
        prompt = [self.rng.randrange(32000) for _ in range(request.prompt_tokens)]
        if self.role == "prefill":
            seq = Sequence(key, prompt, 1, remote_decode=True)
            request.prefill_engine, request.prefill_seq = self, seq
        elif self.role == "decode":
            seq = Sequence(key, prompt, request.output_tokens, remote_prefill=True)
        else:
            seq = Sequence(key, prompt, request.output_tokens)
        self.requests[key] = request
        self.sched.add(seq)
        self.kick()

    def kick(self) -> None:
        if self.busy:
            return
        plan = self.sched.schedule()
        for seq in plan.admitted:
            request = self.requests.get(seq.request_id)
            if request is not None and request.scheduled is None and self.role != "decode":
                request.scheduled = self.sim.now
        for seq in plan.new_pulls:
            seconds = self.sim.latency.transfer_seconds(len(seq.block_ids))
            self.sim.at(self.sim.now + seconds, lambda q=seq: self.pulled(q))  # type: ignore[misc]
        if plan.has_work:
            self.busy = True
            if self.model is not None:
                seconds = self.model.step_seconds(self.sim.latency, len(plan.decode), plan.num_prefill_tokens)
            else:
                seconds = self.sim.latency.step_seconds(len(plan.decode), plan.num_prefill_tokens)
            self.sim.at(self.sim.now + seconds, lambda p=plan: self.step_done(p))  # type: ignore[misc]

    def pulled(self, seq: Sequence) -> None:
        request = self.requests.get(seq.request_id)
        if request is not None:
            release_prefill(request)
        self.sched.pull_done(seq)
        self.kick()

    def step_done(self, plan: Any) -> None:
        self.busy = False
        now = self.sim.now
        obs = self.sim.obs
        result = self.sched.complete(plan)
        per_request: Counter[str] = Counter(seq.request_id for seq, _ in result.tokens)
        for key, count in per_request.items():
            request = self.requests.get(key)
            if request is None:
                continue
            if self.role == "prefill":
                continue  # its one token is the prefill's; the client's first token comes from decode
            if request.first_token is None:
                request.first_token = now
                obs.ttft.append((now, now - request.arrival))
                if self.role == "aggregated" and request.scheduled is not None:
                    obs.prefill_time.append((now, now - request.scheduled))
                count -= 1
                request.tokens += 1
                if count <= 0:
                    request.last_token = now
                    continue
            gap = now - (request.last_token or now)
            obs.itl_step.append((now, gap))  # one observation per request per step, as vLLM v1 records it
            self.sim.all_itl.append((request.arrival, gap))
            request.tokens += count
            request.last_token = now
        for seq in result.finished:
            request = self.requests.get(seq.request_id)
            if request is None:
                continue
            if self.role == "prefill":
                if request.scheduled is not None:
                    obs.prefill_time.append((now, now - request.scheduled))
                self.sim.route_decode(request)  # the KV stays held here until decode pulled it
            else:
                request.done = now
                obs.finished.append((now, request.tokens))
                if request.tokens > 1 and request.first_token is not None:
                    obs.tpot.append((now, (now - request.first_token) / (request.tokens - 1)))
                self.requests.pop(seq.request_id, None)
        if self.draining and not self.requests:
            self.retire()
        self.kick()


# --------------------------------------------------------------------------- report


def run_one(
    w: Workload, autopilot: bool, export_tpot: bool, policy: AutopilotPolicy | None = None
) -> tuple[Simulation, list[Request]]:
    trace = make_trace(w)
    sim = Simulation(w, autopilot, export_tpot, policy=policy)
    sim.run(trace)
    return sim, trace


def summarize(sim: Simulation, trace: list[Request], since: float = 0.0, until: float | None = None) -> dict[str, Any]:
    spec = InferenceDeploymentSpec.model_validate(sim.w.spec)
    ttft_slo = spec.autoscaling.prefill.ttft_slo_seconds
    itl_slo = spec.autoscaling.decode.itl_slo_seconds
    end = until if until is not None else sim.w.duration_s
    window = [r for r in trace if since <= r.arrival < end]
    done = [r for r in window if r.done is not None and r.first_token is not None]
    ttft = [(r.first_token or 0) - r.arrival for r in done]
    tpot = [((r.last_token or 0) - (r.first_token or 0)) / (r.tokens - 1) for r in done if r.tokens > 1]
    met = sum(
        1
        for r in done
        if (r.first_token or 0) - r.arrival <= ttft_slo
        and (r.tokens <= 1 or ((r.last_token or 0) - (r.first_token or 0)) / (r.tokens - 1) <= itl_slo)
    )

    def rounded(value: float | None) -> float | None:
        return None if value is None else round(value, 4)

    return {
        "requests": len(window),
        "completed": len(done),
        "ttft_p90_s": rounded(quantile(ttft, 0.9)),
        "tpot_p90_s": rounded(quantile(tpot, 0.9)),
        "itl_p90_s": rounded(quantile([gap for arrival, gap in sim.all_itl if since <= arrival < end], 0.9)),
        "slo_attainment": round(met / len(window), 4) if window else None,
    }


def metric_mean(sim: Simulation, metric: str, since: float, until: float) -> float | None:
    values = [row[metric] for row in sim.timeline if since < row["t"] <= until and row[metric] is not None]
    return round(sum(values) / len(values), 4) if values else None


def report(
    w: Workload, export_tpot: bool, policy: AutopilotPolicy | None = None
) -> tuple[dict[str, Any], Simulation, Simulation]:
    fixed, trace_fixed = run_one(w, autopilot=False, export_tpot=export_tpot)
    auto, trace_auto = run_one(w, autopilot=True, export_tpot=export_tpot, policy=policy)
    switches = []
    for index, action in enumerate(auto.actions):
        metric = action["target_metric"]
        start = action["t"]
        following = auto.actions[index + 1]["t"] if index + 1 < len(auto.actions) else w.duration_s
        # "After": once the new engines serve and a whole telemetry window has passed on them.
        settled = start + sim_startup(auto) + WINDOW_S
        switches.append(
            {
                **action,
                "before": action["baseline"],
                "after_autopilot": metric_mean(auto, metric, settled, following) if settled < following else None,
                "same_period_fixed": metric_mean(fixed, metric, settled, following) if settled < following else None,
                "after_period_s": [round(settled), round(following)],
                "tpot_p90_before": metric_mean(auto, "tpot_p90", start - w.duration_s, start),
                "tpot_p90_after": metric_mean(auto, "tpot_p90", settled, following) if settled < following else None,
            }
        )
    first_change = auto.actions[0]["t"] if auto.actions else 0.0
    document = {
        "workload": w.name,
        "story": w.story,
        "telemetry_tpot": export_tpot,
        "policy": dataclasses.asdict(auto.policy),
        "initial_spec": w.spec,
        "actions": switches,
        "whole_run": {"fixed": summarize(fixed, trace_fixed), "autopilot": summarize(auto, trace_auto)},
        "after_first_change": {
            "from_s": round(first_change),
            "fixed": summarize(fixed, trace_fixed, since=first_change),
            "autopilot": summarize(auto, trace_auto, since=first_change),
        },
        "gpu_hours": {"fixed": round(fixed.gpu_seconds / 3600, 2), "autopilot": round(auto.gpu_seconds / 3600, 2)},
    }
    return document, fixed, auto


def fmt_s(value: float | None, unit: str = "s") -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.1f} ms" if unit == "ms" else f"{value:.2f} s"


def table(docs: list[dict[str, Any]]) -> str:
    """Markdown: per workload and run, the actions, the target metric before/after and the whole-run figures."""
    lines = [
        "| workload (run) | action at | target metric: before -> after (fixed, same period) "
        "| TTFT p90 fixed / autopilot | ITL p90 (vLLM, per step) fixed / autopilot | TPOT p90 fixed / autopilot "
        "| SLO attainment fixed / autopilot | GPU-hours fixed / autopilot |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for doc in docs:
        after = doc["after_first_change"]
        fixed, auto = after["fixed"], after["autopilot"]
        actions = doc["actions"] or [None]
        for index, action in enumerate(actions):
            run = f"{doc['workload']} ({doc.get('run', 'default')})" if index == 0 else ""
            if action is None:
                what, metric = "no action", "-"
            else:
                unit = "ms" if action["target_metric"] in ("itl_p90", "tpot_p90") else "s"
                what = f"{action['t'] / 60:.0f} min: {action['action']}"
                metric = (
                    f"{action['target_metric']} {fmt_s(action['before'], unit)} -> "
                    f"{fmt_s(action['after_autopilot'], unit)} ({fmt_s(action['same_period_fixed'], unit)})"
                )
                if action["target_metric"] == "itl_p90" and action.get("tpot_p90_after") is not None:
                    tpot = f"{fmt_s(action['tpot_p90_before'], 'ms')} -> {fmt_s(action['tpot_p90_after'], 'ms')}"
                    metric += f"; TPOT p90 {tpot}"
            figures = (
                [
                    f"{fmt_s(fixed['ttft_p90_s'])} / {fmt_s(auto['ttft_p90_s'])}",
                    f"{fmt_s(fixed['itl_p90_s'], 'ms')} / {fmt_s(auto['itl_p90_s'], 'ms')}",
                    f"{fmt_s(fixed['tpot_p90_s'], 'ms')} / {fmt_s(auto['tpot_p90_s'], 'ms')}",
                    f"{fixed['slo_attainment']:.0%} / {auto['slo_attainment']:.0%}",
                    f"{doc['gpu_hours']['fixed']} / {doc['gpu_hours']['autopilot']}",
                ]
                if index == 0
                else ["", "", "", "", ""]
            )
            lines.append("| " + " | ".join([run, what, metric, *figures]) + " |")
    return "\n".join(lines) + "\n"


def sim_startup(sim: Simulation) -> float:
    return sim.startup_s


def plot(results: list[tuple[dict[str, Any], Simulation, Simulation]], out: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(len(results), 1, figsize=(11, 3.2 * len(results)), squeeze=False)
    for ax, (doc, fixed, auto) in zip(axes[:, 0], results, strict=True):
        metric = doc["actions"][0]["target_metric"] if doc["actions"] else "ttft_p90"
        shown = "tpot_p90" if metric in ("itl_p90", "tpot_p90") else metric
        label = "TPOT p90 (per request)" if shown == "tpot_p90" else "TTFT p90"
        for sim, name, style in ((fixed, "fixed", "--"), (auto, "autopilot", "-")):
            t = [row["t"] / 60 for row in sim.timeline]
            ax.plot(t, [(row[shown] or math.nan) * 1000 for row in sim.timeline], style, label=f"{name}: {label}")
        if metric in ("itl_p90", "tpot_p90"):
            t = [row["t"] / 60 for row in auto.timeline]
            ax.plot(t, [(row["itl_step_p90"] or math.nan) * 1000 for row in auto.timeline], ":", label="autopilot: "
                    "vLLM ITL metric p90 (per step)")  # fmt: skip
        for action in doc["actions"]:
            ax.axvline(action["t"] / 60, color="grey", alpha=0.6)
            ax.annotate(action["action"], (action["t"] / 60, ax.get_ylim()[1] * 0.9), fontsize=7, rotation=90,
                        va="top", ha="right")  # fmt: skip
        ax.set_ylabel("ms")
        if metric not in ("itl_p90", "tpot_p90"):
            ax.set_yscale("log")  # TTFT spans queueing of minutes and sub-second prefills
        else:
            ax.set_ylim(bottom=0)
        ax.set_title(doc["workload"], fontsize=10)
        ax.legend(fontsize=7, loc="upper left")
    axes[-1, 0].set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(out / "autopilot_sim.png", dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="results folder (default: results/ here)")
    parser.add_argument("--workload", action="append", choices=[w.name for w in WORKLOADS])
    parser.add_argument(
        "--no-tpot",
        action="store_true",
        help="leave vllm:request_time_per_output_token_seconds out of the telemetry (the autopilot falls back to ITL)",
    )
    parser.add_argument("--duration", type=float, default=None)
    parser.add_argument(
        "--policy", default=None, help="AutopilotPolicy fields as JSON (as SPLITSERVE_AUTOPILOT_POLICY in the operator)"
    )
    parser.add_argument(
        "--speculative",
        default="{}",
        help="SpeculativeModel fields (JSON) for every workload, e.g. '{\"draft_step_fraction\": 0.1}': a draft model",
    )
    parser.add_argument("--tag", default="", help="suffix for the result files of a variant run")
    parser.add_argument("--no-veto", action="store_true", help="drop optimization.veto from the workloads' specs")
    parser.add_argument("--table", action="store_true", help="only write autopilot_table.md from the summary files")
    parser.add_argument("--smoke", action="store_true", help="seconds: does the benchmark still run?")
    args = parser.parse_args()
    if args.smoke:
        args.duration = args.duration or SMOKE_DURATION_S
        args.policy = args.policy or json.dumps(SMOKE_POLICY)
        args.out = args.out or tempfile.mkdtemp(prefix="autopilot-smoke-")
    policy = AutopilotPolicy(**json.loads(args.policy or "{}"))
    out = Path(args.out or Path(__file__).parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    if args.table:
        docs = []
        for path in sorted(out.glob("autopilot_summary*.json")):
            run = path.stem.removeprefix("autopilot_summary").lstrip("_") or "default"
            docs += [{**doc, "run": run} for doc in json.loads(path.read_text())]
        (out / "autopilot_table.md").write_text(table(docs))
        print(table(docs))
        return 0
    chosen = [w for w in WORKLOADS if not args.workload or w.name in args.workload]
    if args.duration:
        chosen = [dataclasses.replace(w, duration_s=args.duration) for w in chosen]
    speculative = json.loads(args.speculative)
    if speculative:
        chosen = [dataclasses.replace(w, speculative=dataclasses.replace(w.speculative, **speculative)) for w in chosen]
    if args.no_veto:
        chosen = [dataclasses.replace(w, spec=merge_patch(w.spec, {"optimization": {"veto": None}})) for w in chosen]
    tag = f"_{args.tag}" if args.tag else ""
    results = []
    for w in chosen:
        doc, fixed, auto = report(w, not args.no_tpot, policy)
        print(json.dumps({k: doc[k] for k in ("workload", "actions", "after_first_change", "gpu_hours")}), flush=True)
        results.append((doc, fixed, auto))
        (out / f"autopilot_{w.name}{tag}.json").write_text(
            json.dumps({**doc, "timeline_fixed": fixed.timeline, "timeline_autopilot": auto.timeline}, default=str)
        )
    (out / f"autopilot_summary{tag}.json").write_text(json.dumps([doc for doc, _, _ in results], indent=2))
    if not tag and len(results) > 1:
        plot(results, out)
    print(f"results written to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
