"""A prefill worker being scaled down stays until the decode workers have pulled every KV block it
holds for in-flight requests (SimWorker.drain waits for `engine.num_held == 0`, as a vLLM prefill
pod's preStop/drain must wait for its NIXL pulls).

Decode is saturated on purpose, not left to timing. vLLM starts a KV pull only while its batch has
a free slot (fewer than max_num_seqs running), and requests whose KV is being pulled take no slot,
so an idle decode would pull a whole burst at once and the prefill worker would hold it for no more
than a transfer. So the test first fills decode's two slots with two long answers, waits until both
run, and only then sends the burst of short requests: each is prefilled and then waits in decode's
queue while its KV stays held on prefill, until the long answers end (~2 s, some twenty times what
the burst takes to get there; if they ever ended first the test would say so). The drain starts once
every burst request is in that state. The test runs it twice:

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
from testkit.router import metric_value, router_config, running_router, sim_config
from tests.router.conftest import wait_until

pytestmark = pytest.mark.slow
PROMPT = "shared system prompt " * 60  # well over the disaggregation threshold
MAX_TOKENS = 16
REQUESTS = 24
DECODE_SLOTS = 2
# Long answers that keep every decode slot busy while the burst is prefilled and the drain starts.
BUSY_TOKENS = 1500
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
        return dataclasses.replace(base, limits=dataclasses.replace(base.limits, max_num_seqs=DECODE_SLOTS))
    return base


async def one_request(client: httpx.AsyncClient, index: int, max_tokens: int = MAX_TOKENS) -> str:
    """'ok' for a full answer, else what went wrong."""
    body = {"model": "sim-model", "prompt": f"{PROMPT} user {index}", "max_tokens": max_tokens}
    try:
        response = await client.post("/v1/completions", json=body)
    except httpx.HTTPError as error:
        return f"request {index}: {type(error).__name__}: {error}"
    if response.status_code != 200 or response.json()["usage"]["completion_tokens"] != max_tokens:
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
            busy = [asyncio.create_task(one_request(client, REQUESTS + i, BUSY_TOKENS)) for i in range(DECODE_SLOTS)]
            await wait_until(lambda: decode.metric("vllm:num_requests_running") == DECODE_SLOTS, within=30)
            load = [asyncio.create_task(one_request(client, i)) for i in range(REQUESTS)]
            assert leaving.engine is not None and staying.engine is not None
            engine, other = leaving.engine, staying.engine

            def burst_held() -> bool:
                """Every request of the burst is prefilled and waits for a decode slot, its KV held."""
                return held_kv(engine) + held_kv(other) == REQUESTS

            await wait_until(lambda: burst_held() or any(task.done() for task in busy), within=30)
            assert burst_held(), "decode pulled KV with its batch full, or the long answers ended first"
            held_at_drain = held_kv(engine)
            # Kubernetes: the endpoint turns terminating (no new prefills), then SIGTERM starts the drain.
            router.prefill.set_endpoints([staying.url], [leaving.url])
            drained = await leaving.drain(60)
            answers = await asyncio.gather(*load, *busy)
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
    assert result.answers == ["ok"] * (REQUESTS + DECODE_SLOTS)


async def test_prefill_drain_waits_until_decode_pulled_the_kv_it_holds() -> None:
    result = await drain_prefill_while_it_holds_kv(honour_hold=True)
    assert result.held_at_drain >= HELD_AT_DRAIN
    assert result.drained, "the prefill worker drained within its grace period"
    assert result.failed_pulls == 0, "every KV pull found its blocks"
    assert result.fallbacks == 0, "no prompt was recomputed on decode"
    assert result.answers == ["ok"] * (REQUESTS + DECODE_SLOTS)
