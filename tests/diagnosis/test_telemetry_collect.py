"""telemetry.collect: the PromQL it sends and how it reads the answers (fake and real client)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

import httpx
import pytest

from splitserve.diagnosis.telemetry import (
    Telemetry,
    TelemetryScope,
    collect,
    coverage_note,
    default_scope,
    tail_of,
    window_seconds,
)
from splitserve.io.prometheus import PrometheusClient
from splitserve.io.telemetry import gather_telemetry, run_diagnosis
from tests.diagnosis.conftest import FakePrometheus, SpecFactory

SCOPE = TelemetryScope('model_name="m",namespace="ml"', 'namespace="ml"', "5m")


async def test_collect_scopes_every_query_and_reads_buckets(fake_prometheus: Callable[..., FakePrometheus]) -> None:
    prom = fake_prometheus(
        {"vllm:prefix_cache_hits_total": 30.0, "vllm:prefix_cache_queries_total": 100.0},
        {8.0: 2.0, 64.0: 5.0, math.inf: 6.0},
    )
    telemetry = await collect(prom, SCOPE)
    assert telemetry.prefix_hits_rate.value == 30.0
    assert (
        telemetry.prefix_hits_rate.query
        == 'sum(rate(vllm:prefix_cache_hits_total{model_name="m",namespace="ml",role=~"prefill|aggregated"}[5m]))'
    )
    assert telemetry.output_tokens_buckets == ((8.0, 2.0), (64.0, 5.0), (math.inf, 6.0))
    assert telemetry.itl_p90.value is None
    engine_queries = [q for q in prom.queries if "vllm:" in q]
    assert engine_queries and all('model_name="m"' in q for q in engine_queries)
    router_queries = [q for q in prom.queries if "splitserve_router_" in q]
    assert router_queries and all('namespace="ml"' in q for q in router_queries)
    assert any('reason="capacity"' in q for q in prom.queries)


async def test_router_metrics_fall_back_to_engine_counters(fake_prometheus: Callable[..., FakePrometheus]) -> None:
    prom = fake_prometheus({"vllm:request_success_total": 3.0, "vllm:prompt_tokens_total": 900.0})
    telemetry = await collect(prom, SCOPE)
    assert telemetry.request_rate.value == 3.0
    assert "vllm:request_success_total" in telemetry.request_rate.query
    assert telemetry.prompt_tokens_rate.value == 900.0


def test_default_scope_matches_the_monitor_relabelled_labels() -> None:
    assert default_scope("chat", "ml").engine_selector == 'namespace="ml",deployment="chat"'
    assert default_scope("chat", None).router_selector == 'deployment="chat"'


async def test_per_pool_queries_use_roles_and_fall_back_to_all_workers(
    fake_prometheus: Callable[..., FakePrometheus],
) -> None:
    prom = fake_prometheus({'vllm:num_requests_running{model_name="m",namespace="ml"}': 7.0})
    telemetry = await collect(prom, SCOPE)
    assert telemetry.running_per_replica.value == 7.0
    assert 'role=~"decode|aggregated"' not in telemetry.running_per_replica.query
    assert any(
        'vllm:num_requests_running{model_name="m",namespace="ml",role=~"decode|aggregated"}' in q for q in prom.queries
    )
    with_roles = await collect(fake_prometheus({"vllm:num_requests_running": 3.0}), SCOPE)
    assert 'role=~"decode|aggregated"' in with_roles.running_per_replica.query


async def test_empty_router_selector_still_gives_valid_promql(fake_prometheus: Callable[..., FakePrometheus]) -> None:
    prom = fake_prometheus()
    await collect(prom, TelemetryScope("", "", "1m"))
    assert not any("{," in q for q in prom.queries)
    assert any('{reason="capacity"}' in q for q in prom.queries)


async def test_unreachable_prometheus_means_no_telemetry_with_the_reason(
    fake_prometheus: Callable[..., FakePrometheus],
) -> None:
    telemetry, note = await gather_telemetry(fake_prometheus(down=True), SCOPE, "http://fake")
    assert telemetry is None
    assert "not reachable" in note


def _prometheus_api(values: dict[str, float]) -> Callable[[httpx.Request], httpx.Response]:
    """A Prometheus /api/v1/query stand-in answering instant vectors by metric name."""

    def handle(request: httpx.Request) -> httpx.Response:
        query = parse_qs(request.content.decode())["query"][0]
        result: list[dict[str, Any]] = []
        if query == "vector(1)":
            result = [{"metric": {}, "value": [0, "1"]}]
        elif "splitserve_router_output_tokens_bucket" in query:
            result = [
                {"metric": {"le": le}, "value": [0, value]}
                for le, value in (("8.0", "5"), ("512.0", "5"), ("1024.0", "10"), ("+Inf", "10"))
            ]
        else:
            for name, value in values.items():
                if name in query:
                    result = [{"metric": {}, "value": [0, str(value)]}]
                    break
        return httpx.Response(200, json={"status": "success", "data": {"resultType": "vector", "result": result}})

    return handle


async def test_run_diagnosis_through_the_real_prometheus_client(make_spec: SpecFactory) -> None:
    values = {
        "vllm:prefix_cache_hits_total": 700.0,
        "vllm:prefix_cache_queries_total": 1000.0,
        "vllm:inter_token_latency_seconds": 0.09,
        "vllm:num_requests_running": 3.0,
        "splitserve_router_output_tokens_sum": 5020.0,
        "splitserve_router_output_tokens_count": 10.0,
    }
    http = httpx.AsyncClient(transport=httpx.MockTransport(_prometheus_api(values)))
    spec = make_spec(
        {"model": {"parameterCount": 8_000_000_000}, "router": {"routingPolicy": {"prefill": "round-robin"}}}
    )
    async with PrometheusClient("http://prom:9090", http=http) as client:
        report = await run_diagnosis(spec, name="d", namespace="ml", prometheus_url="http://prom:9090", source=client)
    await http.aclose()
    by_key = {result.key: result for result in report.results}
    assert report.inp.telemetry is not None
    assert by_key["prompt-redundancy"].patch == {"router": {"routingPolicy": {"prefill": "prefix-aware"}}}
    assert by_key["per-token-latency"].patch is not None  # 90 ms ITL at batch 3: speculate
    assert "CV" in by_key["output-variance"].verdict
    assert report.summary().startswith("fits; ")


@pytest.mark.parametrize("url", ["http://127.0.0.1:9"])
async def test_run_diagnosis_with_unreachable_url_answers_from_the_spec(make_spec: SpecFactory, url: str) -> None:
    report = await run_diagnosis(make_spec({"model": {"parameterCount": 8_000_000_000}}), name="d", prometheus_url=url)
    assert report.inp.telemetry is None
    assert "not reachable" in report.inp.telemetry_note
    assert report.results[0].status == "ok"
    assert all(
        r.verdict.startswith("no telemetry")
        for r in report.results
        if r.key != "hardware-fit" and r.status == "unknown"
    )


@pytest.mark.parametrize(
    ("window", "seconds", "tail"),
    [("20s", 20, "5s"), ("5m", 300, "75s"), ("1h30m", 5400, "1350s"), ("2s", 2, "1s"), ("soon", None, "soon")],
)
def test_the_window_tail_is_its_last_quarter(window: str, seconds: float | None, tail: str) -> None:
    assert window_seconds(window) == seconds
    assert tail_of(window) == tail


async def test_queue_floors_read_the_window_tail(fake_prometheus: Callable[..., FakePrometheus]) -> None:
    prom = fake_prometheus({}, {})
    await collect(prom, TelemetryScope('namespace="ml"', 'namespace="ml"', "20s"))
    floors = [q for q in prom.queries if "min_over_time" in q]
    assert len(floors) == 4 and all(q.endswith("[5s]))") for q in floors), floors


async def test_prefix_share_is_read_where_prompts_are_computed(fake_prometheus: Callable[..., FakePrometheus]) -> None:
    """Decode looks up a prompt whose KV it pulls too: the share is the prefill pool's while it took prompts,
    and every engine's when it took none (all prompts short enough to skip it, or no role labels)."""
    prefill_lookups = 'vllm:prefix_cache_queries_total{model_name="m",namespace="ml",role=~"prefill|aggregated"}'
    prom = fake_prometheus({prefill_lookups: 0.0, "vllm:prefix_cache_queries_total": 100.0, "hits_total": 30.0})
    telemetry = await collect(prom, SCOPE)
    assert telemetry.prefix_queries_rate.value == 100.0
    assert "role=" not in telemetry.prefix_queries_rate.query and "role=" not in telemetry.prefix_hits_rate.query
    prom = fake_prometheus({prefill_lookups: 80.0, "vllm:prefix_cache_queries_total": 100.0, "hits_total": 30.0})
    telemetry = await collect(prom, SCOPE)
    assert telemetry.prefix_queries_rate.value == 80.0
    assert 'role=~"prefill|aggregated"' in telemetry.prefix_hits_rate.query


def test_missed_scrapes_are_said_before_the_rates_are_trusted() -> None:
    query = 'avg by (role) (avg_over_time(up{namespace="ml"}[5m]))'
    gappy = Telemetry(scrape_coverage=(("router", 0.35), ("decode", 0.95)), scrape_coverage_query=query)
    note = coverage_note(gappy)
    assert note is not None and note.startswith("scrapes missed: router answered 35% of its scrapes")
    assert "decode" not in note and query in note
    assert coverage_note(Telemetry(scrape_coverage=(("decode", 1.0),))) is None
