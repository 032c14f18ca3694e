"""Fault injection, draining and client disconnects."""

from __future__ import annotations

import asyncio
import dataclasses

import aiohttp
import pytest
from sim_helpers import fast_config, plain_values, post

from splitserve.sim import FaultConfig, SimWorker

BODY = {"prompt": "tell me a story", "max_tokens": 8}


async def test_admin_faults_toggle_500_and_recovery(http: aiohttp.ClientSession) -> None:
    async with SimWorker(fast_config()) as worker:
        status, _ = await post(http, worker.url + "/v1/completions", BODY)
        assert status == 200
        status, state = await post(http, worker.url + "/admin/faults", {"status": 500})
        assert status == 200 and state["status"] == 500
        status, error = await post(http, worker.url + "/v1/completions", BODY)
        assert status == 500 and "injected" in error["error"]["message"]
        async with http.get(worker.url + "/admin/faults") as reply:
            assert (await reply.json())["status"] == 500
        await post(http, worker.url + "/admin/faults", {"status": None})
        status, _ = await post(http, worker.url + "/v1/completions", BODY)
        assert status == 200
        status, error = await post(http, worker.url + "/admin/faults", {"fail_rate": 7})
        assert status == 400 and "fail_rate" in error["error"]["message"]


async def test_fail_rate_fails_roughly_that_share(http: aiohttp.ClientSession) -> None:
    async with SimWorker(fast_config(faults=FaultConfig(fail_rate=0.5), seed=3)) as worker:
        statuses = [(await post(http, worker.url + "/v1/completions", {**BODY, "max_tokens": 1}))[0] for _ in range(60)]
    assert set(statuses) == {200, 500}
    assert 10 <= statuses.count(500) <= 50


async def test_fail_after_tokens_drops_the_stream(http: aiohttp.ClientSession) -> None:
    config = fast_config(faults=FaultConfig(fail_after_tokens=3))
    async with SimWorker(config) as worker:
        received: list[bytes] = []
        with pytest.raises(aiohttp.ClientError):
            async with http.post(worker.url + "/v1/completions", json={**BODY, "stream": True}) as reply:
                assert reply.status == 200
                async for line in reply.content:
                    if line.startswith(b"data: "):
                        received.append(line)
        assert len(received) == 3 and not any(b"[DONE]" in line for line in received)
        with pytest.raises(aiohttp.ClientError):
            await post(http, worker.url + "/v1/completions", BODY)
        # Requests shorter than the limit are unaffected.
        status, _ = await post(http, worker.url + "/v1/completions", {**BODY, "max_tokens": 2})
        assert status == 200
        await asyncio.sleep(0.05)
        assert plain_values(worker.metrics_text())["vllm:num_requests_running"] == 0


async def test_drain_refuses_new_work_and_finishes_in_flight(http: aiohttp.ClientSession) -> None:
    worker = SimWorker(fast_config(time_scale=0.2))
    await worker.start()
    try:
        long = asyncio.create_task(post(http, worker.url + "/v1/completions", {**BODY, "max_tokens": 400}))
        await asyncio.sleep(0.05)
        assert worker.in_flight == 1
        drained = asyncio.create_task(worker.drain(grace_s=10))
        await asyncio.sleep(0.01)
        status, error = await post(http, worker.url + "/v1/completions", BODY)
        assert status == 503 and error["error"]["code"] == 503
        async with http.get(worker.url + "/health") as reply:
            assert reply.status == 503
        status, body = await long
        assert status == 200 and body["usage"]["completion_tokens"] == 400
        assert await drained is True
    finally:
        await worker.stop()


async def test_client_disconnect_aborts_the_request(http: aiohttp.ClientSession) -> None:
    async with SimWorker(fast_config(time_scale=0.5)) as worker:
        async with http.post(worker.url + "/v1/completions", json={**BODY, "max_tokens": 500, "stream": True}) as reply:
            await reply.content.readline()
            assert plain_values(worker.metrics_text())["vllm:num_requests_running"] == 1
        for _ in range(50):
            values = plain_values(worker.metrics_text())
            if values["vllm:num_requests_running"] == 0:
                break
            await asyncio.sleep(0.02)
        assert values["vllm:num_requests_running"] == 0
        assert values["vllm:kv_cache_usage_perc"] == 0
        assert values["vllm:generation_tokens_total"] < 500


def test_invalid_config_is_refused() -> None:
    limits = dataclasses.replace(fast_config().limits, num_kv_blocks=1)
    with pytest.raises(ValueError, match="cannot hold one request"):
        SimWorker(fast_config(limits=limits))
