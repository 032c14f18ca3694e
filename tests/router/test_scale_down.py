"""Scale-down under load loses nothing: a decode and a prefill worker are marked terminating in
their EndpointSlices (as Kubernetes does before the preStop pause), then drained (SIGTERM), in
the middle of a load of mixed streaming requests. The router stops sending to them at once, the
decode worker finishes its streams, and the prefill worker stays until decode workers have pulled
every KV block it holds. Every request must be answered in full: zero failures, zero KV fallbacks.
"""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import pytest

from splitserve.kubeconfig import KubeAccess
from splitserve.local.ports import free_port
from splitserve.router.app import Router
from splitserve.router.config import DiscoveryKind
from splitserve.router.discovery import KubernetesDiscovery
from splitserve.sim import SimConfig, SimWorker
from testkit.emulator.server import running_emulator
from testkit.rigs.slices import endpoint_slice
from testkit.router import router_config, running_router, sim_config
from tests.router.conftest import wait_until

pytestmark = pytest.mark.slow
NAMESPACE = "serving"
PROMPT = "shared system prompt " * 60  # well over the disaggregation threshold
SLICES = f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices"


async def one_request(client: httpx.AsyncClient, index: int) -> str:
    """'ok' for a full answer, else what went wrong."""
    try:
        return await _request(client, index)
    except httpx.HTTPError as error:
        return f"request {index} (stream={index % 2 == 0}): {type(error).__name__}: {error}"


async def _request(client: httpx.AsyncClient, index: int) -> str:
    body = {"model": "sim-model", "prompt": f"{PROMPT} user {index}", "max_tokens": 24, "stream": index % 2 == 0}
    if body["stream"]:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            text = (await response.aread()).decode()
            if response.status_code != 200 or '"error"' in text or not text.rstrip().endswith("data: [DONE]"):
                return f"stream {response.status_code}: {text[-200:]}"
            return "ok"
    response = await client.post("/v1/completions", json=body)
    if response.status_code != 200 or response.json()["usage"]["completion_tokens"] != 24:
        return f"{response.status_code}: {response.text[:200]}"
    return "ok"


def served_by_outcome_and_mode(router: Router) -> dict[tuple[str, str], float]:
    """splitserve_router_requests_total by (outcome, mode), non-zero samples only."""
    return {
        (sample.labels["outcome"], sample.labels["mode"]): sample.value
        for family in router.metrics.registry.collect()
        if family.name == "splitserve_router_requests"
        for sample in family.samples
        if sample.name == "splitserve_router_requests_total" and sample.value
    }


async def test_scale_down_under_load_fails_no_request() -> None:
    port = free_port()
    prefill_ips, decode_ips = ["127.0.0.11", "127.0.0.12"], ["127.0.0.21", "127.0.0.22"]

    def config(role: str, ip: str) -> SimConfig:
        # Slow enough that requests are in flight when the drain starts; decode runs few sequences
        # at a time, so prefilled KV waits on the prefill workers until a decode slot pulls it (as
        # in vLLM, which pulls when it schedules the request): the drain must wait for those pulls.
        base = sim_config(role, host=ip, port=port, time_scale=0.5)
        if role == "decode":
            return dataclasses.replace(base, limits=dataclasses.replace(base.limits, max_num_seqs=4))
        return base

    workers = [SimWorker(config("prefill", ip)) for ip in prefill_ips] + [
        SimWorker(config("decode", ip)) for ip in decode_ips
    ]
    async with running_emulator() as emulator:
        for worker in workers:
            await worker.start()
        api = httpx.AsyncClient(base_url=emulator.url)
        namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}
        (await api.post("/api/v1/namespaces", json=namespace)).raise_for_status()
        for service, ips in (("prefill", prefill_ips), ("decode", decode_ips)):
            (await api.post(SLICES, json=endpoint_slice(service, dict.fromkeys(ips, False), port))).raise_for_status()
        discovery = KubernetesDiscovery(
            KubeAccess(emulator.url, False, token="t"), NAMESPACE, {"prefill": "prefill", "decode": "decode"}, port
        )
        # The discovery kind matters beyond the discovery object: with the default (static) and no
        # prefill URLs the router believes it has no prefill pool and serves everything aggregated,
        # and this test would pass without ever pulling KV from a draining prefill worker.
        cfg = router_config(
            discovery=DiscoveryKind.KUBERNETES, prefill_service="prefill", decode_service="decode", queue_timeout=30.0
        )
        try:
            async with (
                running_router(cfg, discovery=discovery) as (router, url),
                httpx.AsyncClient(base_url=url, timeout=60) as client,
            ):
                await wait_until(lambda: len(router.prefill.workers) == 2 and len(router.decode.workers) == 2)
                load = [asyncio.create_task(one_request(client, i)) for i in range(200)]
                # The workers about to go must have work in flight for this test to mean anything.
                await wait_until(lambda: workers[2].in_flight > 0, within=30)
                # Kubernetes: endpoints turn terminating, then (after preStop) SIGTERM starts the drain.
                await api.put(
                    f"{SLICES}/prefill-slice",
                    json=endpoint_slice("prefill", {prefill_ips[0]: True, prefill_ips[1]: False}, port),
                )
                await api.put(
                    f"{SLICES}/decode-slice",
                    json=endpoint_slice("decode", {decode_ips[0]: True, decode_ips[1]: False}, port),
                )
                drained = await asyncio.gather(workers[0].drain(30), workers[2].drain(30))
                results = await asyncio.gather(*load)
                metrics = (await client.get("/metrics")).text
                served = served_by_outcome_and_mode(router)
                kv_pulled = sum(
                    worker.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
                    for worker in workers[2:]
                )
        finally:
            await api.aclose()
            for worker in workers:
                await worker.stop()
    failures = [result for result in results if result != "ok"]
    assert failures == [], failures[:5]
    assert list(drained) == [True, True], "both workers drained within their grace period"
    fallbacks = [
        line
        for line in metrics.splitlines()
        if line.startswith("splitserve_router_fallbacks_total{") and not line.endswith(" 0.0")
    ]
    assert fallbacks == [], f"no request lost its KV or fell back: {fallbacks}"
    assert served == {("success", "disaggregated"): 200.0}, f"every request went through prefill: {served}"
    assert kv_pulled > 0, "the decode workers pulled prefilled KV from the prefill workers"
