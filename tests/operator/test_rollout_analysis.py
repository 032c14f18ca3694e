"""The rollout analysis: the pure verdict and PromQL (a table each), and one pass of the loop with the
real Reconciler against the API emulator (the CRD's own status schema), Prometheus scripted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from splitserve.api.spec import InferenceDeploymentSpec, RolloutAnalysis
from splitserve.autoscaling.rollout_analysis import (
    WindowNumbers,
    analyse,
    analysis_interval_seconds,
    analysis_prometheus_url,
    generation_matcher,
    router_presence_query,
    window_queries,
)
from splitserve.controller.loops.analysis import ScalarSource, analyse_once, interval_seconds
from splitserve.controller.reconcile import IDEP, Reconciler
from splitserve.io.prometheus import PrometheusUnavailable
from testkit.cache import fill_cache
from testkit.emulator.client import AsyncEmulatorClient
from testkit.reconciler import reconciler_on_emulator

DEFAULTS = RolloutAnalysis()  # 300 s window, 20 requests, +2 percentage points, x1.5 TTFT p90


def numbers(requests: float | None, failed: float | None = 0, ttft: float | None = None) -> WindowNumbers:
    return WindowNumbers(requests=requests, failed=failed, ttft_p90=ttft)


HEALTHY_OLD = numbers(400, 2, 0.31)  # 0.5% errors

VERDICTS = [
    pytest.param(numbers(7, 0, 0.2), HEALTHY_OLD, DEFAULTS, "pending", "Pending: 7 of 20 requests in 300s", id="few"),
    pytest.param(numbers(None, None), HEALTHY_OLD, DEFAULTS, "pending", "Pending: 0 of 20 requests in 300s", id="none"),
    pytest.param(
        numbers(100, 12, 0.84),
        HEALTHY_OLD,
        DEFAULTS,
        "failed",
        "Failed (error rate, TTFT p90): error rate 12.0% vs 0.5% (limit +2.0%); "
        "TTFT p90 0.84s vs 0.31s (limit x1.5); 100 vs 400 requests in 300s",
        id="both-regress",
    ),
    pytest.param(
        numbers(100, 12, 0.31),
        HEALTHY_OLD,
        DEFAULTS,
        "failed",
        "Failed (error rate): error rate 12.0% vs 0.5% (limit +2.0%); "
        "TTFT p90 0.31s vs 0.31s (limit x1.5); 100 vs 400 requests in 300s",
        id="errors",
    ),
    pytest.param(
        numbers(100, 0, 0.5),
        HEALTHY_OLD,
        DEFAULTS,
        "failed",
        "Failed (TTFT p90): error rate 0.0% vs 0.5% (limit +2.0%); "
        "TTFT p90 0.50s vs 0.31s (limit x1.5); 100 vs 400 requests in 300s",
        id="latency",
    ),
    pytest.param(
        numbers(200, 5, 0.465),  # 2.5% = 0.5% + 2.0% exactly, 0.465 s = 0.31 s x 1.5 exactly: both at the limit
        HEALTHY_OLD,
        DEFAULTS,
        "passed",
        "Passed: error rate 2.5% vs 0.5% (limit +2.0%); TTFT p90 0.47s vs 0.31s (limit x1.5); "
        "200 vs 400 requests in 300s",
        id="at-the-limits",
    ),
    pytest.param(
        numbers(20, 0, 0.2),
        HEALTHY_OLD,
        DEFAULTS,
        "passed",
        "Passed: error rate 0.0% vs 0.5% (limit +2.0%); TTFT p90 0.20s vs 0.31s (limit x1.5); "
        "20 vs 400 requests in 300s",
        id="min-requests-reached",
    ),
    pytest.param(
        numbers(50, 0, 9.0),
        numbers(400, 0, None),
        DEFAULTS,
        "passed",
        "Passed: error rate 0.0% vs 0.0% (limit +2.0%); TTFT p90 9.00s vs n/a (not judged); 50 vs 400 requests in 300s",
        id="no-old-ttft-judges-errors-only",
    ),
    pytest.param(
        numbers(50, 10, None),
        numbers(400, 0, None),
        DEFAULTS,
        "failed",
        "Failed (error rate): error rate 20.0% vs 0.0% (limit +2.0%); TTFT p90 n/a vs n/a (not judged); "
        "50 vs 400 requests in 300s",
        id="no-ttft-at-all-still-judges-errors",
    ),
    pytest.param(
        numbers(50, 10, 0.2),
        numbers(None, None, None),
        DEFAULTS,
        "unknown",
        "Unknown: the old generation served no requests in 300s to compare with "
        "(new: error rate 20.0%, TTFT p90 0.20s over 50 requests)",
        id="no-old-requests-never-pauses",
    ),
    pytest.param(
        numbers(10, 1, 0.4),
        numbers(100, 0, 0.2),
        RolloutAnalysis(window_seconds=60, min_requests=5, max_error_rate_increase=0.2, max_ttft_p90_ratio=3),
        "passed",
        "Passed: error rate 10.0% vs 0.0% (limit +20.0%); TTFT p90 0.40s vs 0.20s (limit x3); "
        "10 vs 100 requests in 60s",
        id="custom-thresholds",
    ),
]


@pytest.mark.parametrize(("new", "old", "settings", "state", "text"), VERDICTS)
def test_verdict(new: WindowNumbers, old: WindowNumbers, settings: RolloutAnalysis, state: str, text: str) -> None:
    verdict = analyse(new, old, settings)
    assert (verdict.state, verdict.text) == (state, text)
    assert bool(verdict.regressions) == (state == "failed")


ROUTER = 'namespace="ml",deployment="llama"'
FAILED = 'outcome=~"upstream_error|stream_error|no_capacity"'


def delta(series: str, window: int = 300) -> str:
    return f"clamp_min({series} - ({series} offset {window}s or {series} * 0), 0)"


def test_queries_for_one_generation() -> None:
    queries = window_queries("ml", "llama", ["3f2a9c01d4"], 300)
    selector = f'{ROUTER},generation="3f2a9c01d4"'
    assert queries.requests == f"sum({delta(f'splitserve_router_generation_requests_total{{{selector}}}')})"
    assert queries.failed == f"sum({delta(f'splitserve_router_generation_requests_total{{{selector},{FAILED}}}')})"
    assert queries.ttft_p90 == (
        "histogram_quantile(0.9, sum by (le) "
        f"({delta(f'splitserve_router_generation_ttft_seconds_bucket{{{selector}}}')}))"
    )
    assert router_presence_query("ml", "llama") == f"count(splitserve_router_generation_requests_total{{{ROUTER}}})"


@pytest.mark.parametrize(
    ("generations", "matcher"),
    [
        (["3f2a9c01d4"], 'generation="3f2a9c01d4"'),
        (["9b1e7f00aa", "3f2a9c01d4"], 'generation=~"3f2a9c01d4|9b1e7f00aa"'),
        # Pods of an operator without generations carry no label; the router counts them under "".
        (["legacy"], 'generation=""'),
        (["legacy", "9b1e7f00aa"], 'generation=~"|9b1e7f00aa"'),
    ],
)
def test_generation_matcher(generations: list[str], matcher: str) -> None:
    assert generation_matcher(generations) == matcher


@pytest.mark.parametrize("bad", [[], ['x"}) or vector(1']])
def test_generation_matcher_refuses_what_is_no_generation(bad: list[str]) -> None:
    with pytest.raises(ValueError):
        generation_matcher(bad)


@pytest.mark.parametrize(("window", "interval"), [(30, 7.5), (60, 15.0), (120, 30.0), (300, 30.0), (86400, 30.0)])
def test_interval_is_a_quarter_window_at_most_30s(window: int, interval: float) -> None:
    assert analysis_interval_seconds(RolloutAnalysis(window_seconds=window)) == interval
    assert interval_seconds({"rollout": {"analysis": {"windowSeconds": window}}}) == interval


def test_prometheus_url_falls_back_to_autoscaling() -> None:
    base = {"model": {"name": "m", "source": {"uri": "s3://m"}}}
    plain = InferenceDeploymentSpec.model_validate({**base, "rollout": {"analysis": {}}})
    assert analysis_prometheus_url(plain) == "http://prometheus-operated.monitoring.svc:9090"
    own = InferenceDeploymentSpec.model_validate(
        {
            **base,
            "autoscaling": {"prometheusUrl": "http://autoscaling:9090"},
            "rollout": {"analysis": {"prometheusUrl": "http://analysis:9090"}},
        }
    )
    assert analysis_prometheus_url(own) == "http://analysis:9090"
    assert analysis_prometheus_url(own.model_copy(update={"rollout": plain.rollout})) == "http://autoscaling:9090"


# --------------------------------------------------------------------------- the loop on the emulator

NAMESPACE = "ml"
NAME = "llama"
PLURAL = ("splitserve.io/v1alpha1", "inferencedeployments")
NEW, OLD = "3f2a9c01d4", "9b1e7f00aa"


@dataclass
class ScriptedPrometheus:
    """Answers the analysis' queries from per-generation numbers; `down` raises as an outage does."""

    by_generation: dict[str, WindowNumbers]
    down: bool = False
    queries: list[str] = field(default_factory=list)
    on_query: Callable[[], Any] | None = None

    async def query_scalar(self, promql: str) -> float | None:
        self.queries.append(promql)
        if self.on_query is not None:
            await self.on_query()
        if self.down:
            raise PrometheusUnavailable("cannot reach Prometheus at http://prom:9090: ConnectError()")
        if promql.startswith("count("):
            return 1.0 if any(n.requests is not None for n in self.by_generation.values()) else None
        for generation, found in self.by_generation.items():
            if f'generation="{generation}"' in promql:
                if promql.startswith("histogram_quantile"):
                    return found.ttft_p90
                return found.failed if "outcome=~" in promql else found.requests
        return None


@dataclass
class World:
    api: AsyncEmulatorClient
    reconciler: Reconciler
    events: list[tuple[str, str, str]]
    reconciles: list[tuple[str, str]]
    urls: list[str] = field(default_factory=list)

    def source(self, prometheus: ScalarSource) -> Callable[[str], ScalarSource]:
        def client_for(url: str) -> ScalarSource:
            self.urls.append(url)
            return prometheus

        return client_for

    async def analyse(self, prometheus: ScalarSource) -> Any:
        return await analyse_once(
            self.reconciler,
            NAMESPACE,
            NAME,
            self.source(prometheus),
            reconcile=lambda namespace, name: self.reconciles.append((namespace, name)),
        )

    async def status(self) -> dict[str, Any]:
        found: dict[str, Any] = (await self.api.get(*PLURAL, NAME, namespace=NAMESPACE)).get("status") or {}
        return found

    async def set_status(self, status: dict[str, Any]) -> None:
        await self.reconciler.kube.patch_status(*IDEP, NAMESPACE, NAME, status)
        await fill_cache(self.reconciler.cache, self.api, NAMESPACE)


def rollout_status(generation: str = NEW, paused: bool = False) -> dict[str, Any]:
    return {
        "kvGeneration": generation,
        "generations": [
            {"id": OLD, "state": "Serving", "trafficShare": 0.5},
            {"id": generation, "state": "RollingOut", "changed": ["model.source: r1 -> r2"], "trafficShare": 0.5},
        ],
        "rollout": {"generation": generation, "replacing": [OLD], "paused": paused, "summary": f"{generation} 1/2"},
    }


@pytest.fixture
async def world() -> AsyncIterator[World]:
    async with reconciler_on_emulator(NAMESPACE) as cluster:
        spec = {
            "model": {"name": "m", "source": {"uri": "s3://m"}},
            "autoscaling": {"prometheusUrl": "http://prom:9090"},
            "rollout": {"analysis": {"windowSeconds": 120, "minRequests": 20}},
        }
        obj = {"apiVersion": IDEP[0], "kind": IDEP[1], "metadata": {"name": NAME, "namespace": NAMESPACE}, "spec": spec}
        await cluster.api.create(*PLURAL, obj, namespace=NAMESPACE)
        world = World(cluster.api, cluster.reconciler, cluster.events, [])
        await world.set_status(rollout_status())
        yield world


def analysis_of(status: dict[str, Any], generation: str) -> str:
    return str(next(g for g in status["generations"] if g["id"] == generation).get("analysis", ""))


async def test_a_regression_pauses_the_rollout_with_the_numbers(world: World) -> None:
    prometheus = ScriptedPrometheus({NEW: numbers(100, 30, 0.12), OLD: numbers(300, 0, 0.11)})
    verdict = await world.analyse(prometheus)
    assert verdict is not None and verdict.state == "failed"
    text = (
        "Failed (error rate): error rate 30.0% vs 0.0% (limit +2.0%); TTFT p90 0.12s vs 0.11s (limit x1.5); "
        "100 vs 300 requests in 120s"
    )
    assert verdict.text == text
    status = await world.status()
    assert status["rollout"]["paused"] is True
    assert status["rollout"]["reason"] == "RolloutPaused"
    assert status["rollout"]["message"] == text
    assert analysis_of(status, NEW) == text
    assert analysis_of(status, OLD) == (
        f"Baseline for {NEW}: error rate 0.0%, TTFT p90 0.11s over 300 requests in 120s"
    )
    # The Event is the reconcile's to post (controller/rollout.py), once; here the reconcile is stubbed.
    assert world.events == []
    assert world.reconciles == [(NAMESPACE, NAME)]
    assert world.urls == ["http://prom:9090"]  # no analysis.prometheusUrl: autoscaling's

    # Paused: nothing more is judged (or posted) until the spec's generation changes.
    prometheus.queries.clear()
    assert await world.analyse(prometheus) is None
    assert prometheus.queries == [] and len(world.reconciles) == 1


async def test_a_healthy_generation_passes_and_keeps_rolling(world: World) -> None:
    prometheus = ScriptedPrometheus({NEW: numbers(100, 0, 0.12), OLD: numbers(300, 1, 0.11)})
    verdict = await world.analyse(prometheus)
    assert verdict is not None and verdict.state == "passed"
    status = await world.status()
    assert status["rollout"]["paused"] is False and not status["rollout"].get("reason")
    assert analysis_of(status, NEW).startswith("Passed: error rate 0.0% vs 0.3% (limit +2.0%)")
    assert world.events == [] and world.reconciles == []


async def test_pending_until_enough_requests(world: World) -> None:
    prometheus = ScriptedPrometheus({NEW: numbers(7, 7, 5.0), OLD: numbers(300, 0, 0.11)})
    verdict = await world.analyse(prometheus)
    assert verdict is not None and verdict.state == "pending"
    status = await world.status()
    assert analysis_of(status, NEW) == "Pending: 7 of 20 requests in 120s"
    assert status["rollout"]["paused"] is False and world.events == [] and world.reconciles == []


async def test_prometheus_down_is_unknown_and_never_pauses(world: World) -> None:
    prometheus = ScriptedPrometheus({}, down=True)
    verdict = await world.analyse(prometheus)
    assert verdict is not None and verdict.state == "unknown"
    status = await world.status()
    assert analysis_of(status, NEW) == "Unknown: cannot reach Prometheus at http://prom:9090: ConnectError()"
    assert analysis_of(status, OLD) == ""  # no numbers: the baseline is not overwritten with nothing
    assert status["rollout"]["paused"] is False and world.events == [] and world.reconciles == []


async def test_no_router_metrics_is_unknown(world: World) -> None:
    prometheus = ScriptedPrometheus({NEW: numbers(None, None), OLD: numbers(None, None)})
    verdict = await world.analyse(prometheus)
    assert verdict is not None
    assert verdict.text == (
        "Unknown: no router metrics for ml/llama in Prometheus (is spec.monitoring on and the router scraped?)"
    )
    assert (await world.status())["rollout"]["paused"] is False


async def test_a_rollout_that_moved_on_meanwhile_is_not_paused(world: World) -> None:
    # While Prometheus is asked, the spec changes again and the plan starts another rollout.
    async def spec_changed() -> None:
        seen = world.reconciler.cache.deployment(NAMESPACE, NAME) or {}
        if seen["status"]["rollout"]["generation"] == NEW:
            await world.set_status(rollout_status("77aa00bb11"))

    prometheus = ScriptedPrometheus({NEW: numbers(100, 30, 0.12), OLD: numbers(300, 0, 0.11)}, on_query=spec_changed)
    verdict = await world.analyse(prometheus)
    assert verdict is not None and verdict.state == "failed"
    status = await world.status()
    assert status["rollout"]["generation"] == "77aa00bb11" and status["rollout"]["paused"] is False
    assert not status["rollout"].get("message") and analysis_of(status, "77aa00bb11") == ""
    assert world.events == [] and world.reconciles == []


async def test_nothing_to_judge(world: World) -> None:
    prometheus = ScriptedPrometheus({NEW: numbers(100, 30, 0.12), OLD: numbers(300, 0, 0.11)})
    # No rollout in progress.
    await world.set_status({"rollout": None, "generations": [{"id": NEW, "state": "Serving"}]})
    assert await world.analyse(prometheus) is None
    # A rollout, but the status still describes an earlier spec's (the plan has not caught up).
    await world.set_status({**rollout_status(), "kvGeneration": "77aa00bb11"})
    assert await world.analyse(prometheus) is None
    # spec.rollout.analysis unset.
    await world.set_status(rollout_status())
    await world.api.patch(*PLURAL, NAME, {"spec": {"rollout": {"analysis": None}}}, namespace=NAMESPACE)
    await fill_cache(world.reconciler.cache, world.api, NAMESPACE)
    assert await world.analyse(prometheus) is None
    assert prometheus.queries == [] and world.events == []


async def test_analysis_prometheus_url_wins(world: World) -> None:
    await world.api.patch(
        *PLURAL,
        NAME,
        {"spec": {"rollout": {"analysis": {"prometheusUrl": "http://analysis:9090"}}}},
        namespace=NAMESPACE,
    )
    await fill_cache(world.reconciler.cache, world.api, NAMESPACE)
    await world.analyse(ScriptedPrometheus({NEW: numbers(1), OLD: numbers(1)}))
    assert world.urls == ["http://analysis:9090"]


async def test_default_reconcile_is_the_reconcilers(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[str, str]] = []

    async def reconcile_by_name(namespace: str, name: str, **_: Any) -> None:
        asked.append((namespace, name))

    monkeypatch.setattr(world.reconciler, "reconcile_by_name", reconcile_by_name)
    prometheus = ScriptedPrometheus({NEW: numbers(100, 30, 0.12), OLD: numbers(300, 0, 0.11)})
    await analyse_once(world.reconciler, NAMESPACE, NAME, world.source(prometheus))
    assert asked == [(NAMESPACE, NAME)]


# --------------------------------------------------------------------------- through the real plan


async def eventually(check: Callable[[], Awaitable[bool]], limit_s: float = 20.0) -> None:
    """Poll until `check` holds (the emulator's fake controllers mark replicas ready in the background)."""
    deadline = asyncio.get_running_loop().time() + limit_s
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.1)


async def test_a_regression_sends_the_traffic_back_through_the_plan() -> None:
    """The pass pauses; the reconcile it asks for (the real plan) scales the new generation to 0 and
    keeps the old one's pools, and says so in the Progressing condition."""
    async with reconciler_on_emulator(NAMESPACE) as cluster:
        api, reconciler, events = cluster.api, cluster.reconciler, cluster.events

        async def replicas() -> dict[str, tuple[int, int]]:
            listed = await api.list("apps/v1", "deployments", namespace=NAMESPACE)
            return {
                d["metadata"]["name"]: (d["spec"]["replicas"], (d.get("status") or {}).get("readyReplicas", 0))
                for d in listed
            }

        async def reconciled() -> dict[str, Any]:
            await fill_cache(reconciler.cache, api, NAMESPACE)
            await reconciler.reconcile_by_name(NAMESPACE, NAME)
            found: dict[str, Any] = (await api.get(*PLURAL, NAME, namespace=NAMESPACE)).get("status") or {}
            return found

        async def old_serving() -> bool:
            await reconciled()
            sizes = await replicas()
            workers = [ready for name, (_, ready) in sizes.items() if "-prefill-" in name or "-decode-" in name]
            return len(workers) == 2 and all(workers)

        source = {"huggingFace": {"repo": "org/m", "revision": "r1"}}
        spec = {
            "model": {"name": "m", "source": source},
            "prefill": {"replicas": 1},
            "decode": {"replicas": 1},
            "rollout": {"analysis": {"windowSeconds": 60}},
        }
        body = {"apiVersion": IDEP[0], "kind": IDEP[1], "metadata": {"name": NAME, "namespace": NAMESPACE}}
        await api.create(*PLURAL, {**body, "spec": spec}, namespace=NAMESPACE)
        await eventually(old_serving)
        old = (await reconciled())["kvGeneration"]
        revision = {"model": {"source": {"huggingFace": {"repo": "org/m", "revision": "r2"}}}}
        await api.patch(*PLURAL, NAME, {"spec": revision}, namespace=NAMESPACE)
        status = await reconciled()
        new = status["rollout"]["generation"]
        assert status["rollout"]["replacing"] == [old] and new != old

        await fill_cache(reconciler.cache, api, NAMESPACE)
        prometheus = ScriptedPrometheus({new: numbers(100, 30, 0.1), old: numbers(300, 0, 0.1)})
        verdict = await analyse_once(reconciler, NAMESPACE, NAME, lambda _url: prometheus)
        assert verdict is not None and verdict.state == "failed"

        status = (await api.get(*PLURAL, NAME, namespace=NAMESPACE))["status"]
        assert status["rollout"]["paused"] is True and status["rollout"]["message"] == verdict.text
        progressing = next(c for c in status["conditions"] if c["type"] == "Progressing")
        assert (progressing["status"], progressing["reason"]) == ("False", "RolloutPaused")
        assert verdict.text in progressing["message"]
        states = {g["id"]: (g["state"], g.get("analysis", "")) for g in status["generations"]}
        assert states[new] == ("Paused", verdict.text)
        assert states[old][0] == "Serving"
        sizes = await replicas()
        assert {name: size for name, (size, _) in sizes.items() if new in name} == {
            f"{NAME}-prefill-{new}": 0,
            f"{NAME}-decode-{new}": 0,
        }
        assert {name: size for name, (size, _) in sizes.items() if old in name} == {
            f"{NAME}-prefill-{old}": 1,
            f"{NAME}-decode-{old}": 1,
        }
        # One Event, from the reconcile, with the analysis' numbers.
        paused = [message for kind, reason, message in events if (kind, reason) == ("Warning", "RolloutPaused")]
        assert len(paused) == 1 and verdict.text in paused[0], events
