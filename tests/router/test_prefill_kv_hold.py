"""A prefill worker being scaled down stays until the decode workers have pulled every KV block it
holds for in-flight requests (SimWorker.drain waits for `engine.num_held == 0`, as a vLLM prefill
pod's preStop/drain must wait for its NIXL pulls).

Decode is the bottleneck on purpose: it runs two sequences at a time and generates long answers,
so prefilled requests queue inside decode before it pulls their KV (vLLM pulls when it schedules
the request), and the prefill worker holds KV for many of them when its drain starts. The test runs
the same drain twice:

- hold ignored (the prefill engine pretends it holds nothing, so the drain stops it as soon as its
  own requests are answered): decode's pulls fail (`vllm:nixl_num_failed_transfers`) and the router
  has to recompute those prompts on decode (`splitserve_router_fallbacks_total{reason="decode_kv_error"}`);
- hold honoured: zero failed pulls, zero fallbacks, every request answered in full, drain in time.

The first case is the control: it shows the scenario does strand KV, so the second one proves the
hold rather than passing for lack of held KV.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass

import httpx
import pytest

from splitserve.router.app import Router
from splitserve.sim import SimConfig, SimWorker
from splitserve.sim.engine import SimEngine
from tests.router.conftest import metric_value, router_config, running_router, sim_config, wait_until

pytestmark = pytest.mark.slow
PROMPT = "shared system prompt " * 60  # well over the disaggregation threshold
MAX_TOKENS = 16
REQUESTS = 24
# KV held for this many requests when the drain starts: enough that losing it cannot go unnoticed.
HELD_AT_DRAIN = 6


class HoldIgnoringEngine(SimEngine):
    """A prefill engine whose drain does not wait for decode pulls: reports no held KV."""

    @property
    def num_held(self) -> int:
        return 0

    @property
    def actually_held(self) -> int:
        return super().num_held


def held_kv(engine: SimEngine) -> int:
    """KV entries the engine really holds, whether or not it admits to them."""
    return engine.actually_held if isinstance(engine, HoldIgnoringEngine) else engine.num_held


@dataclass(frozen=True)
class DrainResult:
    answers: list[str]
    drained: bool
    held_at_drain: int
    failed_pulls: float
    fallbacks: float


def config(role: str) -> SimConfig:
    base = sim_config(role, time_scale=0.2)
    if role == "decode":
        # Two sequences at a time: prefilled requests queue in decode, their KV held on prefill.
        return dataclasses.replace(base, limits=dataclasses.replace(base.limits, max_num_seqs=2))
    return base


async def one_request(client: httpx.AsyncClient, index: int) -> str:
    """'ok' for a full answer, else what went wrong."""
    body = {"model": "sim-model", "prompt": f"{PROMPT} user {index}", "max_tokens": MAX_TOKENS}
    try:
        response = await client.post("/v1/completions", json=body)
    except httpx.HTTPError as error:
        return f"request {index}: {type(error).__name__}: {error}"
    if response.status_code != 200 or response.json()["usage"]["completion_tokens"] != MAX_TOKENS:
        return f"request {index}: {response.status_code}: {response.text[:200]}"
    return "ok"


def fallbacks(router: Router) -> float:
    return sum(
        metric_value(router, "splitserve_router_fallbacks_total", {"reason": reason})
        for reason in ("decode_kv_error", "prefill_failed", "prefill_unavailable", "prefill_no_kv_params")
    )


async def drain_prefill_while_it_holds_kv(*, honour_hold: bool) -> DrainResult:
    leaving, staying, decode = SimWorker(config("prefill")), SimWorker(config("prefill")), SimWorker(config("decode"))
    workers = [leaving, staying, decode]
    for worker in workers:
        await worker.start()
    if not honour_hold:
        assert leaving.engine is not None
        leaving.engine.__class__ = HoldIgnoringEngine
    cfg = router_config(prefill_urls=(leaving.url, staying.url), decode_urls=(decode.url,), queue_timeout=60.0)
    try:
        async with (
            running_router(cfg) as (router, url),
            httpx.AsyncClient(base_url=url, timeout=120) as client,
        ):
            load = [asyncio.create_task(one_request(client, i)) for i in range(REQUESTS)]
            assert leaving.engine is not None
            engine = leaving.engine
            await wait_until(lambda: held_kv(engine) >= HELD_AT_DRAIN, within=30)
            held_at_drain = held_kv(engine)
            # Kubernetes: the endpoint turns terminating (no new prefills), then SIGTERM starts the drain.
            router.prefill.set_endpoints([staying.url], [leaving.url])
            drained = await leaving.drain(60)
            answers = await asyncio.gather(*load)
            return DrainResult(
                answers=list(answers),
                drained=drained,
                held_at_drain=held_at_drain,
                failed_pulls=decode.metric("vllm:nixl_num_failed_transfers_total"),
                fallbacks=fallbacks(router),
            )
    finally:
        for worker in workers:
            await worker.stop()


async def test_prefill_drain_that_ignores_held_kv_strands_decode_pulls() -> None:
    """Control: without the hold the scenario loses KV, so the next test can fail."""
    result = await drain_prefill_while_it_holds_kv(honour_hold=False)
    assert result.held_at_drain >= HELD_AT_DRAIN
    assert result.failed_pulls > 0, "decode pulled KV from a prefill worker that was already gone"
    assert result.fallbacks > 0, "the router recomputed the stranded prompts on decode"
    # The router recovers every request by recomputing on decode: a cost, not a lost answer.
    assert result.answers == ["ok"] * REQUESTS


async def test_prefill_drain_waits_until_decode_pulled_the_kv_it_holds() -> None:
    result = await drain_prefill_while_it_holds_kv(honour_hold=True)
    assert result.held_at_drain >= HELD_AT_DRAIN
    assert result.drained, "the prefill worker drained within its grace period"
    assert result.failed_pulls == 0, "every KV pull found its blocks"
    assert result.fallbacks == 0, "no prompt was recomputed on decode"
    assert result.answers == ["ok"] * REQUESTS
