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

The rig, `ScaleFromZeroRig`, is testkit/rigs/scale_from_zero.py, also the harness of
benchmarks/autoscaling/cold_start.py, which times the phases (queued → scale decision → worker ready
→ first token). The router's own timeout path (no scale-up within --queue-timeout → 503
`no_decode_capacity` with Retry-After) is tested in tests/router/test_faults.py and not repeated here.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from testkit.emulator.fixtures import EmulatorProcess
from testkit.operator import OperatorProcess
from testkit.prometheus import requires_prometheus
from testkit.rigs.base import as_async, eventually
from testkit.rigs.scale_from_zero import MAX_TOKENS, PROMPT, RigSettings, ScaleFromZeroRig
from testkit.router import metric_value

pytestmark = [requires_prometheus, pytest.mark.prometheus, pytest.mark.emulator, pytest.mark.slow]
SUCCESS_DISAGGREGATED = {"outcome": "success", "mode": "disaggregated"}
SUCCESS_FALLBACK = {"outcome": "success", "mode": "fallback"}
KV_LOST_OR_PREFILL_FAILED = ("prefill_failed", "decode_kv_error", "prefill_no_kv_params")


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
