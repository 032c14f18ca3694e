"""`ScaleFromZeroRig`: an InferenceDeployment whose decode pool (and optionally prefill pool) starts at
zero, with the router (Kubernetes discovery against the API emulator), simulated vLLM workers and a
real Prometheus, for the real operator's autoscaler to scale from zero. The rig plays kubelet and the
endpoints controller: when the decode Deployment asks for a replica it starts a SimWorker and
publishes its endpoint; when the Deployment goes back to zero it marks the endpoint terminating,
drains the worker and removes the endpoint.

The harness of tests/operator_e2e/test_scale_from_zero.py and of benchmarks/autoscaling/cold_start.py,
which times the phases of `cold_start()` (queued -> scale decision -> worker ready -> first token).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson

from splitserve.kubeconfig import kubeconfig_access
from splitserve.router.app import Router
from splitserve.router.config import DiscoveryKind
from splitserve.router.discovery import KubernetesDiscovery
from splitserve.sim import SimWorker
from testkit.emulator.fixtures import EmulatorProcess
from testkit.operator import NAMESPACE
from testkit.prometheus import PrometheusServer, ScrapeTarget
from testkit.rigs.base import IDEP, EmulatedDeployment, as_async, eventually
from testkit.router import TIME_SCALE, metric_value, router_config, running_router, sim_config

PREFILL_IP, DECODE_IP = "127.0.0.11", "127.0.0.21"
PROMPT = "You are a helpful assistant. " * 20
MAX_TOKENS = 16


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
