"""LoRA adapters through the router, on simulated engines that behave as vLLM does with adapters.

Two decode workers of which only one serves adapter ``b``: every request for ``b`` lands on that one;
adding ``b`` to the other at run time (vLLM's own load API) spreads them, and no request fails on the
way. The router learns what each worker serves from the worker's own /v1/models, nothing else.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from testkit.lora import BASE, PROMPT, lora_sim, make_adapter_dirs, post
from testkit.router import metric_value, router_config, running_router, served, wait_until


@pytest.fixture
def adapter_dirs(tmp_path: Path) -> dict[str, str]:
    return make_adapter_dirs(tmp_path)


async def test_an_adapter_goes_only_where_it_is_loaded_and_spreads_once_loaded_elsewhere(
    adapter_dirs: dict[str, str],
) -> None:
    async with (
        lora_sim("prefill", adapter_dirs, "a", "b") as prefill,
        lora_sim("decode", adapter_dirs, "a", "b") as with_b,
        lora_sim("decode", adapter_dirs, "a") as without_b,
    ):
        config = router_config(
            lora=True, models_poll_interval=0.05, prefill_urls=(prefill.url,), decode_urls=(with_b.url, without_b.url)
        )
        async with running_router(config) as (router, url), aiohttp.ClientSession() as http:
            await wait_until(lambda: router.decode.serves("b") and router.decode.models_known)
            statuses: list[int] = []

            async def load(requests: int, model: str) -> None:
                queue = iter(range(requests))

                async def client() -> None:
                    for i in queue:
                        status, answer = await post(http, url, model, f"{PROMPT} {i}")
                        assert status == 200, answer
                        statuses.append(status)

                await asyncio.gather(*(client() for _ in range(16)))

            before = served(without_b)
            await load(1000, "b")
            assert served(without_b) == before, "a request for b reached the worker without b"
            assert len(statuses) == 1000

            # b is loaded on the other worker while requests for it keep coming: none fails, and once
            # the router has read that worker's /v1/models, requests spread onto it.
            running = asyncio.create_task(load(600, "b"))
            await asyncio.sleep(0.05)
            async with http.post(
                without_b.url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": adapter_dirs["b"]}
            ) as response:
                assert response.status == 200, await response.text()
            await running
            assert len(statuses) == 1600
            await wait_until(lambda: "b" in getattr(router.decode.find(without_b.url), "adapters", ()))
            before = served(without_b)
            await load(200, "b")
            assert served(without_b) > before, "b did not spread onto the worker that loaded it"
            assert (
                metric_value(router, "splitserve_router_model_requests_total", {"model": "b", "outcome": "success"})
                == 1800
            )


async def test_models_unknown_names_and_a_prefill_pool_without_the_adapter(adapter_dirs: dict[str, str]) -> None:
    async with (
        lora_sim("prefill", adapter_dirs, "a") as prefill,
        lora_sim("decode", adapter_dirs, "a", "b") as decode,
        lora_sim("aggregated", adapter_dirs, "a", "b") as reference,
    ):
        config = router_config(
            lora=True, models_poll_interval=0.05, prefill_urls=(prefill.url,), decode_urls=(decode.url,)
        )
        async with running_router(config) as (router, url), aiohttp.ClientSession() as http:
            await wait_until(lambda: router.decode.serves("b") and router.prefill.serves("a"))
            async with http.get(url + "/v1/models") as response:
                cards = (await response.json())["data"]
            assert {card["id"]: card["parent"] for card in cards} == {BASE: None, "a": BASE, "b": BASE}

            status, answer = await post(http, url, "nope")
            assert status == 404
            assert answer["error"]["code"] == "model_not_found" and "nope" in answer["error"]["message"]

            texts = {}
            for model in (BASE, "a", "b"):
                status, answer = await post(http, url, model)
                assert status == 200, answer
                _, alone = await post(http, reference.url, model)
                texts[model] = answer["choices"][0]["text"]
                assert texts[model] == alone["choices"][0]["text"], f"{model}: routed answer differs from aggregated"
            assert len(set(texts.values())) == 3, "an adapter answered as another model"
            # b is not on the prefill worker: served whole on decode, never prefilled under another adapter.
            assert metric_value(router, "splitserve_router_fallbacks_total", {"reason": "prefill_no_adapter"}) == 1
            mode = {"outcome": "success", "mode": "disaggregated"}
            assert metric_value(router, "splitserve_router_requests_total", mode) == 2


async def test_without_lora_the_router_refuses_adapter_names(adapter_dirs: dict[str, str]) -> None:
    async with (
        lora_sim("decode", adapter_dirs, "a") as decode,
        running_router(router_config(decode_urls=(decode.url,))) as (_, url),
        aiohttp.ClientSession() as http,
    ):
        status, answer = await post(http, url, "a")
        assert status == 404 and answer["error"]["code"] == "model_not_found"


async def test_affinity_prefers_the_worker_where_the_adapter_is_active(adapter_dirs: dict[str, str]) -> None:
    """As llm-d's LoRA-affinity scorer: of the workers serving b, the one whose engine reports b running
    (vllm:lora_requests_info) gets b's requests while it is not overloaded."""
    async with (
        lora_sim("decode", adapter_dirs, "a", "b") as first,
        lora_sim("decode", adapter_dirs, "a", "b") as second,
    ):
        # A long poll interval: the test sets what the engines would report, and no poll overwrites it.
        config = router_config(lora=True, models_poll_interval=3600.0, decode_urls=(first.url, second.url))
        async with running_router(config) as (router, url), aiohttp.ClientSession() as http:
            await wait_until(lambda: router.decode.models_known and router.decode.serves("b"))
            active = router.decode.find(second.url)
            assert active is not None
            active.active_adapters = frozenset({"b"})
            before = served(first), served(second)
            for i in range(20):
                status, _ = await post(http, url, "b", f"{PROMPT} {i}")
                assert status == 200
            assert (served(first) - before[0], served(second) - before[1]) == (0, 20)
            active.active_adapters = frozenset()
            before = served(first), served(second)
            for i in range(40):
                await post(http, url, "b", f"{PROMPT} again {i}")
            assert served(first) > before[0] and served(second) > before[1], "without affinity both serve b"
