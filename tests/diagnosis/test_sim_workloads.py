"""Telemetry verdicts from a real Prometheus scraping simulated engines (and routers) under scripted load.

The end-to-end check of issue 7 §4: for each telemetry question (2 prompt redundancy, 3 output-length
variance, 4 KV pressure, 5 per-token latency / speculative decoding, 6 prefill/decode interference and
the prefill:decode ratio) one workload that should trigger the verdict does, and one that should not
does not. Nothing here is a fake: SimWorkers run the continuous-batching scheduler and export vLLM's
metric names, routers export the splitserve_router_* histograms, Prometheus scrapes them every second
with the labels the operator's PodMonitors add (`namespace`, `deployment`, `role`), and
`run_diagnosis` sends its real PromQL.

To stay within a couple of minutes on a small machine, every workload runs at the same time, each as
its own "deployment" (a distinct `deployment` label) in one Prometheus, and the diagnosis reads a
`WINDOW` rate window while the load is still running. The simulated engines run in real time
(time_scale 1) with steps of 25-60 ms, so a step loop wakes up at most ~40 times a second.

Which workload answers which question (the table `CASES` holds the spec and expectation of each):

    rag               shared 400-token document + unique question  -> Q2 triggers (prefix redundancy)
    unique-chat       unique 400-token prompts, 64-token answers    -> Q2, Q3, Q4, Q6 do not trigger
    mixed-lengths     answers of 4 or 300 tokens (via a router)     -> Q3 triggers (high output variance)
    kv-starved        8 long sequences on 1024 tokens of KV cache   -> Q4 triggers (preemptions, waits)
    low-batch-slow    2 streams on a 60 ms decode step, SLO 30 ms   -> Q5 triggers (speculative decoding on)
    high-batch-slow   40 streams on the same engine                 -> Q5 does not (too busy; off if on)
    agg-overloaded    12 streams of 600-token prompts, 4 batch slots -> Q6 triggers (disaggregate)
    pd-prompt-heavy   P/D via the router, 600-token prompts, 8 out  -> Q6 ratio triggers
    pd-balanced       P/D via the router, 400-token prompts, 100 out -> Q6 ratio does not

Capacity estimates (Q6) use a 70B model on T4s (`--gpu T4`), so that a few requests per second are
"enough traffic" for the per-replica throughput estimates to matter.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import string
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from splitserve.api.spec import InferenceDeploymentSpec
from splitserve.diagnosis.findings import QuestionResult
from splitserve.diagnosis.report import Report
from splitserve.io.telemetry import run_diagnosis
from splitserve.router.app import Router, RouterServer
from splitserve.router.config import RouterConfig
from splitserve.sim import EngineLimits, LatencyModel, Role, SimConfig, SimWorker
from testkit.prometheus import PrometheusServer, ScrapeTarget, requires_prometheus

pytestmark = [pytest.mark.prometheus, pytest.mark.slow, requires_prometheus]

NAMESPACE = "sims"
MODEL = "sim-model"
WINDOW = "20s"
LOAD_S = 24.0  # the window must be full of scrapes under load before the diagnosis reads it
GPU = "T4"

# A made-up engine fast enough to keep the test short and slow enough that one Python process runs
# a dozen of them: a decode step of 25 ms (+0.5 ms per sequence), prefill at 10k tokens/s.
LATENCY = LatencyModel(
    prefill_overhead_s=0.01,
    prefill_per_token_s=0.0001,
    decode_base_s=0.025,
    decode_per_seq_s=0.0005,
    kv_transfer_overhead_s=0.002,
    kv_transfer_per_block_s=0.0001,
)
SLOW_DECODE = dataclasses.replace(LATENCY, decode_base_s=0.06)
LIMITS = EngineLimits(
    block_size=16, num_kv_blocks=4096, max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=2048
)
KV_STARVED = dataclasses.replace(LIMITS, num_kv_blocks=64, max_model_len=1024)  # 1024 tokens of KV in all
FOUR_SLOTS = dataclasses.replace(LIMITS, max_num_seqs=4)


# --------------------------------------------------------------------------- prompts


# Three-letter words: one simulator token each, and four bytes ("abc ") = one token for the router's
# bytes/4 estimate, so the router's and the engines' prompt lengths agree.
def words(rng: random.Random, count: int) -> str:
    return " ".join("".join(rng.choices(string.ascii_lowercase, k=3)) for _ in range(count))


SHARED_DOCUMENT = words(random.Random(7), 400)


def unique_prompt(length: int) -> Callable[[random.Random, int], str]:
    return lambda rng, _i: words(rng, length)


def rag_prompt(rng: random.Random, _i: int) -> str:
    return f"{SHARED_DOCUMENT} {words(rng, 12)}"


def fixed(tokens: int) -> Callable[[int], int]:
    return lambda _i: tokens


def alternating(short: int, long: int) -> Callable[[int], int]:
    return lambda i: short if i % 2 else long


# --------------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class Workload:
    """A deployment of simulated engines and the closed-loop load driven against it."""

    name: str
    engines: tuple[tuple[Role, LatencyModel, EngineLimits], ...]
    concurrency: int
    prompt: Callable[[random.Random, int], str]
    max_tokens: Callable[[int], int]
    router: bool = False  # requests go through a router (its metrics are scraped too)


def aggregated(
    latency: LatencyModel = LATENCY, limits: EngineLimits = LIMITS
) -> tuple[Role, LatencyModel, EngineLimits]:
    return (Role.AGGREGATED, latency, limits)


PD = ((Role.PREFILL, LATENCY, LIMITS), (Role.DECODE, LATENCY, LIMITS))

WORKLOADS = (
    Workload("rag", (aggregated(),), 2, rag_prompt, fixed(8)),
    Workload("unique-chat", (aggregated(),), 3, unique_prompt(400), fixed(64), router=True),
    Workload("mixed-lengths", (aggregated(),), 4, unique_prompt(40), alternating(4, 300), router=True),
    Workload("kv-starved", (aggregated(limits=KV_STARVED),), 8, unique_prompt(100), fixed(200)),
    Workload("low-batch-slow", (aggregated(SLOW_DECODE),), 2, unique_prompt(20), fixed(100)),
    Workload("high-batch-slow", (aggregated(SLOW_DECODE),), 40, unique_prompt(20), fixed(100)),
    Workload("agg-overloaded", (aggregated(limits=FOUR_SLOTS),), 12, unique_prompt(600), fixed(40)),
    Workload("pd-prompt-heavy", PD, 4, unique_prompt(600), fixed(8), router=True),
    Workload("pd-balanced", PD, 16, unique_prompt(400), fixed(100), router=True),
)


# --------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    """One diagnosis of one workload's telemetry under one spec, and what its verdict must be."""

    id: str
    workload: str
    question: str
    expect: Callable[[QuestionResult], bool]
    spec: Mapping[str, Any] = field(default_factory=dict)
    gpu: str = GPU  # the datasheet the capacity estimate may cross-check against


AGGREGATED: dict[str, Any] = {"mode": "aggregated", "decode": {"replicas": 2}}
DISAGGREGATED: dict[str, Any] = {
    "mode": "disaggregated",
    "kvTransfer": {"connector": "NixlConnector"},
    "prefill": {"replicas": 1},
    "decode": {"replicas": 1},
}
SPECULATIVE_ON = {"engine": {"speculativeDecoding": {"method": "ngram", "numSpeculativeTokens": 3}}}
SPECULATIVE_OFF = {"engine": {"speculativeDecoding": {"method": "off"}}}
# The ratio cases size on a datasheet (neither pool is saturated): one close enough to the simulated
# engines that the observed throughput stays within 2x of it (beyond that the datasheet is set aside).
SMALLER_MODEL = {"model": {"parameterCount": 15_000_000_000}}
PD_GPU = "A100-80GB"


def merged(*parts: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            out[key] = (
                merged(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), dict) else value
            )
    return out


def is_(status: str, *phrases: str, patch: Mapping[str, Any] | None = None) -> Callable[[QuestionResult], bool]:
    def check(result: QuestionResult) -> bool:
        return (
            result.status == status
            and all(phrase in result.verdict for phrase in phrases)
            and (patch is None or result.patch == patch)
        )

    return check


CASES = (
    # 2. prompt redundancy: a shared document is cached and round-robin/least-loaded scatters it.
    Case(
        "q2-shared-prefix-triggers",
        "rag",
        "prompt-redundancy",
        is_("recommend", "share a cached prefix", patch={"router": {"routingPolicy": {"decode": "prefix-aware"}}}),
        AGGREGATED,
    ),
    Case(
        "q2-shared-prefix-prefix-routed-ok",
        "rag",
        "prompt-redundancy",
        is_("ok", "prefix caching pays"),
        merged(AGGREGATED, {"router": {"routingPolicy": {"decode": "prefix-aware"}}}),
    ),
    Case(
        "q2-unique-prompts-quiet", "unique-chat", "prompt-redundancy", is_("ok", "little prompt redundancy"), AGGREGATED
    ),
    # 3. output-length variance (the router's output-length histogram).
    Case(
        "q3-mixed-lengths-triggers",
        "mixed-lengths",
        "output-variance",
        is_("ok", "high output-length variance"),
        AGGREGATED,
    ),
    Case(
        "q3-fixed-lengths-quiet", "unique-chat", "output-variance", is_("ok", "low output-length variance"), AGGREGATED
    ),
    Case(
        "q3-mixed-lengths-max-num-seqs-problem",
        "mixed-lengths",
        "output-variance",
        is_("problem", "defeats continuous batching", "CV"),
        merged(AGGREGATED, {"engine": {"maxNumSeqs": 4}}),
    ),
    # 4. KV pressure.
    Case("q4-kv-starved-triggers", "kv-starved", "kv-pressure", is_("problem", "KV pressure"), AGGREGATED),
    Case("q4-ample-kv-quiet", "unique-chat", "kv-pressure", is_("ok", "no KV pressure"), AGGREGATED),
    # 5. per-token latency: speculative decoding on at low batch, never at high batch.
    Case(
        "q5-low-batch-triggers-speculative",
        "low-batch-slow",
        "per-token-latency",
        is_("recommend", "over the 30 ms SLO at low load", patch=SPECULATIVE_ON),
        merged(AGGREGATED, {"autoscaling": {"decode": {"itlSloSeconds": 0.03}}}),
    ),
    Case(
        "q5-high-batch-no-speculative",
        "high-batch-slow",
        "per-token-latency",
        is_("problem", "too busy for speculative decoding"),
        merged(AGGREGATED, {"autoscaling": {"decode": {"itlSloSeconds": 0.03}}}),
    ),
    Case(
        "q5-high-batch-turns-speculative-off",
        "high-batch-slow",
        "per-token-latency",
        is_("recommend", "speculative decoding on at high load", patch=SPECULATIVE_OFF),
        merged(AGGREGATED, SPECULATIVE_ON, {"autoscaling": {"decode": {"itlSloSeconds": 0.03}}}),
    ),
    Case(
        "q5-low-batch-keeps-speculative",
        "low-batch-slow",
        "per-token-latency",
        is_("problem", "even with speculative decoding (ngram) on"),
        merged(AGGREGATED, SPECULATIVE_ON, {"autoscaling": {"decode": {"itlSloSeconds": 0.03}}}),
    ),
    # 6. interference (aggregated) and the prefill:decode ratio (disaggregated).
    Case(
        "q6-interference-triggers-disaggregation",
        "agg-overloaded",
        "disaggregation",
        is_("recommend", "prefill/decode interference"),
        AGGREGATED,
    ),
    Case("q6-no-interference-quiet", "unique-chat", "disaggregation", is_("ok", "aggregated is enough"), AGGREGATED),
    Case(
        "q6-prompt-heavy-triggers-ratio",
        "pd-prompt-heavy",
        "disaggregation",
        is_("recommend", "prefill:decode ratio 1.00 but traffic needs"),
        merged(DISAGGREGATED, SMALLER_MODEL),
        gpu=PD_GPU,
    ),
    Case(
        "q6-balanced-ratio-quiet",
        "pd-balanced",
        "disaggregation",
        is_("ok", "fitting prefill:decode ratio"),
        merged(DISAGGREGATED, SMALLER_MODEL),
        gpu=PD_GPU,
    ),
)

MODEL_SPEC = {"model": {"name": MODEL, "source": {"uri": "/nonexistent/model"}, "parameterCount": 70_000_000_000}}


def spec_for(case: Case) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.model_validate(merged(MODEL_SPEC, case.spec))


# --------------------------------------------------------------------------- running it


@contextlib.asynccontextmanager
async def running_router(decode: list[str], prefill: list[str]) -> AsyncIterator[str]:
    config = RouterConfig(
        host="127.0.0.1",
        port=0,
        model=MODEL,
        decode_urls=tuple(decode),
        prefill_urls=tuple(prefill),
        health_interval=0.5,
    )
    server = RouterServer(Router(config))
    port = await server.start("127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.close()


async def drive(session: aiohttp.ClientSession, url: str, workload: Workload, until: float, errors: list[str]) -> None:
    """`concurrency` clients, each sending its next request as soon as the last one is answered."""

    async def client(index: int) -> None:
        rng = random.Random(f"{workload.name}-{index}")
        sent = index
        while time.monotonic() < until:
            body = {"model": MODEL, "prompt": workload.prompt(rng, sent), "max_tokens": workload.max_tokens(sent)}
            sent += workload.concurrency
            try:
                async with session.post(f"{url}/v1/completions", json=body) as response:
                    if response.status != 200:
                        errors.append(f"{workload.name}: HTTP {response.status} {await response.text()}")
                        await asyncio.sleep(0.5)
                    else:
                        await response.read()
            except aiohttp.ClientError as exc:
                errors.append(f"{workload.name}: {exc!r}")
                await asyncio.sleep(0.5)

    await asyncio.gather(*(client(i) for i in range(workload.concurrency)))


async def run_everything(workdir: Path) -> tuple[dict[str, Report], list[str]]:
    prometheus = PrometheusServer(workdir / "prometheus")
    errors: list[str] = []
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(prometheus.stop)
        entry: dict[str, str] = {}
        for workload in WORKLOADS:
            labels = {"namespace": NAMESPACE, "deployment": workload.name}
            workers: dict[Role, list[str]] = {}
            for role, latency, limits in workload.engines:
                config = SimConfig(role=role, model=MODEL, latency=latency, limits=limits, time_scale=1.0)
                worker = await stack.enter_async_context(SimWorker(config))
                workers.setdefault(role, []).append(worker.url)
                prometheus.targets.append(ScrapeTarget(f"127.0.0.1:{worker.port}", {**labels, "role": role.value}))
            if workload.router:
                decode = workers.get(Role.DECODE, []) + workers.get(Role.AGGREGATED, [])
                address = await stack.enter_async_context(running_router(decode, workers.get(Role.PREFILL, [])))
                prometheus.targets.append(ScrapeTarget(address, {**labels, "role": "router"}))
                entry[workload.name] = f"http://{address}"
            else:
                entry[workload.name] = next(iter(workers.values()))[0]
        await prometheus.start()
        session = await stack.enter_async_context(
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=60))
        )
        until = time.monotonic() + LOAD_S + 30  # the load outlives the diagnosis
        load = asyncio.gather(*(drive(session, entry[w.name], w, until, errors) for w in WORKLOADS))
        try:
            await asyncio.sleep(LOAD_S)
            reports: dict[str, Report] = {}
            for case in CASES:
                reports[case.id] = await run_diagnosis(
                    spec_for(case),
                    name=case.workload,
                    namespace=NAMESPACE,
                    prometheus_url=prometheus.url,
                    gpu=case.gpu,
                    window=WINDOW,
                    cache_dirs=[workdir / "no-hf-cache"],
                )
        finally:
            load.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await load
    return reports, errors


@pytest.fixture(scope="module")
def diagnosed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, Report], list[str]]]:
    # One run for the whole module: sims, routers and Prometheus start once (a fresh event loop of its own).
    yield asyncio.run(run_everything(tmp_path_factory.mktemp("sim-workloads")))


def test_load_ran_without_errors(diagnosed: tuple[dict[str, Report], list[str]]) -> None:
    _, errors = diagnosed
    assert not errors, errors[:5]


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_verdict(case: Case, diagnosed: tuple[dict[str, Report], list[str]]) -> None:
    reports, _ = diagnosed
    report = reports[case.id]
    assert report.inp.telemetry is not None, report.inp.telemetry_note
    result = next(r for r in report.results if r.key == case.question)
    assert case.expect(result), f"{case.id}: {result.status}: {result.verdict}\n\n{report.text()}"
