"""Prefill/decode handshake between simulators, following vLLM's NixlConnector protocol."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
from typing import Any

import aiohttp
from sim_helpers import PREFILL_PARAMS, fast_config, post, sample

from splitserve.sim import KVLoadFailurePolicy, Role, SimWorker, generate_text, tokenize
from splitserve.sim.engine import DoneEvent, EngineRequest, PullRequest, RemotePrefill, SimEngine, TokenEvent
from splitserve.sim.scheduler import Sequence

PROMPT = "Explain disaggregated prefill and decode in one paragraph, with an example."


async def prefill(http: aiohttp.ClientSession, worker: SimWorker, prompt: str = PROMPT) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_PARAMS}
    status, reply = await post(http, worker.url + "/v1/completions", body)
    assert status == 200, reply
    params: dict[str, Any] = reply["kv_transfer_params"]
    return params


async def decode(
    http: aiohttp.ClientSession, worker: SimWorker, params: dict[str, Any], prompt: str = PROMPT, max_tokens: int = 12
) -> tuple[int, Any]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "kv_transfer_params": params}
    status, reply = await post(http, worker.url + "/v1/completions", body)
    return status, reply


def external_tokens(worker: SimWorker) -> float:
    return sample(worker.metrics_text(), "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")


def failed_transfers(worker: SimWorker) -> float:
    return sample(worker.metrics_text(), "vllm:nixl_num_failed_transfers_total")


def kv_usage(worker: SimWorker) -> float:
    return sample(worker.metrics_text(), "vllm:kv_cache_usage_perc")


async def test_handshake_end_to_end(http: aiohttp.ClientSession) -> None:
    async with (
        SimWorker(fast_config(Role.PREFILL)) as p,
        SimWorker(fast_config(Role.DECODE)) as d,
        SimWorker(fast_config(Role.AGGREGATED)) as agg,
    ):
        params = await prefill(http, p)
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert params["remote_engine_id"] == p.engine_id
        assert params["remote_host"] == "127.0.0.1" and params["remote_port"] == p.port
        assert params["tp_size"] == 1 and isinstance(params["request_id"], str)
        assert len(params["remote_block_ids"]) == 1  # 12 tokens fit one 128-token CPU block
        assert kv_usage(p) > 0  # the blocks are held for the decode side

        status, decoded = await decode(http, d, params)
        assert status == 200, decoded
        _, aggregated = await post(http, agg.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 12})
        assert decoded["choices"][0]["text"] == aggregated["choices"][0]["text"]
        assert decoded["choices"][0]["text"] == generate_text(tokenize(PROMPT), 12)
        assert decoded["kv_transfer_params"] is None

        prompt_tokens = len(tokenize(PROMPT))
        assert external_tokens(d) == prompt_tokens
        assert d.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == prompt_tokens
        assert sample(d.metrics_text(), "vllm:prompt_tokens_by_source_total", source="local_compute") == 0
        assert sample(agg.metrics_text(), "vllm:prompt_tokens_by_source_total", source="local_compute") == prompt_tokens
        assert kv_usage(p) == 0  # pulled, so freed
        assert failed_transfers(d) == 0

        # The same handles cannot be pulled twice.
        status, error = await decode(http, d, params)
        assert status == 500 and "KV transfer failed" in error["error"]["message"]
        assert failed_transfers(d) == 1


async def test_streaming_decode_after_remote_prefill(http: aiohttp.ClientSession) -> None:
    async with SimWorker(fast_config(Role.PREFILL)) as p, SimWorker(fast_config(Role.DECODE)) as d:
        params = await prefill(http, p)
        body = {"prompt": PROMPT, "max_tokens": 5, "stream": True, "kv_transfer_params": params}
        async with http.post(d.url + "/v1/completions", json=body) as reply:
            assert reply.status == 200
            raw = (await reply.read()).decode()
    assert raw.endswith("data: [DONE]\n\n")
    assert raw.count("data: ") == 6
    assert external_tokens(d) == len(tokenize(PROMPT))


async def test_unknown_engine_or_blocks_fail_the_transfer(http: aiohttp.ClientSession) -> None:
    async with SimWorker(fast_config(Role.PREFILL)) as p, SimWorker(fast_config(Role.DECODE)) as d:
        params = await prefill(http, p)
        status, error = await decode(http, d, {**params, "remote_engine_id": "no-such-engine"})
        assert status == 500
        assert "KV transfer failed" in error["error"]["message"] and "unknown engine" in error["error"]["message"]
        status, error = await decode(http, d, {**params, "remote_block_ids": [400, 401]})
        assert status == 500 and "unknown or expired block ids" in error["error"]["message"]
        status, error = await decode(http, d, params, prompt="A different prompt altogether.")
        assert status == 500 and "different prompt" in error["error"]["message"]
        assert failed_transfers(d) == 3
        assert external_tokens(d) == 0
        # Failed pulls leave the held KV in place, so the right request still succeeds.
        status, _ = await decode(http, d, params)
        assert status == 200
        assert sample(d.metrics_text(), "vllm:num_requests_waiting") == 0
        assert kv_usage(d) == 0


async def test_expired_kv_cannot_be_pulled(http: aiohttp.ClientSession) -> None:
    async with (
        SimWorker(fast_config(Role.PREFILL, kv_hold_timeout_s=0.05)) as p,
        SimWorker(fast_config(Role.DECODE)) as d,
    ):
        params = await prefill(http, p)
        await asyncio.sleep(0.3)
        assert sample(p.metrics_text(), "vllm:nixl_num_kv_expired_reqs_total") == 1
        assert kv_usage(p) == 0
        status, error = await decode(http, d, params)
    assert status == 500 and "expired" in error["error"]["message"]
    assert failed_transfers(d) == 1


async def test_unreachable_prefill_engine(http: aiohttp.ClientSession) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    params = {**PREFILL_PARAMS, "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "x",
              "remote_block_ids": [1], "remote_host": "127.0.0.1", "remote_port": dead_port}  # fmt: skip
    async with SimWorker(fast_config(Role.DECODE)) as d:
        status, error = await decode(http, d, params)
        assert status == 500 and "cannot reach" in error["error"]["message"]
        assert failed_transfers(d) == 1


async def test_malformed_params_are_a_bad_request(http: aiohttp.ClientSession) -> None:
    async with SimWorker(fast_config(Role.DECODE)) as d:
        params = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1], "remote_port": 1}
        status, error = await decode(http, d, params)
    assert status == 400 and "remote_host" in error["error"]["message"]


async def test_aggregated_worker_ignores_kv_transfer_params(http: aiohttp.ClientSession) -> None:
    async with SimWorker(fast_config(Role.AGGREGATED)) as agg:
        body = {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS}
        status, reply = await post(http, agg.url + "/v1/completions", body)
        assert status == 200 and reply["kv_transfer_params"] is None
        assert kv_usage(agg) == 0


async def test_separate_side_channel_port(http: aiohttp.ClientSession) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        side_port = probe.getsockname()[1]
    async with (
        SimWorker(fast_config(Role.PREFILL, side_channel_port=side_port, engine_id="prefill-0")) as p,
        SimWorker(fast_config(Role.DECODE)) as d,
    ):
        params = await prefill(http, p)
        assert params["remote_port"] == side_port != p.port
        assert params["remote_engine_id"] == "prefill-0"
        status, _ = await decode(http, d, params)
        assert status == 200


async def test_held_kv_counts_against_prefill_capacity(http: aiohttp.ClientSession) -> None:
    # Two blocks in all: one held prefill leaves room for one more; the third request must wait
    # until the decode side pulls (frees) the first one.
    limits = dataclasses.replace(fast_config().limits, num_kv_blocks=2, max_model_len=256)
    config = fast_config(Role.PREFILL, limits=limits)
    async with SimWorker(config) as p, SimWorker(fast_config(Role.DECODE)) as d:
        first = await prefill(http, p, "first prompt")
        second = await prefill(http, p, "second prompt")
        third = asyncio.create_task(prefill(http, p, "third prompt"))
        await asyncio.sleep(0.2)
        assert not third.done()
        assert sample(p.metrics_text(), "vllm:num_requests_waiting") == 1
        status, _ = await decode(http, d, first, prompt="first prompt")
        assert status == 200
        await asyncio.wait_for(third, 2)
        for params, prompt in ((second, "second prompt"), (third.result(), "third prompt")):
            status, _ = await decode(http, d, params, prompt=prompt)
            assert status == 200


async def test_recompute_policy_prefills_locally_after_a_failed_pull(http: aiohttp.ClientSession) -> None:
    config = fast_config(Role.DECODE, kv_load_failure_policy=KVLoadFailurePolicy.RECOMPUTE)
    async with SimWorker(fast_config(Role.PREFILL)) as p, SimWorker(config) as d:
        params = await prefill(http, p)
        status, body = await decode(http, d, {**params, "remote_engine_id": "gone"})
        assert status == 200
        assert body["choices"][0]["text"] == generate_text(tokenize(PROMPT), 12)
        assert failed_transfers(d) == 1
        assert external_tokens(d) == 0
        assert d.metric("vllm:prompt_tokens_by_source_total", source="local_compute") == len(tokenize(PROMPT))


async def test_streaming_prefill_puts_params_in_the_final_chunk(http: aiohttp.ClientSession) -> None:
    body = {"prompt": PROMPT, "max_tokens": 1, "stream": True, "kv_transfer_params": PREFILL_PARAMS}
    async with SimWorker(fast_config(Role.PREFILL)) as p, SimWorker(fast_config(Role.DECODE)) as d:
        async with http.post(p.url + "/v1/completions", json=body) as reply:
            chunks = [json.loads(line[6:]) for line in (await reply.read()).splitlines() if line.startswith(b"data: {")]
        params = chunks[-1]["kv_transfer_params"]
        assert params["remote_engine_id"] == p.engine_id
        # Newer vLLM names the id remote_request_id; both spellings are accepted.
        params["remote_request_id"] = params.pop("request_id")
        status, _ = await decode(http, d, params)
        assert status == 200


def engine_request(
    name: str, max_tokens: int, *, remote_decode: bool = False, params: dict[str, Any] | None = None
) -> EngineRequest:
    """A request as the HTTP layer hands it to an engine; with ``params``, its KV is on a prefill engine."""
    remote = RemotePrefill.parse(params) if params is not None else None
    prompt = tokenize(f"{PROMPT} {name}")
    seq = Sequence(name, prompt, max_tokens, remote_prefill=remote is not None, remote_decode=remote_decode)
    return EngineRequest(seq=seq, remote_prefill=remote)


async def done(request: EngineRequest) -> DoneEvent:
    while not isinstance(event := await request.events.get(), DoneEvent):
        assert isinstance(event, TokenEvent), event
    return event


async def test_a_full_decode_batch_leaves_the_kv_held_on_prefill_until_a_slot_frees() -> None:
    # vLLM takes no request from its waiting queue while max_num_seqs run, not even to start its
    # KV load, so a saturated decode engine leaves the KV on the prefill engine.
    async def pull_from_prefill(remote: RemotePrefill, pull: PullRequest) -> None:
        await prefill_engine.serve_pull(pull)

    prefill_engine = SimEngine(fast_config(Role.PREFILL), "prefill", pull_from_prefill)
    prefill_engine.side_channel_port = 8000  # only advertised: decode pulls in-process here
    limits = dataclasses.replace(fast_config().limits, max_num_seqs=2)
    decode_engine = SimEngine(fast_config(Role.DECODE, limits=limits), "decode", pull_from_prefill)
    prefill_engine.start()
    decode_engine.start()
    try:
        busy = [engine_request(f"busy{i}", 1500) for i in range(2)]
        for request in busy:
            decode_engine.submit(request)
        for request in busy:
            assert isinstance(await request.events.get(), TokenEvent)  # in the batch, for a long while
        prefilled = [engine_request(f"remote{i}", 1, remote_decode=True) for i in range(4)]
        for request in prefilled:
            prefill_engine.submit(request)
        params = [(await done(request)).kv_transfer_params for request in prefilled]
        assert prefill_engine.num_held == 4
        waiting = [engine_request(f"remote{i}", 3, params=p) for i, p in enumerate(params)]
        for request in waiting:
            decode_engine.submit(request)
        # Tokens already queued came from earlier steps and the next one from the step under way;
        # the one after it comes from a step scheduled after the submits.
        while not busy[0].events.empty():
            busy[0].events.get_nowait()
        for _ in range(2):
            assert isinstance(await busy[0].events.get(), TokenEvent)
        assert decode_engine.scheduler.num_waiting_for_capacity == 4, "no pull starts while the batch is full"
        assert decode_engine.scheduler.num_deferred == 0
        assert prefill_engine.num_held == 4
        for request in busy:
            decode_engine.abort(request)
        for request in waiting:
            await done(request)
        assert prefill_engine.num_held == 0
    finally:
        await decode_engine.stop()
        await prefill_engine.stop()
