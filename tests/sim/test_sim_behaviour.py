"""Engine behaviour seen from outside: queueing, batching, prefix caching, metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sim_helpers import fast_config, plain_values, post, sample

from splitserve.sim import SimWorker, generate_text, tokenize
from testkit.router import wait_until

EXPECTED_TYPES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:num_requests_waiting_by_reason": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:prompt_tokens_by_source": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:nixl_num_failed_transfers": "counter",
    "vllm:nixl_num_kv_expired_reqs": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:cache_config_info": "gauge",
}


async def test_metrics_have_vllm_names_types_and_labels(http: aiohttp.ClientSession) -> None:
    async with SimWorker(fast_config(model="tiny")) as worker:
        await post(http, worker.url + "/v1/completions", {"prompt": "one two three", "max_tokens": 5})
        async with http.get(worker.url + "/metrics") as reply:
            assert reply.status == 200 and reply.headers["Content-Type"].startswith("text/plain")
            text = await reply.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert {name: families[name].type for name in EXPECTED_TYPES if name in families} == EXPECTED_TYPES
    for family in families.values():
        assert not family.name.endswith("_created")
        if not family.name.startswith("vllm:"):
            continue
        for s in family.samples:
            assert s.labels["model_name"] == "tiny" and s.labels["engine"] == "0"
    reasons = {s.labels["reason"] for s in families["vllm:num_requests_waiting_by_reason"].samples}
    assert reasons == {"capacity", "deferred"}
    assert sample(text, "vllm:generation_tokens_total") == 5
    assert sample(text, "vllm:prompt_tokens_total") == 3
    assert sample(text, "vllm:time_to_first_token_seconds_count") == 1
    assert sample(text, "vllm:inter_token_latency_seconds_count") == 4
    assert sample(text, "vllm:e2e_request_latency_seconds_count") == 1
    # TPOT as vLLM v1 computes it: the decode phase over the tokens after the first.
    assert sample(text, "vllm:request_time_per_output_token_seconds_count") == 1
    decode_s = sample(text, "vllm:request_decode_time_seconds_sum")
    assert sample(text, "vllm:request_time_per_output_token_seconds_sum") == pytest.approx(decode_s / 4)
    assert sample(text, "vllm:request_success_total", finished_reason="length") == 1
    assert sample(text, "vllm:request_generation_tokens_sum") == 5
    assert sample(text, "vllm:cache_config_info", block_size="128", num_gpu_blocks="512") == 1
    assert sample(text, "splitserve_sim_steps_total") == 5


async def test_queue_gauges_are_the_steps_snapshot_as_vllm_reports_them(http: aiohttp.ClientSession) -> None:
    # vLLM's running/waiting gauges come from the scheduler's stats after each step; a request that
    # arrives mid-step is not "waiting" until a schedule fails to admit it. One batch slot and 2 s
    # decode steps: B arrives during A's step (checked with the step counter, not a clock), is not
    # counted as waiting, and is counted once the next step's schedule leaves it out (A runs on).
    base = fast_config(time_scale=1.0)
    config = dataclasses.replace(
        base,
        latency=dataclasses.replace(base.latency, decode_base_s=2.0),
        limits=dataclasses.replace(base.limits, max_num_seqs=1),
    )
    async with SimWorker(config) as worker:
        engine = worker.engine
        assert engine is not None
        body = {"prompt": "first request", "max_tokens": 8, "stream": True}
        async with http.post(worker.url + "/v1/completions", json=body) as first:
            await first.content.readline()  # A's first token: its prefill step is done, a decode step runs
            step = engine.steps
            second = asyncio.create_task(
                post(http, worker.url + "/v1/completions", {"prompt": "second", "max_tokens": 1})
            )
            await wait_until(lambda: engine.scheduler.num_waiting_for_capacity == 1)
            mid_step = plain_values(worker.metrics_text())
            assert engine.steps == step, "the check must fall inside A's decode step"
            assert mid_step["vllm:num_requests_running"] == 1
            assert mid_step["vllm:num_requests_waiting"] == 0
            # The step B arrived in reports the queue its schedule left (B was not there yet); the
            # next step's schedule finds the slot taken and leaves B waiting.
            await wait_until(lambda: engine.steps >= step + 2, within=15)
            after_step = worker.metrics_text()
            assert sample(after_step, "vllm:num_requests_running") == 1
            assert sample(after_step, "vllm:num_requests_waiting_by_reason", reason="capacity") == 1
        # A's client is gone: the engine aborts A and admits B.
        status, _ = await second
        assert status == 200


async def test_requests_wait_when_kv_is_full_and_complete_later(http: aiohttp.ClientSession) -> None:
    # Two 128-token blocks: each request (5 prompt + 100 output tokens) needs one, so two run at once.
    limits = dataclasses.replace(fast_config().limits, num_kv_blocks=2, max_model_len=256)
    async with SimWorker(fast_config(time_scale=0.2, limits=limits)) as worker:
        prompts = [f"request number {i} please go" for i in range(5)]
        tasks = [
            asyncio.create_task(post(http, worker.url + "/v1/completions", {"prompt": p, "max_tokens": 100}))
            for p in prompts
        ]
        waiting_seen, running_seen = 0.0, 0.0
        while not all(t.done() for t in tasks):
            values = plain_values(worker.metrics_text())
            waiting_seen = max(waiting_seen, values["vllm:num_requests_waiting"])
            running_seen = max(running_seen, values["vllm:num_requests_running"])
            assert values["vllm:kv_cache_usage_perc"] <= 1.0
            await asyncio.sleep(0.03)
        results = [t.result() for t in tasks]
        final = worker.metrics_text()
    assert waiting_seen >= 1 and running_seen == 2
    for prompt, (status, body) in zip(prompts, results, strict=True):
        assert status == 200 and body["choices"][0]["text"] == generate_text(tokenize(prompt), 100)
    assert sample(final, "vllm:num_requests_waiting_by_reason", reason="capacity") == 0
    assert sample(final, "vllm:request_queue_time_seconds_count") == 5
    assert sample(final, "vllm:request_queue_time_seconds_sum") > 0.05


async def test_decode_is_batched_in_one_step_loop(http: aiohttp.ClientSession) -> None:
    async with SimWorker(fast_config(time_scale=0.1)) as worker:
        assert worker.engine is not None
        body = {"max_tokens": 20}
        await asyncio.gather(
            *(post(http, worker.url + "/v1/completions", {**body, "prompt": f"prompt {i}"}) for i in range(32))
        )
        # 32 requests x 20 tokens in a handful more than 20 steps, not 640: they shared steps.
        assert worker.engine.steps < 40
        assert sample(worker.metrics_text(), "vllm:generation_tokens_total") == 640


async def test_prefix_cache_hits_cut_time_to_first_token(http: aiohttp.ClientSession) -> None:
    shared = " ".join(f"w{i}" for i in range(1500))
    async with SimWorker(fast_config(time_scale=1.0)) as worker:

        async def ttft(prompt: str) -> tuple[float, dict[str, int]]:
            body = {"prompt": prompt, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}
            started = time.monotonic()
            async with http.post(worker.url + "/v1/completions", json=body) as reply:
                first = None
                usage: dict[str, int] = {}
                async for line in reply.content:
                    if line.startswith(b"data: {") and first is None:
                        first = time.monotonic() - started
                    if b'"usage":{' in line:
                        usage = json.loads(line[6:])["usage"]["prompt_tokens_details"]
            assert first is not None
            return first, usage

        cold, cold_usage = await ttft(shared + " first question")
        warm, warm_usage = await ttft(shared + " second question")
        text = worker.metrics_text()
    assert cold_usage["cached_tokens"] == 0
    assert warm_usage["cached_tokens"] == 11 * 128
    assert warm < cold / 2, (cold, warm)
    assert sample(text, "vllm:prefix_cache_hits_total") == 11 * 128
    assert sample(text, "vllm:prefix_cache_queries_total") == 2 * 1502
    assert sample(text, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 11 * 128


async def test_kv_pressure_preempts_and_recomputes_without_changing_output(http: aiohttp.ClientSession) -> None:
    # Four 16-token blocks; each request grows from 10 to 50 tokens (4 blocks), so two running
    # requests cannot both grow: the newer is preempted and finishes after recomputation.
    limits = dataclasses.replace(fast_config().limits, block_size=16, num_kv_blocks=4, max_model_len=64)
    async with SimWorker(fast_config(limits=limits)) as worker:
        prompts = ["one two three four five six seven eight nine ten", "a b c d e f g h i j"]
        replies = await asyncio.gather(
            *(post(http, worker.url + "/v1/completions", {"prompt": p, "max_tokens": 40}) for p in prompts)
        )
        assert worker.metric("vllm:num_preemptions_total") >= 1
    for prompt, (status, body) in zip(prompts, replies, strict=True):
        assert status == 200 and body["choices"][0]["text"] == generate_text(tokenize(prompt), 40)
