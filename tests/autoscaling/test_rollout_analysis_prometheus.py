"""The rollout analysis against a real Prometheus scraping router-shaped per-generation metrics.

The exporter serves counts the test sets; each test waits until Prometheus holds exactly those samples
before it judges, so the verdicts follow from the counts, not from timing. The queries count what a
generation did in the window from 0 for series born inside it (autoscaling/rollout_analysis.py): every
series here is, so `increase()` would see none of these requests.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest

from splitserve.api.spec import RolloutAnalysis
from splitserve.api.status import RolloutStatus
from splitserve.controller.loops.analysis import ScalarSource, analyse_once, judge
from splitserve.controller.reconcile import IDEP
from splitserve.io.prometheus import PrometheusClient
from splitserve.local.ports import free_port
from testkit.cache import fill_cache
from testkit.prometheus import PrometheusServer, ScrapeTarget, StaticExporter, requires_prometheus
from testkit.reconciler import ReconcilerOnEmulator, reconciler_on_emulator

pytestmark = [requires_prometheus, pytest.mark.prometheus, pytest.mark.slow]

NS, NAME = "ml", "llama"
NEW, OLD = "3f2a9c01d4", "9b1e7f00aa"
SETTINGS = RolloutAnalysis(window_seconds=120, min_requests=20)
BUCKETS = ("0.1", "0.25", "0.5", "1.0", "2.5", "+Inf")


@dataclass
class Generation:
    """One generation's router counters: finished requests by outcome, first-byte times by bucket."""

    outcomes: dict[str, int]
    # Requests whose first byte came within each bucket's bound (not cumulative); the rest land in +Inf.
    ttft: dict[str, int] = field(default_factory=dict)


def router_text(generations: Mapping[str, Generation]) -> str:
    """What the router's /metrics says about its generations (prometheus_client's exposition)."""
    lines = [
        "# TYPE splitserve_router_generation_requests_total counter",
        "# TYPE splitserve_router_generation_ttft_seconds histogram",
    ]
    for generation, counts in generations.items():
        for outcome, count in counts.outcomes.items():
            lines.append(
                f'splitserve_router_generation_requests_total{{generation="{generation}",outcome="{outcome}"}} {count}'
            )
        cumulative = 0
        for bound in BUCKETS:
            cumulative += counts.ttft.get(bound, 0)
            lines.append(
                f'splitserve_router_generation_ttft_seconds_bucket{{generation="{generation}",le="{bound}"}} '
                f"{cumulative}"
            )
        lines.append(f'splitserve_router_generation_ttft_seconds_count{{generation="{generation}"}} {cumulative}')
    return "\n".join(lines) + "\n"


def rollout(replacing: list[str]) -> RolloutStatus:
    return RolloutStatus(generation=NEW, replacing=replacing, summary=f"{NEW} 1/2")


async def scraped(
    prometheus: PrometheusServer, exporters: list[StaticExporter], routers: Mapping[str, Mapping[str, Generation]]
) -> None:
    """Routers (deployment name -> generations) scraped by the real Prometheus, each count in place."""
    targets = []
    for deployment, generations in routers.items():
        exporter = StaticExporter(router_text(generations))
        await exporter.start()
        exporters.append(exporter)
        targets.append(ScrapeTarget(exporter.address, {"namespace": NS, "deployment": deployment}))
    prometheus.targets = targets
    await prometheus.start()
    await prometheus.wait_for("count(up == 1)", lambda v: v == len(targets))
    for deployment, generations in routers.items():
        total = float(sum(sum(g.outcomes.values()) for g in generations.values()))
        await prometheus.wait_for(
            f'sum(splitserve_router_generation_requests_total{{deployment="{deployment}"}})', total.__eq__
        )


FAILING_NEW = Generation({"success": 70, "upstream_error": 20, "stream_error": 10}, {"0.1": 50, "0.25": 50})
HEALTHY_OLD = Generation({"success": 300}, {"0.1": 150, "0.25": 150})


async def test_a_failing_generation_fails_with_its_numbers(
    prometheus: PrometheusServer, exporters: list[StaticExporter]
) -> None:
    await scraped(prometheus, exporters, {NAME: {NEW: FAILING_NEW, OLD: HEALTHY_OLD}})
    async with PrometheusClient(prometheus.url) as client:
        verdict, old = await judge(client, NS, NAME, rollout([OLD]), SETTINGS)
    # p90 of 100 first bytes, 50 within 0.1 s and 50 within 0.25 s: 0.1 + 0.15 x 40/50 = 0.22 s (same for the old).
    assert verdict.state == "failed", verdict.text
    assert verdict.text == (
        "Failed (error rate): error rate 30.0% vs 0.0% (limit +2.0%); TTFT p90 0.22s vs 0.22s (limit x1.5); "
        "100 vs 300 requests in 120s"
    )
    # No failed series at all for the old generation: no failures, not missing data.
    assert old is not None and old.requests == 300 and old.failed is None and old.error_rate == 0


async def test_a_healthy_generation_passes_and_another_deployment_does_not_leak_in(
    prometheus: PrometheusServer, exporters: list[StaticExporter]
) -> None:
    healthy_new = Generation({"success": 94, "upstream_error": 1, "client_error": 5}, {"0.1": 30, "0.25": 70})
    # The old pools were made by an operator without generations: the router counts them under "".
    legacy = Generation({"success": 297, "stream_error": 3, "cancelled": 100}, {"0.1": 200, "0.25": 200})
    await scraped(
        prometheus,
        exporters,
        # Another deployment in the same Prometheus whose rollout of the same generation id is failing badly.
        {NAME: {NEW: healthy_new, "": legacy}, "other": {NEW: Generation({"no_capacity": 500}), "": HEALTHY_OLD}},
    )
    async with PrometheusClient(prometheus.url) as client:
        verdict, _ = await judge(client, NS, NAME, rollout(["legacy"]), SETTINGS)
    # Client errors and cancellations count as requests, not as failures: 1 of 100, and 3 of 400.
    assert verdict.state == "passed", verdict.text
    assert verdict.text == (
        "Passed: error rate 1.0% vs 0.8% (limit +2.0%); TTFT p90 0.23s vs 0.22s (limit x1.5); "
        "100 vs 400 requests in 120s"
    )


async def test_a_generation_without_requests_yet_is_pending(
    prometheus: PrometheusServer, exporters: list[StaticExporter]
) -> None:
    await scraped(prometheus, exporters, {NAME: {NEW: Generation({"success": 7}, {"0.1": 7}), OLD: HEALTHY_OLD}})
    async with PrometheusClient(prometheus.url) as client:
        verdict, _ = await judge(client, NS, NAME, rollout([OLD]), SETTINGS)
        assert verdict.text == "Pending: 7 of 20 requests in 120s"
        unscraped, _ = await judge(client, NS, "unscraped", rollout([OLD]), SETTINGS)
    assert unscraped.text == (
        "Unknown: no router metrics for ml/unscraped in Prometheus (is spec.monitoring on and the router scraped?)"
    )


async def test_prometheus_unreachable_is_unknown() -> None:
    async with PrometheusClient(f"http://127.0.0.1:{free_port()}", timeout=2.0) as client:
        verdict, old = await judge(client, NS, NAME, rollout([OLD]), SETTINGS)
    assert verdict.state == "unknown" and verdict.text.startswith("Unknown: cannot reach Prometheus at")
    assert old is None


# --------------------------------------------------------------------------- one pass of the loop


@pytest.fixture
async def operator_world() -> AsyncIterator[ReconcilerOnEmulator]:
    """The real Reconciler on the API emulator, holding one InferenceDeployment in mid-rollout."""
    async with reconciler_on_emulator(NS) as world:
        yield world


async def test_one_pass_pauses_the_rollout_on_what_prometheus_holds(
    prometheus: PrometheusServer,
    exporters: list[StaticExporter],
    operator_world: ReconcilerOnEmulator,
) -> None:
    api, reconciler, events = operator_world.api, operator_world.reconciler, operator_world.events
    await scraped(prometheus, exporters, {NAME: {NEW: FAILING_NEW, OLD: HEALTHY_OLD}})
    spec: dict[str, Any] = {
        "model": {"name": "m", "source": {"uri": "s3://m"}},
        "rollout": {"analysis": {"windowSeconds": 120, "prometheusUrl": prometheus.url}},
    }
    plural = ("splitserve.io/v1alpha1", "inferencedeployments")
    body = {"apiVersion": IDEP[0], "kind": IDEP[1], "metadata": {"name": NAME, "namespace": NS}, "spec": spec}
    await api.create(*plural, body, namespace=NS)
    status = {
        "kvGeneration": NEW,
        "generations": [{"id": OLD, "state": "Serving"}, {"id": NEW, "state": "RollingOut"}],
        "rollout": rollout([OLD]).to_wire(),
    }
    await reconciler.kube.patch_status(*IDEP, NS, NAME, status)
    await fill_cache(reconciler.cache, api, NS)
    reconciles: list[tuple[str, str]] = []

    async with PrometheusClient(prometheus.url) as client:

        def client_for(url: str) -> ScalarSource:
            assert url == prometheus.url
            return client

        verdict = await analyse_once(
            reconciler, NS, NAME, client_for, reconcile=lambda namespace, name: reconciles.append((namespace, name))
        )
    assert verdict is not None and verdict.state == "failed"
    written = (await api.get(*plural, NAME, namespace=NS))["status"]
    assert written["rollout"]["paused"] is True and written["rollout"]["reason"] == "RolloutPaused"
    assert written["rollout"]["message"] == verdict.text
    assert "error rate 30.0% vs 0.0%" in verdict.text
    assert [g["analysis"] for g in written["generations"] if g["id"] == NEW] == [verdict.text]
    assert events == []  # the reconcile asked for posts RolloutPaused (controller/rollout.py)
    assert reconciles == [(NS, NAME)]
