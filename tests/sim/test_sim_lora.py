"""LoRA adapters in the simulator, as vLLM 0.32 serves them: the runtime API and its texts, /v1/models,
404 for an adapter not loaded, text and block hashes per adapter, KV events that carry the adapter,
max_loras in the batch, and a decode that refuses KV computed under another adapter."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from sim_helpers import PREFILL_PARAMS, fast_config, post, sample

from splitserve.router.kv_events import decode_batch
from splitserve.router.kv_index import KvBlockIndex, request_keys
from splitserve.sim import Role, SimWorker, generate_text, tokenize
from splitserve.sim.cli import config_from_args, configure
from splitserve.sim.config import EngineLimits, LoRAConfig
from splitserve.sim.kv_events import BlockStored, KVEventBatch
from splitserve.sim.lora import LoRARequest
from splitserve.sim.scheduler import Scheduler, Sequence

PROMPT = "one two three four five six seven eight nine ten"  # 10 stand-in tokens
SMALL = EngineLimits(block_size=4, num_kv_blocks=32, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)


def adapter(root: Path, name: str, rank: int = 8) -> str:
    """A folder vLLM (and the simulator) takes for an adapter: the simulator reads adapter_config.json only."""
    folder = root / name
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 16}))
    return str(folder)


def lora_config(tmp_path: Path, **overrides: Any) -> Any:
    return fast_config(
        limits=SMALL, lora=LoRAConfig(max_loras=2, modules=(("a", adapter(tmp_path, "a")),)), **overrides
    )


async def complete(http: aiohttp.ClientSession, worker: SimWorker, model: str, **extra: Any) -> tuple[int, Any]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 6, **extra}
    return await post(http, worker.url + "/v1/completions", body)


async def text_status(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, str]:
    async with http.post(url, json=body) as reply:
        return reply.status, await reply.text()


async def test_runtime_api_models_and_404_as_vllm(http: aiohttp.ClientSession, tmp_path: Path) -> None:
    async with SimWorker(lora_config(tmp_path)) as worker:
        load, unload = worker.url + "/v1/load_lora_adapter", worker.url + "/v1/unload_lora_adapter"
        async with http.get(worker.url + "/v1/models") as reply:
            cards = (await reply.json())["data"]
        assert [(c["id"], c["parent"], c["root"]) for c in cards] == [
            ("sim-model", None, "sim-model"),
            ("a", "sim-model", str(tmp_path / "a")),
        ]
        status, body = await complete(http, worker, "b")
        assert (status, body) == (
            404,
            {
                "error": {
                    "message": "The model `b` does not exist. Valid aliases: sim-model.",
                    "type": "NotFoundError",
                    "param": "model",
                    "code": 404,
                }
            },
        )
        missing = str(tmp_path / "nothing-here")
        status, body = await post(http, load, {"lora_name": "b", "lora_path": missing})
        assert status == 404 and body["error"] == {
            "message": f"Loading lora b failed: No adapter found for {missing}",
            "type": "NotFoundError",
            "param": None,
            "code": 404,
        }
        status, body = await post(http, load, {"lora_name": "b", "lora_path": adapter(tmp_path, "big", rank=32)})
        assert status == 500 and body["error"]["message"] == "LoRA rank 32 is greater than max_lora_rank 16."
        status, body = await post(http, load, {"lora_name": "sim-model", "lora_path": str(tmp_path / "a")})
        assert status == 400 and body["error"]["type"] == "InvalidUserInput"

        assert await text_status(http, load, {"lora_name": "b", "lora_path": adapter(tmp_path, "b")}) == (
            200,
            "Success: LoRA adapter 'b' added successfully.",
        )
        status, body = await post(http, load, {"lora_name": "b", "lora_path": str(tmp_path / "b")})
        assert status == 400 and "has already been loaded" in body["error"]["message"]

        texts = {}
        for model in ("sim-model", "a", "b"):
            status, body = await complete(http, worker, model)
            assert status == 200 and body["model"] == model, body
            texts[model] = body["choices"][0]["text"]
        assert texts["a"] == generate_text(tokenize(PROMPT), 6, lora_name="a")
        assert texts["sim-model"] == generate_text(tokenize(PROMPT), 6)
        assert len(set(texts.values())) == 3, texts

        assert await text_status(http, unload, {"lora_name": "b"}) == (
            200,
            "Success: LoRA adapter 'b' removed successfully.",
        )
        assert (await complete(http, worker, "b"))[0] == 404
        status, body = await post(http, unload, {"lora_name": "b"})
        assert status == 404 and body["error"]["message"] == "The lora adapter 'b' cannot be found."

        info = sample(worker.metrics_text(), "vllm:lora_requests_info", running_lora_adapters="")
        assert info > 1e9  # vLLM's value: the time of the report
        assert 'max_lora="2"' in worker.metrics_text()


async def test_without_enable_lora_there_is_no_runtime_api(http: aiohttp.ClientSession) -> None:
    async with SimWorker(fast_config()) as worker:
        async with http.post(worker.url + "/v1/load_lora_adapter", json={"lora_name": "a"}) as reply:
            assert reply.status == 404
        assert "vllm:lora_requests_info" not in worker.metrics_text()


async def test_prefix_cache_hits_are_per_adapter(http: aiohttp.ClientSession, tmp_path: Path) -> None:
    async with SimWorker(lora_config(tmp_path)) as worker:
        load = {"lora_name": "b", "lora_path": adapter(tmp_path, "b")}
        assert (await text_status(http, worker.url + "/v1/load_lora_adapter", load))[0] == 200

        async def cached(model: str) -> int:
            status, body = await complete(http, worker, model)
            assert status == 200, body
            return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])

        assert await cached("a") == 0
        assert await cached("a") == 8  # two full blocks of 4
        assert await cached("sim-model") == 0
        assert await cached("b") == 0
        assert await cached("sim-model") == 8


def test_block_stored_carries_the_adapter_as_vllm_and_the_router_keys_it() -> None:
    scheduler = Scheduler(SMALL, enable_kv_cache_events=True, max_loras=2)
    tokens = tokenize(PROMPT)
    lora = LoRARequest(name="a", int_id=1, path="/adapters/a", rank=8)
    for request_id, which in (("base", None), ("lora", lora)):
        scheduler.add(Sequence(request_id, tokens, max_tokens=1, lora=which))
        while (plan := scheduler.schedule()).has_work:
            scheduler.complete(plan)
    base, adapted = [e for e in scheduler.pool.take_events() if isinstance(e, BlockStored)]
    assert (base.lora_id, base.lora_name, base.extra_keys) == (None, None, None)
    assert (adapted.lora_id, adapted.lora_name, adapted.extra_keys) == (1, "a", [("a",), ("a",)])
    assert adapted.token_ids == base.token_ids and not set(adapted.block_hashes) & set(base.block_hashes)

    # The bytes: vLLM 0.32's field order, extra_keys right after lora_name, one untagged name per block.
    payload = msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=[adapted], data_parallel_rank=0))
    event = msgspec.msgpack.decode(payload)[1][0]
    assert list(event)[:9] == [
        "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
        "extra_keys",
    ]  # fmt: skip
    assert event["extra_keys"] == [["a"], ["a"]]

    # What the router's precise-prefix index makes of both: a hit for the adapter it was computed for only.
    index = KvBlockIndex()
    index.apply("w", decode_batch(0, payload).events)
    assert index.matched_blocks("w", request_keys(tokens, 4, lora_name="a")) == 2
    assert index.matched_blocks("w", request_keys(tokens, 4, lora_name="b")) == 0
    assert index.matched_blocks("w", request_keys(tokens, 4)) == 0


def test_a_batch_holds_at_most_max_loras_adapters() -> None:
    scheduler = Scheduler(SMALL, max_loras=1)
    a, b = (LoRARequest(name, i, f"/adapters/{name}", 8) for i, name in enumerate("ab", start=1))
    first, other, second = (
        Sequence("a1", [1, 2], max_tokens=3, lora=a),
        Sequence("b1", [3, 4], max_tokens=3, lora=b),
        Sequence("a2", [5, 6], max_tokens=3, lora=a),
    )
    for seq in (first, other, second):
        scheduler.add(seq)
    scheduler.complete(scheduler.schedule())
    # b waits for a's slot; the a request behind it goes first, and b keeps its place in the queue.
    assert scheduler.running == [first, second] and list(scheduler.waiting) == [other]
    while first in scheduler.running or second in scheduler.running:
        scheduler.complete(scheduler.schedule())
    scheduler.complete(scheduler.schedule())
    assert scheduler.running == [other]


async def test_decode_refuses_kv_computed_under_another_adapter(http: aiohttp.ClientSession, tmp_path: Path) -> None:
    b_path = adapter(tmp_path, "b")
    both = LoRAConfig(max_loras=2, modules=(("a", adapter(tmp_path, "a")), ("b", b_path)))
    async with (
        SimWorker(fast_config(Role.PREFILL, lora=both)) as prefill,
        SimWorker(fast_config(Role.DECODE, lora=both)) as decode,
    ):

        async def prefilled(model: str) -> dict[str, Any]:
            status, body = await complete(http, prefill, model, max_tokens=1, kv_transfer_params=PREFILL_PARAMS)
            assert status == 200, body
            params: dict[str, Any] = body["kv_transfer_params"]
            return params

        status, body = await complete(http, decode, "b", kv_transfer_params=await prefilled("a"))
        assert status == 500
        message = body["error"]["message"]
        assert message.startswith("KV transfer failed") and "LoRA adapter 'a'" in message, message
        assert decode.metric("vllm:nixl_num_failed_transfers_total") == 1
        assert prefill.metric("splitserve_sim_kv_pulls_refused_total", reason="other_adapter") == 1
        status, body = await complete(http, decode, "sim-model", kv_transfer_params=await prefilled("b"))
        assert status == 500 and "for LoRA adapter 'b', the decode request is for the base model" in str(body)

        status, body = await complete(http, decode, "a", kv_transfer_params=await prefilled("a"))
        assert status == 200, body
        assert body["choices"][0]["text"] == generate_text(tokenize(PROMPT), 6, lora_name="a")


def test_cli_flags_are_vllms(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    configure(parser)
    path = str(tmp_path / "a")
    args = parser.parse_args(
        ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "8", "--lora-modules", f"a={path}",
         '{"name": "b", "path": "/b"}']
    )  # fmt: skip
    assert config_from_args(args).lora == LoRAConfig(max_loras=4, max_lora_rank=8, modules=(("a", path), ("b", "/b")))
    assert config_from_args(parser.parse_args([])).lora is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--lora-modules", "no-path"])
