"""Scale from zero, end to end: a request that arrives while the decode pool is at zero is held by
the router, seen by Prometheus in the router's admission queue, acted on by the real operator's
autoscaler (decode Deployment 0→1 through /scale), and answered in full once the new decode worker
is in the Service's EndpointSlice. Then, with no traffic, the pool goes back to zero after its
scale-down window.

The pieces are real processes or the production code in-process: the API emulator and the kopf
operator as subprocesses, a real Prometheus scraping the router and the workers, the router app
with Kubernetes (EndpointSlice) discovery against the emulator, and simulated vLLM workers. The
test plays kubelet and the endpoints controller: when the Deployment asks for a decode replica it
starts a SimWorker and publishes its endpoint; when the Deployment goes back to zero it marks the
endpoint terminating, drains the worker and removes the endpoint.

A second test starts with BOTH pools at zero (prefill `minReplicas: 0`). The router holds the
request for decode as above, but with no prefill worker it serves it aggregated on the new decode
worker (fallback `prefill_unavailable`); that fallback is the prefill pool's only demand (it has no
queue), so the autoscaler's `prefillFallbacks` signal brings prefill back 0→1 after decode, and
the requests after that go disaggregated again.

`ScaleFromZeroRig` is also the harness of benchmarks/autoscaling/cold_start.py, which times the
phases (queued → scale decision → worker ready → first token). The router's own timeout path (no
scale-up within --queue-timeout → 503 `no_decode_capacity` with Retry-After) is tested in
tests/router/test_faults.py and not repeated here.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from splitserve.router.app import Router
from splitserve.router.config import DiscoveryKind
from splitserve.router.discovery import KubernetesDiscovery, kubeconfig_access
from splitserve.sim import SimWorker
from tests.emulator.fixtures import EmulatorProcess
from tests.operator_e2e.conftest import NAMESPACE, OperatorProcess
from tests.operator_e2e.rig import IDEP, EmulatedDeployment, as_async, eventually
from tests.router.conftest import TIME_SCALE, metric_value, router_config, running_router, sim_config
from tests.support_prometheus import PrometheusServer, ScrapeTarget, requires_prometheus

pytestmark = [requires_prometheus, pytest.mark.prometheus, pytest.mark.emulator, pytest.mark.slow]
PREFILL_IP, DECODE_IP = "127.0.0.11", "127.0.0.21"
PROMPT = "You are a helpful assistant. " * 20
MAX_TOKENS = 16
SUCCESS_DISAGGREGATED = {"outcome": "success", "mode": "disaggregated"}
SUCCESS_FALLBACK = {"outcome": "success", "mode": "fallback"}
KV_LOST_OR_PREFILL_FAILED = ("prefill_failed", "decode_kv_error", "prefill_no_kv_params")


@dataclass(frozen=True)
class ColdStart:
    """One cold start, in seconds since the client sent its request."""

    queued_s: float  # the router holds it in the decode pool's admission queue
    scaled_s: float  # the decode Deployment's spec.replicas is 1 (the operator's /scale landed)
    worker_ready_s: float  # a decode worker is up and in the router's pool (endpoint published)
    first_token_s: float  # the first streamed token reached the client
    answered_s: float  # the stream ended with [DONE]
    answer: str
    completion_tokens: int


@dataclass(frozen=True)
class RigSettings:
    name: str = "coldstart"
    autoscaling_interval_s: int = 1
    scrape_interval: str = "1s"
    scale_down_window_s: int = 5
    # Added between "the Deployment asks for a replica" and "the worker is up": a stand-in for the
    # pod's scheduling, image pull and engine load (0 for the simulator, ~100 s for vLLM-CPU).
    worker_start_delay_s: float = 0.0
    queue_timeout_s: float = 120.0
    # Simulated engine speed: 1.0 is the cpu-tiny profile's (calibrated on vLLM-CPU), the tests' 0.01 is 100x faster.
    time_scale: float = TIME_SCALE
    # 1: a prefill worker is up from the start; 0: the prefill pool starts at zero too.
    prefill_min_replicas: int = 1


class ScaleFromZeroRig(EmulatedDeployment):
    """An InferenceDeployment with decode (and optionally prefill) at minReplicas 0, its router, workers and Prometheus.

    Needs a running emulator with the CRD installed and the operator watching NAMESPACE.
    Use as `async with ScaleFromZeroRig(emulator, workdir) as rig: await rig.cold_start()`.
    """

    def __init__(self, emulator: EmulatorProcess, workdir: Path, settings: RigSettings | None = None) -> None:
        self.settings = settings or RigSettings()
        super().__init__(emulator, workdir, self.settings.name)
        self.prefill_service = f"{self.settings.name}-prefill"
        self.decode_service = f"{self.settings.name}-decode"
        self.prefill = SimWorker(
            sim_config("prefill", host=PREFILL_IP, port=self.port, time_scale=self.settings.time_scale)
        )
        self.prefill_started = False
        self.decode: SimWorker | None = None
        self.router: Router | None = None
        self.router_url = ""
        self.prometheus: PrometheusServer | None = None

    # --- setup ----------------------------------------------------------------------------

    async def _start(self) -> None:
        s = self.settings
        self._stack.push_async_callback(self.api.__aexit__)
        self._stack.push_async_callback(self.prefill.stop)
        if s.prefill_min_replicas > 0:
            await self.prefill.start()
            self.prefill_started = True
        self._stack.push_async_callback(self._stop_decode)
        discovery = KubernetesDiscovery(
            kubeconfig_access(str(self.emulator.kubeconfig)),
            NAMESPACE,
            {"prefill": self.prefill_service, "decode": self.decode_service},
            self.port,
        )
        # The discovery kind matters beyond the discovery object: with the default (static) and no
        # prefill URLs the router believes it has no prefill pool and serves everything aggregated.
        config = router_config(
            discovery=DiscoveryKind.KUBERNETES,
            prefill_service=self.prefill_service,
            decode_service=self.decode_service,
            queue_timeout=s.queue_timeout_s,
        )
        self.router, self.router_url = await self._stack.enter_async_context(running_router(config, discovery))
        router_address = self.router_url.removeprefix("http://")

        def labels(role: str) -> dict[str, str]:
            return {"namespace": NAMESPACE, "deployment": s.name, "role": role}

        # The decode target is there from the start, as the PodMonitor's selector is: down while at zero.
        self.prometheus = PrometheusServer(
            self.workdir / "prometheus",
            [
                ScrapeTarget(router_address, {"namespace": NAMESPACE, "deployment": s.name}),
                ScrapeTarget(f"{PREFILL_IP}:{self.port}", labels("prefill")),
                ScrapeTarget(f"{DECODE_IP}:{self.port}", labels("decode")),
            ],
            scrape_interval=s.scrape_interval,
        )
        await self.prometheus.start()
        self._stack.callback(self.prometheus.stop)
        await self.api.create(*IDEP, self.spec(self.prometheus.url), namespace=NAMESPACE)
        self._stack.push_async_callback(self._delete_deployment)
        prefill_at_start = min(1, s.prefill_min_replicas)
        await eventually(
            lambda: self.replicas_equal(prefill=prefill_at_start, decode=0), "the operator created both pools"
        )
        # The endpoints controller: the prefill pod (if any) is ready, the decode Service has no endpoints.
        await self.publish(self.prefill_service, [PREFILL_IP] if self.prefill_started else [])
        await self.publish(self.decode_service, [])
        router = self.router
        assert router is not None
        await eventually(
            as_async(lambda: len(router.prefill.workers) == prefill_at_start),
            "the router found the prefill worker" if prefill_at_start else "the router sees no prefill worker",
        )
        await self.prometheus.wait_for(
            f'sum(splitserve_router_queue_depth{{deployment="{s.name}",pool="decode"}})', lambda v: v == 0
        )
        # Steady state: the autoscaler has read the zero queue and keeps decode at zero.
        await eventually(self.autoscaler_sees_zero_queue, "an autoscaling decision with decode at 0", limit_s=60)

    def spec(self, prometheus_url: str) -> dict[str, Any]:
        s = self.settings
        return {
            "apiVersion": "splitserve.io/v1alpha1",
            "kind": "InferenceDeployment",
            "metadata": {"name": s.name, "namespace": NAMESPACE},
            "spec": {
                "model": {"name": "sim-model", "source": {"uri": "s3://models/sim-model"}},
                "prefill": {
                    "replicas": min(1, s.prefill_min_replicas),
                    "minReplicas": s.prefill_min_replicas,
                    "maxReplicas": 2,
                },
                "decode": {"replicas": 0, "minReplicas": 0, "maxReplicas": 2},
                "autoscaling": {
                    "enabled": True,
                    "prometheusUrl": prometheus_url,
                    "intervalSeconds": s.autoscaling_interval_s,
                    "scaleDownStabilizationSeconds": s.scale_down_window_s,
                },
            },
        }

    async def _stop_decode(self) -> None:
        if self.decode is not None:
            await self.decode.stop()
            self.decode = None

    # --- reading the cluster ----------------------------------------------------------------

    async def autoscaler_sees_zero_queue(self) -> bool:
        signals = ((await self.status()).get("autoscaling") or {}).get("signals") or {}
        return signals.get("decode.routerQueue") == 0.0 and await self.replicas("decode") == 0

    async def events(self) -> list[dict[str, Any]]:
        events = await self.api.list("v1", "events", namespace=NAMESPACE)
        name = self.settings.name
        return [e for e in events if (e.get("involvedObject") or e.get("regarding") or {}).get("name") == name]

    # --- playing kubelet ----------------------------------------------------------------------

    async def start_decode_worker(self) -> None:
        """What kubelet and the endpoints controller do for a new decode pod, minus the waiting."""
        await asyncio.sleep(self.settings.worker_start_delay_s)
        self.decode = SimWorker(
            sim_config("decode", host=DECODE_IP, port=self.port, time_scale=self.settings.time_scale)
        )
        await self.decode.start()
        await self.publish(self.decode_service, [DECODE_IP])

    async def start_prefill_worker(self) -> None:
        """What kubelet and the endpoints controller do for a new prefill pod."""
        await asyncio.sleep(self.settings.worker_start_delay_s)
        await self.prefill.start()
        self.prefill_started = True
        await self.publish(self.prefill_service, [PREFILL_IP])

    async def remove_decode_worker(self) -> None:
        """A decode pod going away: endpoint terminating, drain, endpoint removed."""
        await self.publish(self.decode_service, [], [DECODE_IP])
        if self.decode is not None:
            await self.decode.drain(30)
            self.decode = None
        await self.publish(self.decode_service, [])

    # --- the measured path ---------------------------------------------------------------------

    async def cold_start(self, client: httpx.AsyncClient | None = None) -> ColdStart:
        """Send one streaming request with decode at zero; play kubelet when the operator scales."""
        assert self.router is not None
        router = self.router
        owned = client is None
        http = client or httpx.AsyncClient(base_url=self.router_url, timeout=self.settings.queue_timeout_s + 60)
        request: asyncio.Task[tuple[float, float, str, int]] | None = None
        try:
            assert await self.replicas("decode") == 0 and not router.decode.workers, "decode must start at zero"
            sent = time.monotonic()
            request = asyncio.create_task(self._stream(http, sent))
            await eventually(
                as_async(lambda: metric_value(router, "splitserve_router_queue_depth", {"pool": "decode"}) >= 1),
                "the router holds the request",
                limit_s=10,
                every_s=0.005,
            )
            queued = time.monotonic() - sent
            await eventually(lambda: self.replicas_equal(decode=1), "the operator scales decode 0→1", limit_s=90)
            scaled = time.monotonic() - sent
            await self.start_decode_worker()
            await eventually(
                as_async(lambda: len(router.decode.workers) == 1),
                "the router found the decode worker",
                every_s=0.005,
            )
            worker_ready = time.monotonic() - sent
            first_token, answered, text, tokens = await request
        finally:
            if request is not None and not request.done():
                request.cancel()  # a phase timed out: do not leave the client waiting on the loop
                with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                    await request
            if owned:
                await http.aclose()
        return ColdStart(queued, scaled, worker_ready, first_token, answered, text, tokens)

    async def _stream(self, client: httpx.AsyncClient, sent: float) -> tuple[float, float, str, int]:
        body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True}
        first_token: float | None = None
        pieces: list[str] = []
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise AssertionError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
            done = False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    done = True
                    break
                event = orjson.loads(data)
                if "error" in event:
                    raise AssertionError(f"error event in the stream: {event}")
                if first_token is None:
                    first_token = time.monotonic() - sent
                pieces.extend(choice.get("text", "") for choice in event.get("choices", []))
        assert done and first_token is not None, "the stream ended without [DONE]"
        tokens = sum(1 for piece in pieces if piece)
        return first_token, time.monotonic() - sent, "".join(pieces), tokens

    async def back_to_zero(self) -> float:
        """Wait for the autoscaler to return decode to zero, then remove the worker; seconds waited."""
        started = time.monotonic()
        # Besides the scale-down window, a latency proposal keeps one replica while the p90 over
        # rate(...[1m]) still has samples of the last request: up to a minute more.
        limit = self.settings.scale_down_window_s + 3 * self.settings.autoscaling_interval_s + 90
        await eventually(lambda: self.replicas_equal(decode=0), "decode back to zero", limit_s=limit, every_s=0.1)
        waited = time.monotonic() - started
        await self.remove_decode_worker()
        assert self.router is not None
        router = self.router
        await eventually(as_async(lambda: not router.decode.workers), "the router dropped the decode worker")
        return waited


# --------------------------------------------------------------------------- the test


@pytest.fixture
async def rig(cluster: tuple[EmulatorProcess, OperatorProcess], tmp_path: Path) -> AsyncIterator[ScaleFromZeroRig]:
    async with ScaleFromZeroRig(cluster[0], tmp_path) as started:
        yield started


async def test_request_at_zero_decode_is_held_scaled_for_and_answered_then_decode_returns_to_zero(
    rig: ScaleFromZeroRig,
) -> None:
    assert rig.router is not None
    start = await rig.cold_start()

    # The held request was answered in full, through prefill and decode (no aggregated fallback).
    assert start.completion_tokens == MAX_TOKENS
    assert start.queued_s < start.scaled_s <= start.worker_ready_s <= start.first_token_s <= start.answered_s
    router = rig.router
    # The router counts a request when its handler returns, just after the client read [DONE].
    await eventually(
        as_async(lambda: metric_value(router, "splitserve_router_requests_total", SUCCESS_DISAGGREGATED) == 1),
        "the router counted one disaggregated success",
        limit_s=5,
    )
    assert sum(metric_value(rig.router, "splitserve_router_fallbacks_total", {"reason": r})
               for r in ("prefill_unavailable", "prefill_failed", "decode_kv_error")) == 0  # fmt: skip
    assert rig.decode is not None
    assert rig.decode.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") > 0

    # The operator said what it did and why: an Event and status.autoscaling.lastDecisions.
    assert await rig.replicas("decode") == 1 and await rig.replicas("prefill") == 1
    scaled = [e for e in await rig.events() if e.get("reason") == "Scaled" and "decode 0→1" in e.get("message", "")]
    assert scaled, f"no Scaled event for decode 0→1 in {[e.get('message') for e in await rig.events()]}"
    assert "waiting=1" in scaled[0]["message"], scaled[0]["message"]
    decisions = (await rig.status())["autoscaling"]["lastDecisions"]
    up = next(d for d in decisions if d["pool"] == "decode" and d["toReplicas"] == 1)
    assert up["fromReplicas"] == 0 and "waiting=1" in up["reason"]

    # No traffic: decode returns to zero, but not before its scale-down window.
    waited = await rig.back_to_zero()
    assert waited >= rig.settings.scale_down_window_s - 2, f"scaled down after {waited:.1f}s"
    down = next(d for d in (await rig.status())["autoscaling"]["lastDecisions"] if d["pool"] == "decode")
    assert (down["fromReplicas"], down["toReplicas"]) == (1, 0), down
    assert await rig.replicas("prefill") == 1, "prefill stays at its minReplicas"


async def one_request(client: httpx.AsyncClient, index: int) -> None:
    body = {"model": "sim-model", "prompt": f"{PROMPT} question {index}", "max_tokens": MAX_TOKENS}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text[:300]
    assert response.json()["usage"]["completion_tokens"] == MAX_TOKENS


async def test_both_pools_at_zero_decode_comes_first_then_prefill_returns_on_fallbacks(
    cluster: tuple[EmulatorProcess, OperatorProcess], tmp_path: Path
) -> None:
    # A scale-down window longer than the test: both pools stay up once scaled (not under test here).
    settings = RigSettings(name="bothzero", prefill_min_replicas=0, scale_down_window_s=300)
    async with ScaleFromZeroRig(cluster[0], tmp_path, settings) as rig:
        assert await rig.replicas("prefill") == 0
        router = rig.router
        assert router is not None and not router.prefill.workers

        # The held request: decode 0→1, then answered in full on decode alone (no prefill worker).
        start = await rig.cold_start()
        assert start.completion_tokens == MAX_TOKENS
        await eventually(
            as_async(lambda: metric_value(router, "splitserve_router_requests_total", SUCCESS_FALLBACK) == 1),
            "the router counted one success served without prefill",
            limit_s=5,
        )
        assert metric_value(router, "splitserve_router_fallbacks_total", {"reason": "prefill_unavailable"}) == 1

        # That fallback is prefill's demand: the autoscaler brings prefill back, after decode.
        await eventually(lambda: rig.replicas_equal(prefill=1), "the operator scales prefill 0→1", limit_s=60)

        async def decisions_after_prefill_up() -> list[dict[str, Any]]:
            # /scale lands before the status write: wait for the decision to be recorded too.
            decisions: list[dict[str, Any]] = ((await rig.status()).get("autoscaling") or {}).get("lastDecisions") or []
            return decisions if any(d["pool"] == "prefill" and d["toReplicas"] == 1 for d in decisions) else []

        # Newest first.
        decisions = await eventually(decisions_after_prefill_up, "the prefill decision in status", limit_s=10)
        ups = [
            (d["pool"], d["fromReplicas"], d["toReplicas"]) for d in decisions if d["toReplicas"] > d["fromReplicas"]
        ]
        assert ups[:2] == [("prefill", 0, 1), ("decode", 0, 1)], decisions
        assert "prefill_fallbacks=1" in decisions[0]["reason"], decisions[0]["reason"]

        async def prefill_scaled_events() -> list[dict[str, Any]]:
            events = await rig.events()
            return [e for e in events if e.get("reason") == "Scaled" and "prefill 0→1" in e.get("message", "")]

        scaled = await eventually(prefill_scaled_events, "a Scaled event for prefill 0→1", limit_s=10)
        assert "prefill_fallbacks=1" in scaled[0]["message"], scaled[0]["message"]

        # kubelet: the prefill pod starts; later requests go through prefill and decode again.
        await rig.start_prefill_worker()
        await eventually(as_async(lambda: router.prefill.has_healthy), "the router has a healthy prefill worker")
        async with httpx.AsyncClient(base_url=rig.router_url, timeout=60) as client:
            await asyncio.gather(*(one_request(client, i) for i in range(4)))
        await eventually(
            as_async(lambda: metric_value(router, "splitserve_router_requests_total", SUCCESS_DISAGGREGATED) == 4),
            "the router counted four disaggregated successes",
            limit_s=5,
        )
        assert metric_value(router, "splitserve_router_fallbacks_total", {"reason": "prefill_unavailable"}) == 1
        assert sum(metric_value(router, "splitserve_router_fallbacks_total", {"reason": r})
                   for r in KV_LOST_OR_PREFILL_FAILED) == 0  # fmt: skip
        assert rig.decode is not None
        assert rig.decode.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") > 0
        assert await rig.replicas("prefill") == 1 and await rig.replicas("decode") == 1
