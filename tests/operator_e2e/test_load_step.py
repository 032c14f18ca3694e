"""A load step on real simulated workers scales prefill and decode independently.

The parts are those of test_scale_from_zero.py: the API emulator and the kopf operator as
subprocesses, a real Prometheus scraping the router and every worker, the router with Kubernetes
(EndpointSlice) discovery, and simulated vLLM workers started by the test whenever a Deployment asks
for more replicas (the test plays kubelet and the endpoints controller). Both pools start at 1.

1. A prompt-heavy load (long prompts, max_tokens 1, 24 concurrent clients) piles prompts up on the
   prefill worker: the operator scales prefill up on its `prompts` signal while decode stays at 1.
2. Then an output-heavy load (short prompts, long streamed outputs, 35 concurrent streams) on a
   decode engine that runs at most 4 sequences: requests wait, and the operator scales decode up on
   running+waiting. Every request still goes through prefill (no disaggregation threshold), yet
   prefill does not grow (its scale-down window is longer than the test, so phase 1's growth is
   still visible).

What each pool must not do holds by construction, not by when Prometheus happens to scrape: a
client has one request in flight, so no signal can count more requests than there are clients.
Phase 1's prefill batches finish several prompts at once and they queue on decode for a moment
(pulls count as waiting, as WAITING_FOR_REMOTE_KVS does in vLLM); decode's waiting threshold is the
phase 1 client count, so that queue can never read as saturation. Phase 2 starts with all 35
prompts on prefill at once; the prefill target puts 35 prompts inside the tolerance band of the two
replicas phase 1 grows to (24 prompts need 2, and cannot ask for 3), so prefill cannot grow on them.

Every request of both phases must be answered in full, disaggregated (no fallback, no error).

The engines run at real cpu-tiny speed (time_scale 1: a 1000-token prompt takes ~0.2 s of prefill,
a 150-token output ~1.2 s) so that the load lasts across Prometheus scrapes. The latency SLOs are set
far out of reach so the load signals alone decide, and the Events and status.autoscaling say which
one did: a TTFT p90 over `rate(...[1m])` would still carry phase 1's prompts during phase 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from splitserve.kubeconfig import kubeconfig_access
from splitserve.router.app import Router
from splitserve.router.config import DiscoveryKind
from splitserve.router.discovery import KubernetesDiscovery
from splitserve.sim import SimConfig, SimWorker
from testkit.emulator.fixtures import EmulatorProcess
from testkit.operator import NAMESPACE, OperatorProcess
from testkit.prometheus import PrometheusServer, ScrapeTarget, requires_prometheus
from testkit.rigs.base import IDEP, EmulatedDeployment, as_async, eventually
from testkit.router import metric_value, router_config, running_router, sim_config
from tests.operator_e2e.test_scale_from_zero import SUCCESS_DISAGGREGATED

pytestmark = [requires_prometheus, pytest.mark.prometheus, pytest.mark.emulator, pytest.mark.slow]
NAME = "loadstep"
MAX_REPLICAS = 4
POOL_IPS = {
    "prefill": [f"127.0.0.{31 + i}" for i in range(MAX_REPLICAS)],
    "decode": [f"127.0.0.{41 + i}" for i in range(MAX_REPLICAS)],
}
PROMPT_CLIENTS = 24
STREAM_CLIENTS = 35
PREFILL_AFTER_PHASE_1 = 2
TOLERANCE = 0.1  # spec.autoscaling.tolerance's default: a ratio within 1 +/- 0.1 of target keeps the size
# Prefill: prompts (router queue + waiting + running) over 16 per replica. Phase 1's 24 clients ask for
# ceil(24/16) = 2 replicas and never 3; they scale once more than 16 x 1.1 = 17.6 of them are counted, which
# leaves room for the prompts vLLM's gauges do not show yet (arrived during a step: counted at the next
# one). Phase 2's 35 prompts sit inside the band at 2 replicas (35 <= 2 x 16 x 1.1), so they ask for no more.
PREFILL_PROMPTS_PER_REPLICA = 16
# Decode: at most 4 sequences run per engine. Saturated above 22 x 1.1 = 24.2 waiting per replica: phase
# 1's 24 clients cannot queue more than that, phase 2's 35 streams leave ~31 waiting, and running+waiting
# = 35 at 4/replica asks for 9, capped at maxReplicas.
DECODE_MAX_NUM_SEQS = 4
DECODE_WAITING_PER_REPLICA = 22
LONG_PROMPT = "The quick brown fox jumps over the lazy dog " * 110  # ~1000 tokens for the sim's tokenizer
SHORT_PROMPT = "Tell me a long story."
OUTPUT_TOKENS = 150


def worker_config(pool: str, ip: str, port: int) -> SimConfig:
    config = sim_config(pool, host=ip, port=port, time_scale=1.0)
    if pool == "decode":
        config = dataclasses.replace(
            config, limits=dataclasses.replace(config.limits, max_num_seqs=DECODE_MAX_NUM_SEQS)
        )
    return config


@dataclass
class LoadResult:
    ok: int = 0
    failed: list[str] = field(default_factory=list)


class LoadStepRig(EmulatedDeployment):
    """An InferenceDeployment (both pools 1..4, autoscaling every second), its router, Prometheus,
    and a kubelet that keeps one SimWorker per replica each Deployment asks for."""

    def __init__(self, emulator: EmulatorProcess, workdir: Path) -> None:
        super().__init__(emulator, workdir, NAME)
        self.workers: dict[str, list[SimWorker]] = {"prefill": [], "decode": []}
        # Every replica count the kubelet saw, in order: (monotonic time, pool, replicas).
        self.seen: list[tuple[float, str, int]] = []
        self.router: Router | None = None
        self.router_url = ""
        self.prometheus: PrometheusServer | None = None
        self._kubelet: asyncio.Task[None] | None = None

    def service(self, pool: str) -> str:
        return f"{NAME}-{pool}"

    async def _start(self) -> None:
        self._stack.push_async_callback(self.api.__aexit__)
        self._stack.push_async_callback(self._stop_workers)
        discovery = KubernetesDiscovery(
            kubeconfig_access(str(self.emulator.kubeconfig)),
            NAMESPACE,
            {pool: self.service(pool) for pool in POOL_IPS},
            self.port,
        )
        config = router_config(
            discovery=DiscoveryKind.KUBERNETES,
            prefill_service=self.service("prefill"),
            decode_service=self.service("decode"),
            queue_timeout=120.0,
        )
        self.router, self.router_url = await self._stack.enter_async_context(running_router(config, discovery))
        # Every replica's address is a target from the start, as a PodMonitor's selector is: down until it runs.
        targets = [ScrapeTarget(self.router_url.removeprefix("http://"), {"namespace": NAMESPACE, "deployment": NAME})]
        for pool, ips in POOL_IPS.items():
            labels = {"namespace": NAMESPACE, "deployment": NAME, "role": pool}
            targets += [ScrapeTarget(f"{ip}:{self.port}", labels) for ip in ips]
        self.prometheus = PrometheusServer(self.workdir / "prometheus", targets, scrape_interval="1s")
        await self.prometheus.start()
        self._stack.callback(self.prometheus.stop)
        await self.api.create(*IDEP, self.spec(self.prometheus.url), namespace=NAMESPACE)
        self._stack.push_async_callback(self._delete_deployment)
        await eventually(lambda: self.replicas_equal(prefill=1, decode=1), "the operator created both pools")
        self._kubelet = asyncio.create_task(self._play_kubelet())
        self._stack.push_async_callback(self._stop_kubelet)
        router = self.router
        assert router is not None
        await eventually(
            as_async(lambda: len(router.prefill.workers) == 1 and len(router.decode.workers) == 1),
            "the router found one prefill and one decode worker",
        )
        # Steady state: the autoscaler has read both pools' workers and keeps them at 1.
        await eventually(self._autoscaler_reads_both_pools, "an autoscaling decision with worker data", limit_s=60)

    def spec(self, prometheus_url: str) -> dict[str, Any]:
        return {
            "apiVersion": "splitserve.io/v1alpha1",
            "kind": "InferenceDeployment",
            "metadata": {"name": NAME, "namespace": NAMESPACE},
            "spec": {
                "model": {"name": "sim-model", "source": {"uri": "s3://models/sim-model"}},
                "prefill": {"replicas": 1, "minReplicas": 1, "maxReplicas": MAX_REPLICAS},
                "decode": {"replicas": 1, "minReplicas": 1, "maxReplicas": MAX_REPLICAS},
                "autoscaling": {
                    "enabled": True,
                    "prometheusUrl": prometheus_url,
                    "intervalSeconds": 1,
                    "tolerance": TOLERANCE,
                    # Longer than the test: phase 1's prefill growth is still there in phase 2.
                    "scaleDownStabilizationSeconds": 600,
                    "prefill": {"waitingPerReplica": PREFILL_PROMPTS_PER_REPLICA, "ttftSloSeconds": 600},
                    "decode": {
                        "runningPerReplica": DECODE_MAX_NUM_SEQS,
                        "waitingPerReplica": DECODE_WAITING_PER_REPLICA,
                        "itlSloSeconds": 600,
                    },
                },
            },
        }

    async def _autoscaler_reads_both_pools(self) -> bool:
        signals = (await self.autoscaling()).get("signals") or {}
        return "prefill.waiting" in signals and "decode.running" in signals

    async def no_prompts_left(self) -> bool:
        signals = (await self.autoscaling()).get("signals") or {}
        prompts = [signals.get(f"prefill.{name}") for name in ("routerQueue", "waiting", "running")]
        return all(value == 0.0 for value in prompts)

    async def _stop_kubelet(self) -> None:
        if self._kubelet is not None:
            self._kubelet.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._kubelet

    async def _stop_workers(self) -> None:
        for workers in self.workers.values():
            while workers:
                await workers.pop().stop()

    # --- playing kubelet and the endpoints controller -------------------------------------------

    async def _play_kubelet(self) -> None:
        while True:
            for pool in POOL_IPS:
                wanted = await self.replicas(pool)
                if wanted is not None:
                    self._note(pool, wanted)
                    await self._converge(pool, min(wanted, MAX_REPLICAS))
            await asyncio.sleep(0.1)

    def _note(self, pool: str, replicas: int) -> None:
        last = next((n for _, p, n in reversed(self.seen) if p == pool), None)
        if last != replicas:
            self.seen.append((time.monotonic(), pool, replicas))

    async def _converge(self, pool: str, wanted: int) -> None:
        workers = self.workers[pool]
        if len(workers) == wanted:
            return
        ips = POOL_IPS[pool]
        while len(workers) < wanted:
            worker = SimWorker(worker_config(pool, ips[len(workers)], self.port))
            await worker.start()
            workers.append(worker)
        leaving = workers[wanted:]
        del workers[wanted:]
        ready = ips[: len(workers)]
        gone = ips[len(workers) : len(workers) + len(leaving)]
        await self.publish(self.service(pool), ready, gone)
        for worker in leaving:
            await worker.drain(30)
        if leaving:
            await self.publish(self.service(pool), ready)

    # --- reading the cluster --------------------------------------------------------------------

    async def autoscaling(self) -> dict[str, Any]:
        autoscaling: dict[str, Any] = (await self.status()).get("autoscaling") or {}
        return autoscaling

    async def scaled_events(self, pool: str) -> list[str]:
        events = await self.api.list("v1", "events", namespace=NAMESPACE)
        return [
            e.get("message", "")
            for e in events
            if (e.get("involvedObject") or e.get("regarding") or {}).get("name") == NAME
            and e.get("reason") == "Scaled"
            and e.get("message", "").startswith(f"autoscaler: {pool} ")
        ]

    def max_seen(self, pool: str, since: float = 0.0) -> int:
        before = [n for t, p, n in self.seen if p == pool and t <= since]
        after = [n for t, p, n in self.seen if p == pool and t > since]
        return max(before[-1:] + after)


# --------------------------------------------------------------------------- load


async def completion(client: httpx.AsyncClient, prompt: str, max_tokens: int, result: LoadResult) -> None:
    """One streamed completion; any error or short answer is a failed request."""
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    tokens = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.failed.append(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
                return
            async for line in response.aiter_lines():
                data = line.removeprefix("data: ")
                if not line.startswith("data: ") or data == "[DONE]":
                    continue
                event = orjson.loads(data)
                if "error" in event:
                    result.failed.append(f"error event: {event}")
                    return
                tokens += sum(1 for choice in event.get("choices", []) if choice.get("text"))
    except httpx.HTTPError as error:
        result.failed.append(f"{type(error).__name__}: {error}")
        return
    if tokens != max_tokens:
        result.failed.append(f"{tokens} of {max_tokens} tokens")
    else:
        result.ok += 1


@contextlib.asynccontextmanager
async def closed_loop(url: str, clients: int, request: Callable[[int], tuple[str, int]]) -> AsyncIterator[LoadResult]:
    """`clients` users, each sending its next request when the last one is answered, until the block ends."""
    result = LoadResult()
    stop = asyncio.Event()

    async def user(index: int, client: httpx.AsyncClient) -> None:
        sent = 0
        while not stop.is_set():
            prompt, max_tokens = request(index * 1000 + sent)
            await completion(client, prompt, max_tokens, result)
            sent += 1

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=180, limits=limits) as client:
        users = [asyncio.create_task(user(i, client)) for i in range(clients)]
        try:
            yield result
        finally:
            stop.set()  # every user finishes the request it has in flight: none is cut off
            await asyncio.gather(*users)


def prompt_heavy(n: int) -> tuple[str, int]:
    return f"{LONG_PROMPT} question {n}", 1


def output_heavy(n: int) -> tuple[str, int]:
    return f"{SHORT_PROMPT} {n}", OUTPUT_TOKENS


# --------------------------------------------------------------------------- the test


@pytest.fixture
async def rig(cluster: tuple[EmulatorProcess, OperatorProcess], tmp_path: Path) -> AsyncIterator[LoadStepRig]:
    async with LoadStepRig(cluster[0], tmp_path) as started:
        yield started


async def test_prompt_heavy_load_scales_prefill_and_output_heavy_load_scales_decode(rig: LoadStepRig) -> None:
    # The construction the constants promise (see their comments).
    band = 1 + TOLERANCE
    prefill_grown = PREFILL_AFTER_PHASE_1 * PREFILL_PROMPTS_PER_REPLICA
    assert PREFILL_PROMPTS_PER_REPLICA * band < PROMPT_CLIENTS <= prefill_grown
    assert prefill_grown * band >= STREAM_CLIENTS  # phase 2 stays inside the band at 2 prefill replicas
    assert PROMPT_CLIENTS <= DECODE_WAITING_PER_REPLICA * band < STREAM_CLIENTS - DECODE_MAX_NUM_SEQS
    router = rig.router
    assert router is not None
    assert await rig.replicas_equal(prefill=1, decode=1)

    # 1. Prompt-heavy: long prompts, one output token. Prefill grows on its prompts; decode stays.
    async with closed_loop(rig.router_url, PROMPT_CLIENTS, prompt_heavy) as phase1:
        # Keep the load on until the new prefill workers take traffic (and decode has had its chance to move).
        await new_workers_serving(rig, "prefill", "vllm:prompt_tokens_total", "served prompts")
    # Sync point: the autoscaler has seen the prompts answered (a decision made under load has landed).
    await eventually(rig.no_prompts_left, "an autoscaling decision that sees no prompts left", 30, 0.2)
    phase1_done = time.monotonic()
    prefill_after_1 = await rig.replicas("prefill")
    assert prefill_after_1 == PREFILL_AFTER_PHASE_1, rig.seen
    assert rig.max_seen("decode") == 1, f"decode moved under a prompt-heavy load: {rig.seen}"
    assert phase1.failed == [] and phase1.ok > 0, phase1.failed[:5]
    prefill_events = await rig.scaled_events("prefill")
    first_up = [m for m in prefill_events if m.startswith("autoscaler: prefill 1→")]
    assert len(first_up) == 1 and "prompts=" in first_up[0], prefill_events
    assert not await rig.scaled_events("decode")

    # 2. Output-heavy: short prompts, long outputs (still through prefill). Decode grows on its queue.
    async with closed_loop(rig.router_url, STREAM_CLIENTS, output_heavy) as phase2:
        await new_workers_serving(rig, "decode", "vllm:generation_tokens_total", "generated tokens")
    decode_events = await eventually(lambda: rig.scaled_events("decode"), "a Scaled event for decode", 10)
    first_up = [m for m in decode_events if m.startswith("autoscaler: decode 1→")]
    assert len(first_up) == 1 and "running+waiting=" in first_up[0], decode_events
    assert phase2.failed == [] and phase2.ok > 0, phase2.failed[:5]
    assert rig.max_seen("prefill", since=phase1_done) == prefill_after_1, f"prefill grew in phase 2: {rig.seen}"
    assert len(await rig.scaled_events("prefill")) == len(prefill_events), await rig.scaled_events("prefill")

    # status.autoscaling records both decisions, each with its own pool's signal. Newest first, so the
    # last one kept per pool is its first scale-up (decode may take two steps while its queue builds).
    decisions = (await rig.autoscaling())["lastDecisions"]
    ups = {d["pool"]: d for d in decisions if d["toReplicas"] > d["fromReplicas"]}
    assert set(ups) == {"prefill", "decode"}, decisions
    assert ups["prefill"]["fromReplicas"] == 1 and "prompts=" in ups["prefill"]["reason"], ups["prefill"]
    assert ups["decode"]["fromReplicas"] == 1 and "running+waiting=" in ups["decode"]["reason"], ups["decode"]
    # Every request was answered disaggregated: nothing fell back or failed.
    answered = phase1.ok + phase2.ok
    await eventually(
        as_async(lambda: metric_value(router, "splitserve_router_requests_total", SUCCESS_DISAGGREGATED) == answered),
        f"the router counted {answered} disaggregated successes",
        5,
    )
    assert metric_total(router, "splitserve_router_fallbacks_total") == 0


async def new_workers_serving(rig: LoadStepRig, pool: str, counter: str, what: str) -> None:
    """Wait until `pool` has scaled past its first worker and the new workers' `counter` moved."""
    started = f"{pool} scaled up and its workers started"
    await eventually(as_async(lambda: len(rig.workers[pool]) >= 2), started, 60, 0.1)
    await eventually(
        as_async(lambda: served(rig.workers[pool][1:], counter) > 0), f"the new {pool} workers {what}", 30, 0.1
    )


def served(workers: list[SimWorker], counter: str) -> float:
    return sum(worker.metric(counter) for worker in workers)


def metric_total(router: Router, name: str) -> float:
    total = 0.0
    for family in router.metrics.registry.collect():
        for sample in family.samples:
            if sample.name == name:
                total += sample.value
    return total
