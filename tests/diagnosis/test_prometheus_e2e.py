"""The diagnosis against a real Prometheus scraping vLLM-shaped and router-shaped exporters.

Checks what the fakes cannot: that every PromQL the telemetry sends parses and selects on the
monitors' relabelled `namespace`/`deployment`/`role` labels, histogram buckets (`le`) are read
back, and the verdicts follow from scraped counters.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from aiohttp import web

from splitserve.io.telemetry import run_diagnosis
from testkit.prometheus import PrometheusServer, ScrapeTarget, StaticExporter, requires_prometheus
from tests.diagnosis.conftest import SpecFactory

pytestmark = [pytest.mark.prometheus, pytest.mark.slow, requires_prometheus]


class GrowingExporter(StaticExporter):
    """Serves text computed from the seconds since start, so counters grow at fixed rates."""

    def __init__(self, render: Callable[[float], str]) -> None:
        super().__init__()
        self.render = render
        self.started = time.monotonic()

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.render(time.monotonic() - self.started), content_type="text/plain")


def histogram(name: str, buckets: dict[str, float], total: float, t: float, labels: str = "") -> str:
    """A histogram whose cumulative bucket counts grow at `buckets[le]` per second."""
    sep = "," if labels else ""
    lines = [f"# TYPE {name} histogram"]
    lines += [f'{name}_bucket{{{labels}{sep}le="{le}"}} {rate * t}' for le, rate in buckets.items()]
    count = buckets["+Inf"] * t
    lines += [f"{name}_sum{{{labels}}} {total * t}", f"{name}_count{{{labels}}} {count}"]
    return "\n".join(lines)


def worker_metrics(t: float) -> str:
    labels = 'model_name="chat-model"'
    return "\n".join(
        [
            "# TYPE vllm:prefix_cache_hits counter",
            f"vllm:prefix_cache_hits_total{{{labels}}} {600 * t}",
            "# TYPE vllm:prefix_cache_queries counter",
            f"vllm:prefix_cache_queries_total{{{labels}}} {1000 * t}",
            "# TYPE vllm:num_preemptions counter",
            f"vllm:num_preemptions_total{{{labels}}} {0.5 * t}",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{labels}}} 0.97",
            "# TYPE vllm:num_requests_waiting_by_reason gauge",
            f'vllm:num_requests_waiting_by_reason{{{labels},reason="capacity"}} 2',
            f'vllm:num_requests_waiting_by_reason{{{labels},reason="deferred"}} 0',
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} 4",
            # 100 tokens/s, all between 50 and 100 ms apart: ITL p90 ~95 ms against a 50 ms SLO.
            histogram("vllm:inter_token_latency_seconds", {"0.05": 0, "0.1": 100, "+Inf": 100}, 8.0, t, labels),
            histogram("vllm:time_to_first_token_seconds", {"0.5": 0, "2.5": 10, "+Inf": 10}, 15.0, t, labels),
            histogram("vllm:request_prefill_time_seconds", {"0.25": 0, "0.5": 10, "+Inf": 10}, 4.0, t, labels),
            "",
        ]
    )


def router_metrics(t: float) -> str:
    # 10 requests/s of 2000-token prompts; half the answers are 4 tokens, half about 1000.
    return "\n".join(
        [
            histogram(
                "splitserve_router_output_tokens",
                {"1.0": 0, "8.0": 5, "512.0": 5, "1024.0": 10, "+Inf": 10},
                5020.0,
                t,
            ),
            histogram("splitserve_router_prompt_tokens", {"1024.0": 0, "2048.0": 10, "+Inf": 10}, 20_000.0, t),
            "",
        ]
    )


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[PrometheusServer]:
    server = PrometheusServer(tmp_path / "prometheus")
    yield server
    server.stop()


@pytest.fixture
async def exporters() -> AsyncIterator[list[StaticExporter]]:
    started: list[StaticExporter] = []
    yield started
    for exporter in started:
        await exporter.stop()


async def test_diagnosis_reads_scraped_metrics(
    prometheus: PrometheusServer, exporters: list[StaticExporter], make_spec: SpecFactory
) -> None:
    worker, router, other = (
        GrowingExporter(worker_metrics),
        GrowingExporter(router_metrics),
        GrowingExporter(worker_metrics),
    )
    for exporter in (worker, router, other):
        await exporter.start()
        exporters.append(exporter)
    mine = {"namespace": "ml", "deployment": "chat"}
    prometheus.targets = [
        ScrapeTarget(worker.address, {**mine, "role": "decode"}),
        ScrapeTarget(router.address, {**mine, "role": "router"}),
        # Another deployment's worker in the same Prometheus: must not be counted.
        ScrapeTarget(other.address, {"namespace": "ml", "deployment": "other", "role": "decode"}),
    ]
    await prometheus.start()
    # Wait until the 5 s rate window is full of scrapes (a half-empty window under-reports rates).
    await prometheus.wait_for(
        'sum(rate(vllm:prefix_cache_hits_total{deployment="chat"}[5s]))', lambda v: (v or 0) > 550
    )
    await prometheus.wait_for(
        'sum(rate(splitserve_router_output_tokens_count{deployment="chat"}[5s]))', lambda v: (v or 0) > 9
    )

    spec = make_spec(
        {
            "model": {"name": "chat-model", "parameterCount": 8_000_000_000, "maxModelLen": 8192},
            "router": {"routingPolicy": {"prefill": "round-robin"}},
        }
    )
    report = await run_diagnosis(spec, name="chat", namespace="ml", prometheus_url=prometheus.url, window="5s")
    telemetry = report.inp.telemetry
    assert telemetry is not None, report.inp.telemetry_note
    by_key = {result.key: result for result in report.results}
    explain = report.text()

    # Only "chat" is counted: 600 tokens/s, not twice that (loose bounds: scrapes jitter on a busy machine).
    assert telemetry.prefix_hits_rate.value == pytest.approx(600, rel=0.3), explain
    assert by_key["prompt-redundancy"].patch == {"router": {"routingPolicy": {"prefill": "prefix-aware"}}}, explain
    assert "high output-length variance" in by_key["output-variance"].verdict, explain
    assert by_key["kv-pressure"].status == "problem", explain
    assert "role=" in telemetry.itl_p90.query and telemetry.itl_p90.value is not None, explain
    assert 0.05 < telemetry.itl_p90.value <= 0.1, explain
    assert by_key["per-token-latency"].patch == {
        "engine": {"speculativeDecoding": {"method": "ngram", "numSpeculativeTokens": 3}}
    }, explain
    assert telemetry.request_rate.value == pytest.approx(10, rel=0.3), explain
    assert by_key["disaggregation"].status != "unknown", explain
    assert "TTFT inflation" in " ".join(e.text for e in by_key["disaggregation"].evidence)


async def test_at_reads_the_window_that_ended_then(
    prometheus: PrometheusServer, exporters: list[StaticExporter], make_spec: SpecFactory
) -> None:
    """`--at`: the diagnosis of an incident after the fact reads the window that ended at that time, not now."""
    frozen: list[float] = []  # once set, the counters stop where they were: the load is over

    def render(t: float) -> str:
        return worker_metrics(min([t, *frozen]))

    worker = GrowingExporter(render)
    await worker.start()
    exporters.append(worker)
    prometheus.targets = [
        ScrapeTarget(worker.address, {"namespace": "ml", "deployment": "chat", "role": "decode"}),
        # A router that never answers its scrapes: the note says its rates are partial (here: absent).
        ScrapeTarget("127.0.0.1:1", {"namespace": "ml", "deployment": "chat", "role": "router"}),
    ]
    await prometheus.start()
    hits = 'sum(rate(vllm:prefix_cache_hits_total{deployment="chat"}[5s]))'
    await prometheus.wait_for(hits, lambda v: (v or 0) > 550)
    during = time.time()  # every sample up to now was scraped under load
    frozen.append(time.monotonic() - worker.started)
    await prometheus.wait_for(hits, lambda v: v is not None and v < 1)  # the 5 s window now holds no growth

    spec = make_spec({"model": {"name": "chat-model"}})
    then = await run_diagnosis(spec, name="chat", namespace="ml", prometheus_url=prometheus.url, window="5s", at=during)
    now = await run_diagnosis(spec, name="chat", namespace="ml", prometheus_url=prometheus.url, window="5s")
    assert then.inp.telemetry is not None and now.inp.telemetry is not None
    assert then.inp.telemetry.prefix_hits_rate.value == pytest.approx(600, rel=0.3), then.text()
    assert (now.inp.telemetry.prefix_hits_rate.value or 0) < 1, now.text()
    assert " ending 20" in then.inp.telemetry_note and "ending" not in now.inp.telemetry_note
    assert dict(then.inp.telemetry.scrape_coverage) == {"router": 0.0, "decode": 1.0}, then.inp.telemetry_note
    assert "scrapes missed: router answered 0% of its scrapes" in then.inp.telemetry_note
