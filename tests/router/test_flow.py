"""The P/D flow against simulated prefill and decode workers."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import aiohttp
import orjson
import pytest

from splitserve.sim import SimWorker
from testkit.router import external_kv_tokens, metric_value, router_config, running_router, sim_config

METRICS_DOC = Path(__file__).resolve().parents[2] / "workers" / "router" / "METRICS.md"


async def _post(
    url: str, body: dict[str, object], headers: dict[str, str] | None = None
) -> tuple[int, bytes, dict[str, str]]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body, headers=headers) as response:
        return response.status, await response.read(), {k.lower(): v for k, v in response.headers.items()}


async def test_disaggregated_completion_uses_transferred_kv() -> None:
    async with SimWorker(sim_config("prefill")) as prefill, SimWorker(sim_config("decode")) as decode:
        config = router_config(prefill_urls=(prefill.url,), decode_urls=(decode.url,))
        async with running_router(config) as (router, url):
            prompt = "the quick brown fox jumps over the lazy dog " * 5
            status, body, headers = await _post(
                url + "/v1/completions",
                {"model": "sim-model", "prompt": prompt, "max_tokens": 8},
                headers={"X-Request-Id": "req-abc"},
            )
            assert status == 200, body
            answer = orjson.loads(body)
            assert answer["usage"]["completion_tokens"] == 8
            assert headers["x-request-id"] == "req-abc"
            assert external_kv_tokens(decode) == answer["usage"]["prompt_tokens"]
            assert (
                metric_value(
                    router, "splitserve_router_requests_total", {"outcome": "success", "mode": "disaggregated"}
                )
                == 1
            )
            assert metric_value(router, "splitserve_router_kv_handoff_seconds_count") == 1
            # The legs of the TTFT: one wait per pool and one prefill leg.
            assert metric_value(router, "splitserve_router_prefill_seconds_count") == 1
            for pool in ("prefill", "decode"):
                assert metric_value(router, "splitserve_router_queue_wait_seconds_count", {"pool": pool}) == 1

        # Same prompt straight to an aggregated path gives the same text: KV transfer changed nothing.
        async with SimWorker(sim_config("aggregated")) as single:
            _, alone, _ = await _post(
                single.url + "/v1/completions", {"model": "sim-model", "prompt": prompt, "max_tokens": 8}
            )
        assert orjson.loads(alone)["choices"][0]["text"] == answer["choices"][0]["text"]


async def test_streaming_chat_relays_every_event() -> None:
    async with SimWorker(sim_config("prefill")) as prefill, SimWorker(sim_config("decode")) as decode:
        config = router_config(prefill_urls=(prefill.url,), decode_urls=(decode.url,))
        async with running_router(config) as (router, url):
            body = {
                "model": "sim-model",
                "messages": [{"role": "user", "content": "hello there, how are you today?"}],
                "max_tokens": 6,
                "stream": True,
            }
            status, raw, headers = await _post(url + "/v1/chat/completions", body)
            assert status == 200
            assert headers["content-type"].startswith("text/event-stream")
            events = [line for line in raw.decode().split("\n\n") if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
            assert len(events) >= 7  # six tokens (maybe a role chunk) and [DONE]
            assert metric_value(router, "splitserve_router_ttft_seconds_count") == 1
            assert metric_value(router, "splitserve_router_output_tokens_sum") >= 6
            assert external_kv_tokens(decode) > 0


async def test_short_prompts_skip_prefill_below_threshold() -> None:
    async with SimWorker(sim_config("prefill")) as prefill, SimWorker(sim_config("decode")) as decode:
        config = router_config(prefill_urls=(prefill.url,), decode_urls=(decode.url,), disagg_threshold_tokens=100)
        async with running_router(config) as (router, url):
            status, _, _ = await _post(
                url + "/v1/completions", {"model": "sim-model", "prompt": "short", "max_tokens": 2}
            )
            assert status == 200
            assert (
                metric_value(router, "splitserve_router_requests_total", {"outcome": "success", "mode": "aggregated"})
                == 1
            )
            assert external_kv_tokens(decode) == 0
            status, _, _ = await _post(
                url + "/v1/completions", {"model": "sim-model", "prompt": "x" * 800, "max_tokens": 2}
            )
            assert status == 200
            assert (
                metric_value(
                    router, "splitserve_router_requests_total", {"outcome": "success", "mode": "disaggregated"}
                )
                == 1
            )


async def test_decode_only_deployment_serves_aggregated() -> None:
    async with (
        SimWorker(sim_config("aggregated")) as worker,
        running_router(router_config(decode_urls=(worker.url,))) as (router, url),
    ):
        status, _, _ = await _post(url + "/v1/completions", {"model": "sim-model", "prompt": "hi", "max_tokens": 2})
        assert status == 200
        assert (
            metric_value(router, "splitserve_router_requests_total", {"outcome": "success", "mode": "aggregated"}) == 1
        )
        assert metric_value(router, "splitserve_router_fallbacks_total", {"reason": "prefill_unavailable"}) == 0


async def test_prefill_without_kv_params_falls_back_to_aggregated() -> None:
    # An aggregated engine ignores do_remote_decode and answers kv_transfer_params: null.
    async with SimWorker(sim_config("aggregated")) as not_prefill, SimWorker(sim_config("decode")) as decode:
        config = router_config(prefill_urls=(not_prefill.url,), decode_urls=(decode.url,))
        async with running_router(config) as (router, url):
            status, body, _ = await _post(
                url + "/v1/completions", {"model": "sim-model", "prompt": "a b c d", "max_tokens": 3}
            )
            assert status == 200
            assert orjson.loads(body)["usage"]["completion_tokens"] == 3
            assert metric_value(router, "splitserve_router_fallbacks_total", {"reason": "prefill_no_kv_params"}) == 1
            assert (
                metric_value(router, "splitserve_router_requests_total", {"outcome": "success", "mode": "fallback"})
                == 1
            )


async def test_expired_kv_on_decode_is_retried_aggregated() -> None:
    # The prefill frees its KV at once, so decode's pull fails with "KV transfer failed".
    async with (
        SimWorker(sim_config("prefill", kv_hold_timeout_s=1e-6)) as prefill,
        SimWorker(sim_config("decode")) as decode,
    ):
        config = router_config(prefill_urls=(prefill.url,), decode_urls=(decode.url,))
        async with running_router(config) as (router, url):
            status, body, _ = await _post(
                url + "/v1/completions", {"model": "sim-model", "prompt": "one two three four five", "max_tokens": 4}
            )
            assert status == 200, body
            assert orjson.loads(body)["usage"]["completion_tokens"] == 4
            assert metric_value(router, "splitserve_router_fallbacks_total", {"reason": "decode_kv_error"}) == 1


async def test_models_lists_the_served_model() -> None:
    async with SimWorker(sim_config("aggregated")) as worker:
        for model in ("sim-model", None):  # configured name, or asked from a decode worker
            async with (
                running_router(router_config(decode_urls=(worker.url,), model=model)) as (_, url),
                aiohttp.ClientSession() as session,
                session.get(url + "/v1/models") as response,
            ):
                assert response.status == 200
                assert [m["id"] for m in (await response.json())["data"]] == ["sim-model"]


async def test_metrics_endpoint_exposes_every_documented_name() -> None:
    documented = re.findall(r"^\| `(splitserve_router_\w+)`", METRICS_DOC.read_text(), flags=re.MULTILINE)
    assert len(documented) >= 14
    async with (
        SimWorker(sim_config("prefill")) as prefill,
        SimWorker(sim_config("decode")) as decode,
        running_router(router_config(prefill_urls=(prefill.url,), decode_urls=(decode.url,))) as (_, url),
    ):
        await _post(url + "/v1/completions", {"model": "sim-model", "prompt": "a b c", "max_tokens": 2, "stream": True})
        async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
            text = await response.text()
    exposed = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    for name in documented:
        base = name.removesuffix("_total")
        assert name in exposed or base in exposed, f"{name} is documented but not exposed"
    assert f'splitserve_router_worker_inflight{{pool="decode",worker="{decode.url}"}} 0.0' in text
    assert 'splitserve_router_workers{pool="prefill",state="healthy"} 1.0' in text
    assert 'splitserve_router_queue_depth{pool="decode"} 0.0' in text


async def test_one_json_log_record_per_request(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="splitserve.router.requests")
    async with (
        SimWorker(sim_config("prefill")) as prefill,
        SimWorker(sim_config("decode")) as decode,
        running_router(router_config(prefill_urls=(prefill.url,), decode_urls=(decode.url,))) as (_, url),
    ):
        body = {"model": "sim-model", "prompt": "a b c d", "max_tokens": 3, "stream": True}
        await _post(url + "/v1/completions", body, headers={"X-Request-Id": "log-me"})
        await _post(url + "/v1/completions", {"model": "nope", "prompt": "x"})
    records = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "splitserve.router.requests"]
    assert len(records) == 2
    ok, bad = records
    assert ok["request_id"] == "log-me" and ok["status"] == 200 and ok["mode"] == "disaggregated"
    assert (ok["prefill"], ok["decode"]) == (prefill.url, decode.url)
    assert ok["completion_tokens"] == 3 and ok["ttft_s"] > 0
    assert bad["status"] == 404 and bad["outcome"] == "client_error"
