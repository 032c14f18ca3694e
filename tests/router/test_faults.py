"""Failure handling on simulated workers: dead workers, broken streams, 500s, overload, disconnects."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

from splitserve.router.config import RouterConfig
from splitserve.sim import SimWorker
from testkit.router import metric_value, router_config, running_router, served, sim_config
from tests.router.conftest import fault, wait_until


async def _post(url: str, body: dict[str, object]) -> tuple[int, bytes, dict[str, str]]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        return response.status, await response.read(), {k.lower(): v for k, v in response.headers.items()}


COMPLETION = {"model": "sim-model", "prompt": "alpha beta gamma delta", "max_tokens": 4}


async def test_decode_killed_mid_stream_gives_an_error_event_not_a_hang() -> None:
    decode_config = sim_config("decode", faults=fault(fail_after_tokens=2))
    async with SimWorker(sim_config("prefill")) as prefill, SimWorker(decode_config) as decode:
        config = router_config(prefill_urls=(prefill.url,), decode_urls=(decode.url,))
        async with running_router(config) as (router, url):
            body = {**COMPLETION, "max_tokens": 20, "stream": True}
            status, raw, _ = await asyncio.wait_for(_post(url + "/v1/completions", body), 10)
            assert status == 200
            events = [e for e in raw.decode().split("\n\n") if e.startswith("data: ")]
            error = orjson.loads(events[-2].removeprefix("data: "))
            assert error["error"]["code"] == "decode_stream_interrupted"
            assert events[-1] == "data: [DONE]"
            assert (
                metric_value(
                    router, "splitserve_router_requests_total", {"outcome": "stream_error", "mode": "disaggregated"}
                )
                == 1
            )


async def test_dead_prefill_worker_means_aggregated_fallback() -> None:
    prefill = SimWorker(sim_config("prefill"))
    await prefill.start()
    dead_url = prefill.url
    await prefill.stop()  # nothing listens there any more
    async with SimWorker(sim_config("decode")) as decode:
        config = router_config(prefill_urls=(dead_url,), decode_urls=(decode.url,), eject_after_failures=2)
        async with running_router(config) as (router, url):
            for _ in range(4):
                status, body, _ = await _post(url + "/v1/completions", COMPLETION)
                assert status == 200, body
            assert (
                metric_value(router, "splitserve_router_fallbacks_total", {"reason": "prefill_failed"}) == 2
            )  # one per failure
            # Ejected after two failures: later requests skip the dead pool without trying it.
            assert metric_value(router, "splitserve_router_fallbacks_total", {"reason": "prefill_unavailable"}) == 2
            assert metric_value(router, "splitserve_router_ejections_total", {"pool": "prefill"}) == 1
            assert (
                metric_value(router, "splitserve_router_requests_total", {"outcome": "success", "mode": "fallback"})
                == 4
            )


async def test_failing_worker_is_ejected_then_readmitted() -> None:
    async with SimWorker(sim_config("aggregated")) as good, SimWorker(sim_config("aggregated")) as bad:
        bad.faults.status = 500
        # Its /health stays 200: a backoff longer than the six requests keeps it out until we look.
        config = router_config(
            decode_urls=(good.url, bad.url), decode_policy="round-robin", eject_after_failures=2, eject_min_seconds=1.0
        )
        async with running_router(config) as (router, url):
            for _ in range(6):
                status, _, _ = await _post(url + "/v1/completions", COMPLETION)
                assert status == 200  # failures on `bad` are retried on `good`
            assert metric_value(router, "splitserve_router_ejections_total", {"pool": "decode"}) == 1
            assert metric_value(router, "splitserve_router_workers", {"pool": "decode", "state": "ejected"}) == 1
            assert metric_value(router, "splitserve_router_retries_total", {"pool": "decode"}) == 2
            bad.faults.status = None  # healthy again (its /health never failed)
            await wait_until(
                lambda: not metric_value(router, "splitserve_router_workers", {"pool": "decode", "state": "ejected"}),
                within=10,
            )
            assert metric_value(router, "splitserve_router_workers", {"pool": "decode", "state": "healthy"}) == 2
            served_before = served(bad)
            for _ in range(4):
                await _post(url + "/v1/completions", COMPLETION)
            assert served(bad) > served_before


async def test_all_decode_attempts_failing_is_a_clear_502() -> None:
    async with (
        SimWorker(sim_config("aggregated", faults=fault(status=500))) as bad,
        running_router(router_config(decode_urls=(bad.url,), max_retries=1)) as (router, url),
    ):
        status, body, _ = await _post(url + "/v1/completions", COMPLETION)
        assert status == 502
        assert orjson.loads(body)["error"]["type"] == "upstream_error"
        assert (
            metric_value(
                router, "splitserve_router_requests_total", {"outcome": "upstream_error", "mode": "aggregated"}
            )
            == 1
        )


async def test_a_decode_failing_only_with_kv_is_retried_whole_on_the_same_worker() -> None:
    """vLLM answers a timed-out NIXL handshake (its fixed 5 s, easily missed on a cold machine) with a
    bare 500 that names no KV: with one decode worker, retrying it with the same KV fails the same way.
    The retry recomputes the prompt there instead, so the request still gets its answer."""
    async with (
        SimWorker(sim_config("prefill")) as prefill,
        SimWorker(sim_config("decode")) as decode,
        running_router(router_config(prefill_urls=(prefill.url,), decode_urls=(decode.url,))) as (router, url),
    ):
        decode.faults.kv_status = 500
        status, body, _ = await _post(url + "/v1/completions", COMPLETION)
        assert status == 200, body
        assert orjson.loads(body)["choices"][0]["text"]
        assert metric_value(router, "splitserve_router_fallbacks_total", {"reason": "decode_retry_without_kv"}) == 1
        assert metric_value(router, "splitserve_router_requests_total", {"outcome": "success", "mode": "fallback"}) == 1
        decode.faults.kv_status = None
        status, _, _ = await _post(url + "/v1/completions", COMPLETION)
        assert status == 200
        assert (
            metric_value(router, "splitserve_router_requests_total", {"outcome": "success", "mode": "disaggregated"})
            == 1
        )


async def test_client_disconnect_cancels_the_upstream_request() -> None:
    slow = sim_config("aggregated", time_scale=1.0)  # real CPU-tiny speed: long enough to hang up on
    async with SimWorker(slow) as worker, running_router(router_config(decode_urls=(worker.url,))) as (router, url):
        body = {**COMPLETION, "max_tokens": 2000, "stream": True}
        async with aiohttp.ClientSession() as session, session.post(url + "/v1/completions", json=body) as response:
            await response.content.readany()
        await wait_until(lambda: router.decode.inflight == 0)
        await wait_until(lambda: _running(worker) == 0)
        assert (
            metric_value(router, "splitserve_router_requests_total", {"outcome": "cancelled", "mode": "aggregated"})
            == 1
        )


def _running(worker: SimWorker) -> float:
    for line in worker.metrics_text().splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_scale_from_zero_holds_requests_until_a_decode_worker_appears() -> None:
    async with SimWorker(sim_config("aggregated")) as worker:
        config = router_config(decode_urls=("http://127.0.0.1:9",), queue_timeout=5.0)
        async with running_router(config) as (router, url):
            router.decode.set_endpoints([])  # scaled to zero
            async with aiohttp.ClientSession() as session:
                async with session.get(url + "/ready") as ready:
                    assert ready.status == 503
                pending = asyncio.ensure_future(_post(url + "/v1/completions", COMPLETION))
                await asyncio.sleep(0.2)
                assert metric_value(router, "splitserve_router_queue_depth", {"pool": "decode"}) == 1
                router.decode.set_endpoints([worker.url])  # the autoscaler brought one up
                status, _, _ = await asyncio.wait_for(pending, 5)
                assert status == 200
                async with session.get(url + "/ready") as ready:
                    assert ready.status == 200
                assert metric_value(router, "splitserve_router_queue_depth", {"pool": "decode"}) == 0


async def test_no_decode_capacity_within_queue_timeout_is_503() -> None:
    config = router_config(decode_urls=("http://127.0.0.1:9",), queue_timeout=0.2)
    async with running_router(config) as (router, url):
        router.decode.set_endpoints([])
        status, body, headers = await _post(url + "/v1/completions", COMPLETION)
        assert status == 503
        assert orjson.loads(body)["error"]["code"] == "no_decode_capacity"
        assert "retry-after" in headers


async def test_full_admission_queue_is_429_with_retry_after() -> None:
    config = router_config(decode_urls=("http://127.0.0.1:9",), queue_limit=2, queue_timeout=0.5)
    async with running_router(config) as (router, url):
        router.decode.set_endpoints([])
        waiting = [asyncio.ensure_future(_post(url + "/v1/completions", COMPLETION)) for _ in range(2)]
        await asyncio.sleep(0.2)
        status, body, headers = await _post(url + "/v1/completions", COMPLETION)
        assert status == 429
        assert headers["retry-after"] == "1"
        assert orjson.loads(body)["error"]["type"] == "rate_limit_error"
        assert [s for s, _, _ in await asyncio.gather(*waiting)] == [503, 503]


@pytest.mark.slow
async def test_two_thousand_mixed_requests_none_lost() -> None:
    async with SimWorker(sim_config("prefill")) as prefill, SimWorker(sim_config("decode")) as decode:
        config: RouterConfig = router_config(
            prefill_urls=(prefill.url,),
            decode_urls=(decode.url,),
            max_inflight_per_worker=64,
            queue_limit=300,
            queue_timeout=30.0,
        )
        async with running_router(config) as (router, url):
            connector = aiohttp.TCPConnector(limit=0)
            # 2000 connections at once on a loaded 2-core CI box: no per-connect deadline (aiohttp's default is
            # 30 s), only an overall one. What is checked is that none is lost, not how fast they come.
            timeout = aiohttp.ClientTimeout(total=600, sock_connect=None, connect=None)
            async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

                async def one(i: int) -> str:
                    body = {
                        "model": "sim-model",
                        "prompt": f"user {i} says hello",
                        "max_tokens": 3,
                        "stream": i % 2 == 0,
                    }
                    async with session.post(url + "/v1/completions", json=body) as response:
                        raw = await response.read()
                        if response.status == 429:
                            return "429"
                        assert response.status == 200, raw
                        if body["stream"]:
                            assert raw.endswith(b"data: [DONE]\n\n") and b'"error"' not in raw
                        else:
                            assert orjson.loads(raw)["usage"]["completion_tokens"] == 3
                        return "ok"

                results = await asyncio.gather(*(one(i) for i in range(2000)))
            assert len(results) == 2000
            answered, refused = results.count("ok"), results.count("429")
            assert answered + refused == 2000
            assert answered >= 300  # at least the first wave of slots and queue got through
            assert (
                metric_value(router, "splitserve_router_requests_total", {"outcome": "rejected", "mode": "none"})
                == refused
            )
            assert router.decode.inflight == 0 and router.prefill.inflight == 0
            assert router.budget.waiting == 0


async def test_a_client_leaving_right_after_done_had_the_whole_answer() -> None:
    """vLLM ends a stream with ``data: [DONE]`` and then, in its own write, the body's last chunk. A
    client (or a proxy: Envoy in front of a sidecar) that closes on [DONE] got the whole answer: that is
    a success, not a 499."""
    from aiohttp import web

    release = asyncio.Event()

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices":[{"text":"hi"}]}\n\n')
        await response.write(b"data: [DONE]\n\n")
        await release.wait()  # the body's end comes later
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", stream)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        config = router_config(decode_urls=(f"http://127.0.0.1:{port}",), model=None)
        async with running_router(config) as (router, url):
            body = orjson.dumps({**COMPLETION, "stream": True})
            reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
            )  # fmt: skip
            received = b""
            while b"data: [DONE]" not in received:
                received += await reader.read(4096)
            writer.close()
            await wait_until(lambda: router.decode.inflight == 0)
            labels = {"mode": "aggregated"}
            assert metric_value(router, "splitserve_router_requests_total", {"outcome": "success", **labels}) == 1
            assert metric_value(router, "splitserve_router_requests_total", {"outcome": "cancelled", **labels}) == 0
    finally:
        release.set()
        await runner.cleanup()
