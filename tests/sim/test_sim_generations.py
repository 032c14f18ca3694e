"""KV generations: a sim's output text depends on its generation, and a prefill sim refuses KV pulls
from a decode sim of another generation (as NIXL's handshake refuses an incompatible peer)."""

from __future__ import annotations

import argparse
from typing import Any

import aiohttp
from sim_helpers import PREFILL_PARAMS, fast_config, post

from splitserve.router.flow import is_kv_error
from splitserve.sim import KVLoadFailurePolicy, Role, SimWorker, generate_text, tokenize
from splitserve.sim import cli as sim_cli
from splitserve.sim.tokens import generation_seed, prompt_digest

PROMPT = "Explain disaggregated prefill and decode in one paragraph, with an example."
A, B = "aaaaaaaaaa", "bbbbbbbbbb"


async def split(http: aiohttp.ClientSession, prefill: SimWorker, decode: SimWorker) -> tuple[int, Any]:
    body: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS}
    status, reply = await post(http, prefill.url + "/v1/completions", body)
    assert status == 200, reply
    body = {"prompt": PROMPT, "max_tokens": 8, "kv_transfer_params": reply["kv_transfer_params"]}
    return await post(http, decode.url + "/v1/completions", body)


def refused(worker: SimWorker, reason: str = "generation") -> float:
    return worker.metric("splitserve_sim_kv_pulls_refused_total", reason=reason)


def test_the_generation_seeds_the_text_and_no_generation_changes_nothing() -> None:
    tokens = tokenize(PROMPT)
    assert generation_seed(prompt_digest(tokens), "") == prompt_digest(tokens)
    assert generate_text(tokens, 8, "") == generate_text(tokens, 8)
    assert generate_text(tokens, 8, A) != generate_text(tokens, 8, B) != generate_text(tokens, 8)


async def test_an_engine_answers_its_generations_text(http: aiohttp.ClientSession) -> None:
    async with SimWorker(fast_config(generation=A)) as worker:
        status, reply = await post(http, worker.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 8})
        assert status == 200
        assert reply["choices"][0]["text"] == generate_text(tokenize(PROMPT), 8, A)
        async with http.get(worker.url + "/version") as response:
            assert (await response.json())["generation"] == A


async def test_same_generation_pull_works(http: aiohttp.ClientSession) -> None:
    async with (
        SimWorker(fast_config(Role.PREFILL, generation=A)) as prefill,
        SimWorker(fast_config(Role.DECODE, generation=A)) as decode,
    ):
        status, reply = await split(http, prefill, decode)
        assert status == 200, reply
        assert reply["choices"][0]["text"] == generate_text(tokenize(PROMPT), 8, A)
        assert refused(prefill) == 0 and decode.metric("vllm:nixl_num_failed_transfers_total") == 0


async def test_a_pull_from_another_generation_is_refused_as_a_failed_kv_transfer(http: aiohttp.ClientSession) -> None:
    async with (
        SimWorker(fast_config(Role.PREFILL, generation=B)) as prefill,
        SimWorker(fast_config(Role.DECODE, generation=A)) as decode,
    ):
        status, reply = await split(http, prefill, decode)
        assert status == 500
        message = reply["error"]["message"]
        assert message.startswith("KV transfer failed") and "incompatible peer" in message
        assert is_kv_error(message.encode())  # what the router turns into an aggregated retry
        assert refused(prefill) == 1 and refused(prefill, "unknown_blocks") == 0
        assert decode.metric("vllm:nixl_num_failed_transfers_total") == 1
        assert prefill.engine is not None and prefill.engine.num_held == 1  # the KV stays held


async def test_recompute_after_a_refused_pull_answers_with_the_decode_generations_text(
    http: aiohttp.ClientSession,
) -> None:
    async with (
        SimWorker(fast_config(Role.PREFILL, generation=B)) as prefill,
        SimWorker(
            fast_config(Role.DECODE, generation=A, kv_load_failure_policy=KVLoadFailurePolicy.RECOMPUTE)
        ) as decode,
    ):
        status, reply = await split(http, prefill, decode)
        assert status == 200, reply
        assert reply["choices"][0]["text"] == generate_text(tokenize(PROMPT), 8, A)
        assert refused(prefill) == 1


def test_the_generation_flag() -> None:
    parser = argparse.ArgumentParser()
    sim_cli.configure(parser)
    assert sim_cli.config_from_args(parser.parse_args([])).generation == ""
    assert sim_cli.config_from_args(parser.parse_args(["--generation", A])).generation == A
