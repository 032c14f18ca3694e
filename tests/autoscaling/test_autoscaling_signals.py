"""PromQL per signal and pool, overrides, and the evaluate() glue with a stand-in client."""

from __future__ import annotations

from typing import Any

import pytest

from splitserve.api.spec import AutoscalingSpec, InferenceDeploymentSpec
from splitserve.api.status import AutoscalingDecision, AutoscalingStatus
from splitserve.autoscaling.decision import AutoscalerState
from splitserve.autoscaling.evaluation import status_for
from splitserve.autoscaling.queries import (
    DEFAULT_QUERIES,
    SIGNAL_NAMES,
    PoolSignals,
    check_query_overrides,
    queries_for_pool,
    query_for,
)
from splitserve.io.prometheus import PrometheusClient, PrometheusUnavailable
from splitserve.io.signals import evaluate


def test_default_queries_select_the_deployment_and_role() -> None:
    queries = queries_for_pool(AutoscalingSpec(), "prefill", "serving", "llama")
    assert set(queries) == set(SIGNAL_NAMES)
    assert queries["waiting"] == 'sum(vllm:num_requests_waiting{namespace="serving",deployment="llama",role="prefill"})'
    assert (
        queries["routerQueue"]
        == 'sum(splitserve_router_queue_depth{namespace="serving",deployment="llama",pool="prefill"})'
    )
    aggregated = queries_for_pool(AutoscalingSpec(), "aggregated", "serving", "llama")
    assert 'role="aggregated"' in aggregated["running"] and 'pool="decode"' in aggregated["routerQueue"]
    assert all("$" not in q for q in [*queries.values(), *aggregated.values()])


def test_prefill_fallbacks_are_read_for_the_prefill_pool_only() -> None:
    prefill = queries_for_pool(AutoscalingSpec(), "prefill", "serving", "llama")["prefillFallbacks"]
    selector = 'splitserve_router_fallbacks_total{namespace="serving",deployment="llama",reason="prefill_unavailable"}'
    # Now minus a minute ago, a series that did not exist then counting as 0 (rate() would miss it).
    assert prefill == f"sum(clamp_min({selector} - ({selector} offset 1m or {selector} * 0), 0))"
    for pool in ("decode", "aggregated"):
        assert "prefillFallbacks" not in queries_for_pool(AutoscalingSpec(), pool, "serving", "llama")
    custom = AutoscalingSpec(queries={"prefillFallbacks": 'sum(rate(my_fallbacks{deployment="$deployment"}[5m]))'})
    assert query_for(custom, "prefillFallbacks", "prefill", "ns", "x") == 'sum(rate(my_fallbacks{deployment="x"}[5m]))'
    assert check_query_overrides(custom) == []
    assert check_query_overrides(AutoscalingSpec(queries={"prefill.prefillFallbacks": "sum(x)"})) == []
    problems = check_query_overrides(AutoscalingSpec(queries={"decode.prefillFallbacks": "sum(x)"}))
    assert len(problems) == 1 and "prefill pool only" in problems[0], problems


def test_pool_specific_override_wins_over_plain_one() -> None:
    autoscaling = AutoscalingSpec(queries={"running": "sum(a{$workers})", "decode.running": 'sum(b{role="$role"})'})
    assert query_for(autoscaling, "running", "decode", "ns", "x") == 'sum(b{role="decode"})'
    assert (
        query_for(autoscaling, "running", "prefill", "ns", "x")
        == 'sum(a{namespace="ns",deployment="x",role="prefill"})'
    )
    assert query_for(autoscaling, "waiting", "prefill", "ns", "x").startswith("sum(vllm:num_requests_waiting{")


@pytest.mark.parametrize(
    ("queries", "problem"),
    [
        ({"runing": "sum(x)"}, "unknown signal 'runing'"),
        ({"router.waiting": "sum(x)"}, "unknown signal 'router.waiting'"),
        ({"waiting": "sum(x{$worker})"}, "bad placeholder"),
        ({"waiting": "sum(x) $"}, "bad placeholder"),
    ],
)
def test_bad_overrides_are_reported(queries: dict[str, str], problem: str) -> None:
    problems = check_query_overrides(AutoscalingSpec(queries=queries))
    assert len(problems) == 1 and problem in problems[0]


def test_good_overrides_have_no_problems() -> None:
    assert check_query_overrides(AutoscalingSpec(queries={"decode.itlP90": DEFAULT_QUERIES["itlP90"]})) == []


def test_signals_as_dict_skips_missing() -> None:
    assert PoolSignals(waiting=2, itl_p90=0.04).as_dict("decode.") == {"decode.waiting": 2.0, "decode.itlP90": 0.04}
    assert PoolSignals(prefill_fallbacks=3).as_dict("prefill.") == {"prefill.prefillFallbacks": 3.0}


class FakeClient(PrometheusClient):
    """Answers from a dict keyed by substrings of the PromQL; raises when told to."""

    def __init__(self, answers: dict[str, float | None], down: bool = False) -> None:
        super().__init__("http://prometheus.invalid")
        self.answers = answers
        self.down = down

    async def query_scalar(self, promql: str) -> float | None:
        if self.down:
            raise PrometheusUnavailable("cannot reach Prometheus at http://prometheus.invalid: ConnectError")
        for fragment, value in self.answers.items():
            if fragment in promql:
                return value
        return None


def spec(**autoscaling: Any) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.model_validate(
        {"model": {"name": "m", "source": {"uri": "/m"}}, "autoscaling": {"enabled": True, **autoscaling}}
    )


async def test_evaluate_reports_incomplete_metrics_per_pool() -> None:
    answers: dict[str, float | None] = {
        'num_requests_waiting{namespace="ns",deployment="d",role="decode"}': 0,
        'num_requests_running{namespace="ns",deployment="d",role="decode"}': 100,
        "timestamp(": 1.0,
    }
    async with FakeClient(answers) as client:
        result = await evaluate(spec(), "ns", "d", {"prefill": 1, "decode": 1}, AutoscalerState(), 0.0, client)
    assert result.desired == {"prefill": 1, "decode": 4}
    assert result.condition.status == "True" and result.condition.reason == "MetricsIncomplete"
    assert "holding prefill" in result.condition.message
    assert result.signals["decode.running"] == 100


async def test_evaluate_holds_when_prometheus_is_down() -> None:
    async with FakeClient({}, down=True) as client:
        result = await evaluate(spec(), "ns", "d", {"prefill": 2, "decode": 3}, AutoscalerState(), 0.0, client)
    assert result.desired == {"prefill": 2, "decode": 3}
    assert (result.condition.status, result.condition.reason) == ("False", "PrometheusUnavailable")
    assert "ConnectError" in result.condition.message


async def test_evaluate_holds_on_a_bad_query_override_instead_of_raising() -> None:
    # Validation rejects such a spec, but an object stored before that check (or written past it) must
    # not fail every evaluation: the sizes hold and the condition names the user's mistake.
    bad = spec(prometheusUrl="http://p", queries={"running": "sum(x{$wrkers})"})
    async with FakeClient({"num_requests_running": 5, "timestamp(": 1.0}) as client:
        result = await evaluate(bad, "ns", "d", {"prefill": 2, "decode": 3}, AutoscalerState(), 0.0, client)
    assert result.desired == {"prefill": 2, "decode": 3}
    assert (result.condition.status, result.condition.reason) == ("False", "InvalidQuery")
    assert "wrkers" in result.condition.message


async def test_status_keeps_the_last_ten_changes_newest_first() -> None:
    answers: dict[str, float | None] = {"num_requests_waiting": 0, "num_requests_running": 100, "timestamp(": 1.0}
    async with FakeClient(answers) as client:
        result = await evaluate(spec(), "ns", "d", {"prefill": 1, "decode": 1}, AutoscalerState(), 0.0, client)
    old = [
        AutoscalingDecision(pool="decode", from_replicas=1, to_replicas=2, reason="r", time=f"t{i}") for i in range(10)
    ]
    status = status_for(result, "2026-01-01T00:00:00Z", AutoscalingStatus(last_decisions=old))
    assert len(status.last_decisions) == 10
    assert status.last_decisions[0].to_replicas == 4 and status.last_decisions[0].time == "2026-01-01T00:00:00Z"
    assert status.signals["decode.running"] == 100
