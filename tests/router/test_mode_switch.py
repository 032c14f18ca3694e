"""An aggregated -> disaggregated switch under continuous load fails no request.

This is the data-plane half of the operator's make-before-break mode switch: the new prefill and
decode pools become ready first (their endpoints join the prefill and decode Services; decode and
aggregated workers share the decode Service), then the aggregated pool's endpoints turn terminating
and its workers drain. Two routers serve the load throughout, as while the router Deployment rolls:
the old one (aggregated: no prefill Service) and the new one (with the prefill Service, which has no
ready endpoint at first, so it sends requests whole to decode until prefill workers appear).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import pytest

from splitserve.kubeconfig import KubeAccess
from splitserve.local.ports import free_port
from splitserve.router.config import DiscoveryKind
from splitserve.router.discovery import KubernetesDiscovery
from splitserve.sim import SimWorker
from testkit.emulator.server import running_emulator
from testkit.rigs.slices import endpoint_slice
from testkit.router import router_config, running_router, sim_config
from tests.router.conftest import wait_until
from tests.router.test_scale_down import SLICES, one_request

pytestmark = pytest.mark.slow
NAMESPACE = "serving"
# Discovery is passed in as an object; the config must still say "kubernetes", or a router with no
# static prefill URLs believes it has no prefill pool and never disaggregates.
KUBERNETES = DiscoveryKind.KUBERNETES


def counted(metrics: str, predicate: Callable[[str], bool]) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("splitserve_router_requests_total{") and predicate(line)
    )


async def test_switch_to_disaggregated_under_load_fails_no_request() -> None:
    port = free_port()
    aggregated_ips, prefill_ip, decode_ip = ["127.0.0.31", "127.0.0.32"], "127.0.0.11", "127.0.0.21"
    aggregated = [SimWorker(sim_config("aggregated", host=ip, port=port, time_scale=0.5)) for ip in aggregated_ips]
    prefill = SimWorker(sim_config("prefill", host=prefill_ip, port=port, time_scale=0.5))
    decode = SimWorker(sim_config("decode", host=decode_ip, port=port, time_scale=0.5))
    workers = [*aggregated, prefill, decode]
    async with running_emulator() as emulator:
        for worker in workers:
            await worker.start()
        api = httpx.AsyncClient(base_url=emulator.url)
        namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}
        (await api.post("/api/v1/namespaces", json=namespace)).raise_for_status()
        serving_aggregated = dict.fromkeys(aggregated_ips, False)
        (await api.post(SLICES, json=endpoint_slice("decode", serving_aggregated, port))).raise_for_status()
        access = KubeAccess(emulator.url, False, token="t")
        old_discovery = KubernetesDiscovery(access, NAMESPACE, {"decode": "decode"}, port)
        new_discovery = KubernetesDiscovery(access, NAMESPACE, {"prefill": "prefill", "decode": "decode"}, port)
        results: list[str] = []
        stop = asyncio.Event()
        producer: asyncio.Task[None] | None = None
        try:
            async with (
                running_router(
                    router_config(decode_service="decode", queue_timeout=30.0, discovery=KUBERNETES), old_discovery
                ) as (
                    old_router,
                    old_url,
                ),
                running_router(
                    router_config(
                        prefill_service="prefill", decode_service="decode", queue_timeout=30.0, discovery=KUBERNETES
                    ),
                    new_discovery,
                ) as (new_router, new_url),
                httpx.AsyncClient(base_url=old_url, timeout=60) as old_client,
                httpx.AsyncClient(base_url=new_url, timeout=60) as new_client,
            ):
                await wait_until(lambda: len(old_router.decode.workers) == 2 and len(new_router.decode.workers) == 2)

                async def load() -> None:
                    """A request every 50 ms, alternating between the routers, until told to stop."""
                    tasks: list[asyncio.Task[str]] = []
                    index = 0
                    while not stop.is_set():
                        client = old_client if index % 2 else new_client
                        tasks.append(asyncio.create_task(one_request(client, index)))
                        index += 1
                        await asyncio.sleep(0.05)
                    results.extend(await asyncio.gather(*tasks))

                producer = asyncio.create_task(load())
                await wait_until(lambda: aggregated[0].in_flight > 0, within=30)
                await asyncio.sleep(1.0)  # aggregated only: the new router finds no prefill worker yet
                # 1. The new pools are ready: their endpoints join the Services (old pool still serving).
                (await api.post(SLICES, json=endpoint_slice("prefill", {prefill_ip: False}, port))).raise_for_status()
                both = {**serving_aggregated, decode_ip: False}
                (await api.put(f"{SLICES}/decode-slice", json=endpoint_slice("decode", both, port))).raise_for_status()
                await wait_until(lambda: len(new_router.prefill.workers) == 1 and len(new_router.decode.workers) == 3)
                # The new router disaggregates again before the old pool goes.
                for _ in range(300):
                    metrics = (await new_client.get("/metrics")).text
                    if counted(metrics, lambda line: 'mode="disaggregated"' in line) > 0:
                        break
                    await asyncio.sleep(0.1)
                await asyncio.sleep(1.0)  # both pools serve
                # 2. The operator deletes the aggregated Deployment: its endpoints turn terminating, then it drains.
                # The old pool must have work in flight when it goes, for this test to mean anything.
                await wait_until(lambda: aggregated[0].in_flight + aggregated[1].in_flight >= 2, within=30)
                leaving = {**dict.fromkeys(aggregated_ips, True), decode_ip: False}
                (
                    await api.put(f"{SLICES}/decode-slice", json=endpoint_slice("decode", leaving, port))
                ).raise_for_status()
                drained = await asyncio.gather(*(worker.drain(30) for worker in aggregated))
                await asyncio.sleep(1.0)  # load keeps coming after the old pool is gone
                stop.set()
                await producer
                metrics = (await new_client.get("/metrics")).text
        finally:
            stop.set()
            if producer is not None and not producer.done():
                producer.cancel()
            await api.aclose()
            for worker in workers:
                await worker.stop()
    failures = [result for result in results if result != "ok"]
    assert len(results) > 50, "the load must span the switch"
    assert failures == [], failures[:5]
    assert drained == [True, True], "the aggregated workers drained within their grace period"
    outcomes = [
        line
        for line in metrics.splitlines()
        if line.startswith(("splitserve_router_requests_total{", "splitserve_router_fallbacks_total{"))
    ]
    assert counted(metrics, lambda line: 'mode="disaggregated"' in line) > 0, outcomes
