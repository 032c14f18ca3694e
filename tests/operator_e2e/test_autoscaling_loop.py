"""The built-in autoscaler in the real operator: a real Prometheus scrapes router- and
vLLM-shaped exporters; the operator (against the API emulator) scales each pool on its own
signals, holds while Prometheus is down, and scales down only after the window."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from testkit.emulator.client import EmulatorClient
from testkit.emulator.fixtures import EmulatorProcess
from testkit.operator import NAMESPACE, OperatorProcess, eventually, worker_pool
from testkit.prometheus import PrometheusServer, ScrapeTarget, StaticExporter, requires_prometheus

pytestmark = [requires_prometheus, pytest.mark.prometheus, pytest.mark.emulator, pytest.mark.slow]
NAME = "auto"
IDEP = ("splitserve.io/v1alpha1", "inferencedeployments")


def vllm_text(waiting: float, running: float) -> str:
    return (
        f'vllm:num_requests_waiting{{model_name="m",engine="0"}} {waiting}\n'
        f'vllm:num_requests_running{{model_name="m",engine="0"}} {running}\n'
        'vllm:kv_cache_usage_perc{model_name="m",engine="0"} 0.2\n'
    )


def router_text(prefill_queue: float, decode_queue: float) -> str:
    return (
        f'splitserve_router_queue_depth{{pool="prefill"}} {prefill_queue}\n'
        f'splitserve_router_queue_depth{{pool="decode"}} {decode_queue}\n'
        'splitserve_router_inflight_requests{pool="prefill"} 0\n'
        'splitserve_router_inflight_requests{pool="decode"} 0\n'
    )


@pytest.fixture
async def exporters() -> AsyncIterator[dict[str, StaticExporter]]:
    started = {
        "prefill": StaticExporter(vllm_text(0, 0)),
        "decode": StaticExporter(vllm_text(0, 20)),
        "router": StaticExporter(router_text(0, 0)),
    }
    for exporter in started.values():
        await exporter.start()
    yield started
    for exporter in started.values():
        await exporter.stop()


def replicas(client: EmulatorClient, pool: str) -> int:
    deployment = worker_pool(client, NAME, pool) or {}
    return int(deployment.get("spec", {}).get("replicas", -1))


def condition(client: EmulatorClient, kind: str) -> dict[str, Any] | None:
    status = client.get(*IDEP, NAME, namespace=NAMESPACE).get("status") or {}
    return next((c for c in status.get("conditions", []) if c["type"] == kind), None)


async def test_pools_scale_independently_hold_when_blind_and_scale_down_after_the_window(
    cluster: tuple[EmulatorProcess, OperatorProcess],
    client: EmulatorClient,
    exporters: dict[str, StaticExporter],
    tmp_path: Path,
) -> None:
    def labels(role: str) -> dict[str, str]:
        return {"namespace": NAMESPACE, "deployment": NAME, "role": role}

    prometheus = PrometheusServer(
        tmp_path,
        [
            ScrapeTarget(exporters["prefill"].address, labels("prefill")),
            ScrapeTarget(exporters["decode"].address, labels("decode")),
            ScrapeTarget(exporters["router"].address, {"namespace": NAMESPACE, "deployment": NAME}),
        ],
    )
    await prometheus.start()
    try:
        client.create(
            {
                "apiVersion": "splitserve.io/v1alpha1",
                "kind": "InferenceDeployment",
                "metadata": {"name": NAME, "namespace": NAMESPACE},
                "spec": {
                    "model": {"name": "m", "source": {"uri": "s3://m"}},
                    "prefill": {"replicas": 1, "minReplicas": 1, "maxReplicas": 4},
                    "decode": {"replicas": 1, "minReplicas": 1, "maxReplicas": 6},
                    "autoscaling": {
                        "enabled": True,
                        "prometheusUrl": prometheus.url,
                        "intervalSeconds": 1,
                        "scaleDownStabilizationSeconds": 8,
                        "decode": {"runningPerReplica": 32},
                    },
                },
            }
        )
        await eventually(lambda: replicas(client, "decode") == 1 and replicas(client, "prefill") == 1, "pools created")

        # Output-heavy load: decode runs 100 sequences; prefill has no backlog. Only decode grows.
        exporters["decode"].body = vllm_text(0, 100)
        await eventually(lambda: replicas(client, "decode") == 4, "decode scaled to ceil(100/32)=4")
        assert replicas(client, "prefill") == 1
        active = await eventually(lambda: condition(client, "AutoscalingActive"), "AutoscalingActive")
        assert active["status"] == "True"
        status = client.get(*IDEP, NAME, namespace=NAMESPACE)["status"]["autoscaling"]
        assert status["lastDecisions"][0]["pool"] == "decode" and status["lastDecisions"][0]["toReplicas"] == 4
        assert "running" in status["lastDecisions"][0]["reason"]

        # Prompt-heavy load: the router's prefill queue grows; prefill scales, decode is left alone.
        exporters["router"].body = router_text(12, 0)
        await eventually(lambda: replicas(client, "prefill") > 1, "prefill scaled on its backlog")
        assert replicas(client, "decode") == 4

        # Prometheus gone: the condition says so and the sizes hold.
        prometheus.kill()
        blind = await eventually(
            lambda: (c := condition(client, "AutoscalingActive")) and c["status"] == "False" and c,
            "AutoscalingActive=False",
        )
        assert blind["reason"] == "PrometheusUnavailable"
        held = replicas(client, "decode")
        exporters["decode"].body = vllm_text(0, 5)
        exporters["router"].body = router_text(0, 0)
        await asyncio.sleep(3)
        assert replicas(client, "decode") == held == 4

        # Back, with low load: scale-down only after the 8 s window.
        await prometheus.start()
        await eventually(lambda: (c := condition(client, "AutoscalingActive")) and c["status"] == "True", "recovered")
        recovered_at = time.monotonic()
        await eventually(lambda: replicas(client, "decode") < 4, "decode scaled down", limit_s=90)
        assert time.monotonic() - recovered_at >= 5, "scale-down must wait for its stabilization window"
        await eventually(lambda: replicas(client, "decode") == 1, "decode back to 1", limit_s=90)
        events = client.list("v1", "events", namespace=NAMESPACE)
        assert any(e.get("reason") == "Scaled" and "autoscaler" in e.get("message", "") for e in events)
    finally:
        prometheus.stop()
