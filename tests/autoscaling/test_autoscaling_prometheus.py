"""The autoscaler against a real Prometheus scraping simulator workers and a router-shaped exporter."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import httpx
import pytest

from splitserve.api.spec import InferenceDeploymentSpec
from splitserve.autoscaling.decision import AutoscalerState
from splitserve.builders.autoscalers import autoscaler_objects
from splitserve.io.prometheus import PrometheusClient, PrometheusUnavailable
from splitserve.io.signals import evaluate, read_signals
from splitserve.local.ports import free_port
from splitserve.sim.config import SimConfig
from splitserve.sim.server import SimWorker
from testkit.prometheus import PrometheusServer, ScrapeTarget, StaticExporter, requires_prometheus

pytestmark = [requires_prometheus, pytest.mark.prometheus, pytest.mark.slow]

NS, NAME = "serving", "demo"


def labels(role: str) -> dict[str, str]:
    return {"namespace": NS, "deployment": NAME, "role": role}


def router_text(prefill_queue: float, decode_queue: float) -> str:
    return (
        "# TYPE splitserve_router_queue_depth gauge\n"
        f'splitserve_router_queue_depth{{pool="prefill"}} {prefill_queue}\n'
        f'splitserve_router_queue_depth{{pool="decode"}} {decode_queue}\n'
        "# TYPE splitserve_router_inflight_requests gauge\n"
        'splitserve_router_inflight_requests{pool="prefill"} 1\n'
        'splitserve_router_inflight_requests{pool="decode"} 7\n'
    )


def vllm_text(waiting: float, running: float, kv: float) -> str:
    return (
        f'vllm:num_requests_waiting{{model_name="m",engine="0"}} {waiting}\n'
        f'vllm:num_requests_running{{model_name="m",engine="0"}} {running}\n'
        f'vllm:kv_cache_usage_perc{{model_name="m",engine="0"}} {kv}\n'
    )


def make_spec(**autoscaling: object) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.model_validate(
        {
            "model": {"name": "m", "source": {"uri": "/m"}},
            "prefill": {"minReplicas": 1, "maxReplicas": 8, "replicas": 1},
            "decode": {"minReplicas": 1, "maxReplicas": 8, "replicas": 2},
            "autoscaling": {"enabled": True, **autoscaling},
            "monitoring": {"intervalSeconds": 1},
        }
    )


async def started(exporters: list[StaticExporter], body: str) -> StaticExporter:
    exporter = StaticExporter(body)
    await exporter.start()
    exporters.append(exporter)
    return exporter


async def test_client_scalars_vectors_and_errors(prometheus: PrometheusServer, exporters: list[StaticExporter]) -> None:
    worker = await started(exporters, vllm_text(3, 10, 0.25))
    prometheus.targets = [ScrapeTarget(worker.address, labels("decode"))]
    await prometheus.start()
    await prometheus.wait_for("vllm:num_requests_running")
    async with PrometheusClient(prometheus.url) as client:
        assert await client.query_scalar("sum(vllm:num_requests_running)") == 10
        assert await client.query_scalar("sum(no_such_metric)") is None
        assert await client.query_scalar("0/0") is None  # NaN
        assert await client.query_scalar("1/0") is None  # +Inf
        assert await client.query_scalar("scalar(vllm:kv_cache_usage_perc) * 4") == 1.0
        vector = await client.query_vector("vllm:num_requests_waiting")
        assert len(vector) == 1
        (key, value), *_ = vector.items()
        assert value == 3 and ("role", "decode") in key and ("deployment", NAME) in key
        with pytest.raises(PrometheusUnavailable, match="bad_data"):
            await client.query_scalar("sum(")
    async with PrometheusClient(f"http://127.0.0.1:{free_port()}") as nobody:
        with pytest.raises(PrometheusUnavailable, match="cannot reach"):
            await nobody.query_scalar("1")
        assert not await nobody.is_ready()


async def test_read_signals_from_sim_workers_and_router(
    prometheus: PrometheusServer, exporters: list[StaticExporter]
) -> None:
    # Decode workers: real simulators; one has 2 sequence slots so a burst leaves some waiting.
    slow = SimConfig.from_profile("cpu-tiny", role="aggregated", time_scale=5.0)
    narrow = dataclasses.replace(slow, limits=dataclasses.replace(slow.limits, max_num_seqs=2))
    prefill_config = SimConfig.from_profile("cpu-tiny", role="prefill")
    router = await started(exporters, router_text(prefill_queue=6, decode_queue=5))
    async with SimWorker(slow) as decode_a, SimWorker(narrow) as decode_b, SimWorker(prefill_config) as prefill:
        prometheus.targets = [
            ScrapeTarget(f"127.0.0.1:{decode_a.port}", labels("decode")),
            ScrapeTarget(f"127.0.0.1:{decode_b.port}", labels("decode")),
            ScrapeTarget(f"127.0.0.1:{prefill.port}", labels("prefill")),
            ScrapeTarget(router.address, {"namespace": NS, "deployment": NAME}),
            # Another deployment's worker in the same Prometheus must not leak into ours.
            ScrapeTarget(f"127.0.0.1:{prefill.port}", {"namespace": NS, "deployment": "other", "role": "decode"}),
        ]
        await prometheus.start()
        await prometheus.wait_for("count(up == 1)", lambda v: v == 5)
        spec = make_spec()
        async with PrometheusClient(prometheus.url) as client:
            idle = await read_signals(client, spec, NS, NAME)
            assert idle["decode"].running == 0 and idle["decode"].waiting == 0
            assert idle["decode"].kv_cache_usage == 0
            assert idle["decode"].router_queue == 5 and idle["decode"].router_inflight == 7
            assert idle["prefill"].router_queue == 6 and idle["prefill"].waiting == 0
            # Scraped every second; the slack is for a busy CI machine.
            assert idle["prefill"].sample_age_seconds is not None and idle["prefill"].sample_age_seconds < 15
            assert idle["decode"].ttft_p90 is None  # no requests yet: the rate is 0/0

            async with httpx.AsyncClient(timeout=60) as http:
                body = {"model": "sim-model", "prompt": "hello " * 50, "max_tokens": 400, "stream": False}
                burst = [asyncio.create_task(http.post(f"{decode_b.url}/v1/completions", json=body)) for _ in range(5)]
                await prometheus.wait_for(
                    f'sum(vllm:num_requests_waiting{{deployment="{NAME}",role="decode"}})', lambda v: v == 3
                )
                busy = await read_signals(client, spec, NS, NAME)
                for task in burst:
                    task.cancel()
                with contextlib.suppress(BaseException):
                    await asyncio.gather(*burst, return_exceptions=True)
            assert busy["decode"].running == 2 and busy["decode"].waiting == 3
            assert busy["decode"].kv_cache_usage is not None and busy["decode"].kv_cache_usage > 0


async def test_evaluate_holds_while_prometheus_is_down_and_recovers(
    prometheus: PrometheusServer, exporters: list[StaticExporter]
) -> None:
    worker_a = await started(exporters, vllm_text(waiting=0, running=60, kv=0.5))
    worker_b = await started(exporters, vllm_text(waiting=0, running=60, kv=0.5))
    prefill = await started(exporters, vllm_text(waiting=0, running=0, kv=0.0))
    router = await started(exporters, router_text(prefill_queue=0, decode_queue=0))
    prometheus.targets = [
        ScrapeTarget(worker_a.address, labels("decode")),
        ScrapeTarget(worker_b.address, labels("decode")),
        ScrapeTarget(prefill.address, labels("prefill")),
        ScrapeTarget(router.address, {"namespace": NS, "deployment": NAME}),
    ]
    await prometheus.start()
    await prometheus.wait_for("count(up == 1)", lambda v: v == 4)
    spec = make_spec()
    current = {"prefill": 1, "decode": 2}
    state = AutoscalerState()
    async with PrometheusClient(prometheus.url, timeout=2.0) as client:
        first = await evaluate(spec, NS, NAME, current, state, 100.0, client)
        assert first.condition.status == "True" and first.condition.reason == "MetricsAvailable"
        assert first.desired == {"prefill": 1, "decode": 4}  # 120 running / 32 per replica
        assert "running=120" in first.reasons["decode"]
        assert first.signals["decode.running"] == 120

        prometheus.kill()
        down = await evaluate(spec, NS, NAME, {"prefill": 1, "decode": 4}, first.state, 115.0, client)
        assert down.condition.status == "False" and down.condition.reason == "PrometheusUnavailable"
        assert "holding current sizes" in down.condition.message
        assert down.desired == {"prefill": 1, "decode": 4}
        assert all("no metrics → hold" in reason for reason in down.reasons.values())

        worker_a.body = vllm_text(waiting=0, running=150, kv=0.9)
        await prometheus.start()
        await prometheus.wait_for('sum(vllm:num_requests_running{role="decode"})', lambda v: v == 210)
        back = await evaluate(spec, NS, NAME, {"prefill": 1, "decode": 4}, down.state, 130.0, client)
        assert back.condition.status == "True"
        assert back.desired["decode"] == 7  # ceil(210 / 32)


async def test_query_overrides_reach_prometheus(prometheus: PrometheusServer, exporters: list[StaticExporter]) -> None:
    worker = await started(exporters, vllm_text(waiting=4, running=8, kv=0.1))
    prometheus.targets = [ScrapeTarget(worker.address, labels("decode"))]
    await prometheus.start()
    await prometheus.wait_for("vllm:num_requests_running")
    spec = make_spec(queries={"decode.running": "sum(vllm:num_requests_waiting{$workers}) * 100"})
    async with PrometheusClient(prometheus.url) as client:
        signals = await read_signals(client, spec, NS, NAME)
    assert signals["decode"].running == 400
    assert signals["prefill"].running is None  # no prefill workers scraped


async def test_keda_trigger_queries_run_on_prometheus(
    prometheus: PrometheusServer, exporters: list[StaticExporter]
) -> None:
    # Every trigger query must parse, and give a number even with no traffic (no NaN for KEDA).
    worker = await started(exporters, vllm_text(waiting=3, running=8, kv=0.1))
    router = await started(exporters, router_text(prefill_queue=2, decode_queue=5))
    prometheus.targets = [
        ScrapeTarget(worker.address, labels("decode")),
        ScrapeTarget(router.address, {"namespace": NS, "deployment": NAME}),
    ]
    await prometheus.start()
    await prometheus.wait_for("count(up == 1)", lambda v: v == 2)
    spec = make_spec(backend="keda")
    values: dict[str, dict[str, float | None]] = {}
    async with PrometheusClient(prometheus.url) as client:
        for obj in autoscaler_objects(spec, NS, NAME):
            pool = obj["metadata"]["labels"]["splitserve.io/role"]
            values[pool] = {
                t["name"]: await client.query_scalar(t["metadata"]["query"]) for t in obj["spec"]["triggers"]
            }
    assert values["decode"] == {"backlog": 8, "running": 8, "kv-cache-usage": 0.1, "itl-p90": 0}
    assert values["prefill"] == {"prompts": 2, "prefill-fallbacks": 0, "ttft-p90": 0}


async def test_first_prefill_fallback_of_a_router_is_seen(
    prometheus: PrometheusServer, exporters: list[StaticExporter]
) -> None:
    # A router that has never fallen back has no prefill_unavailable series; its first fallback
    # creates it at 1. rate()/increase() ignore that first sample; prefillFallbacks must not.
    router = await started(exporters, router_text(prefill_queue=0, decode_queue=0))
    prometheus.targets = [ScrapeTarget(router.address, {"namespace": NS, "deployment": NAME})]
    await prometheus.start()
    await prometheus.wait_for("count(up == 1)", lambda v: v == 1)
    spec = make_spec(backend="keda")
    async with PrometheusClient(prometheus.url) as client:
        assert (await read_signals(client, spec, NS, NAME))["prefill"].prefill_fallbacks is None
        counter = (
            "# TYPE splitserve_router_fallbacks_total counter\n"
            'splitserve_router_fallbacks_total{reason="prefill_unavailable"} %d\n'
            'splitserve_router_fallbacks_total{reason="decode_kv_error"} 7\n'
        )
        router.body = router_text(0, 0) + counter % 1
        await prometheus.wait_for("sum(splitserve_router_fallbacks_total)", lambda v: v == 8)
        first = await read_signals(client, spec, NS, NAME)
        assert first["prefill"].prefill_fallbacks == 1
        assert first["decode"].prefill_fallbacks is None  # not read for decode
        rate = 'sum(rate(splitserve_router_fallbacks_total{reason="prefill_unavailable"}[1m]))'
        assert not await client.query_scalar(rate), "rate() misses the first fallback (0, or no result yet)"
        router.body = router_text(0, 0) + counter % 3
        await prometheus.wait_for(
            'sum(splitserve_router_fallbacks_total{reason="prefill_unavailable"})', lambda v: v == 3
        )
        assert (await read_signals(client, spec, NS, NAME))["prefill"].prefill_fallbacks == 3
        triggers = {t["name"]: t for t in autoscaler_objects(spec, NS, NAME)[0]["spec"]["triggers"]}
        assert await client.query_scalar(triggers["prefill-fallbacks"]["metadata"]["query"]) == 1
