"""The diagnosis against a real Prometheus scraping vLLM-shaped and router-shaped exporters.

Checks what the fakes cannot: that every PromQL the telemetry sends parses and selects on the
monitors' relabelled `namespace`/`deployment`/`role` labels, histogram buckets (`le`) are read
back, and the verdicts follow from scraped counters.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
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


CHAT = {"namespace": "ml", "deployment": "chat"}
OTHER = {"namespace": "ml", "deployment": "other"}


async def scrape(
    prometheus: PrometheusServer,
    exporters: list[StaticExporter],
    targets: Sequence[tuple[Callable[[float], str], dict[str, str]]],
) -> None:
    """One growing exporter per (render, labels the monitors would add), all scraped by a started Prometheus."""
    scraped = []
    for render, labels in targets:
        exporter = GrowingExporter(render)
        await exporter.start()
        exporters.append(exporter)
        scraped.append(ScrapeTarget(exporter.address, labels))
    prometheus.targets = scraped
    await prometheus.start()


async def test_diagnosis_reads_scraped_metrics(
    prometheus: PrometheusServer, exporters: list[StaticExporter], make_spec: SpecFactory
) -> None:
    targets = [
        (worker_metrics, {**CHAT, "role": "decode"}),
        (router_metrics, {**CHAT, "role": "router"}),
        # Another deployment's worker in the same Prometheus: must not be counted.
        (worker_metrics, {**OTHER, "role": "decode"}),
    ]
    await scrape(prometheus, exporters, targets)
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


def lora_router_metrics(models: dict[str, tuple[float, float, float]]) -> Callable[[float], str]:
    """A router run with --lora: per model name, requests, prompt tokens and prefix-hit tokens per second."""

    def render(t: float) -> str:
        counters = (("requests", 0), ("prompt_tokens", 1), ("prefix_hit_tokens", 2), ("prefix_lookup_tokens", 1))
        lines = []
        for name, index in counters:
            lines.append(f"# TYPE splitserve_router_model_{name} counter")
            for model, rates in models.items():
                outcome = ',outcome="success"' if name == "requests" else ""
                lines.append(f'splitserve_router_model_{name}_total{{model="{model}"{outcome}}} {rates[index] * t}')
        return "\n".join([*lines, ""])

    return render


async def test_prefix_share_is_read_per_adapter(
    prometheus: PrometheusServer, exporters: list[StaticExporter], make_spec: SpecFactory
) -> None:
    """The router's per-model series, scraped: each model name's share, and the adapter whose prompts miss."""
    targets = [
        (worker_metrics, {**CHAT, "role": "decode"}),
        # The base model finds 65% of its prompt tokens cached, adapter b 5%; "" counts names no worker serves.
        (
            lora_router_metrics({"chat-model": (8, 800, 520), "b": (6, 400, 20), "": (0.5, 50, 0)}),
            {**CHAT, "role": "router"},
        ),
        # Another deployment's router, with an adapter of its own: not counted.
        (lora_router_metrics({"chat-model": (8, 800, 0), "x": (5, 500, 0)}), {**OTHER, "role": "router"}),
    ]
    await scrape(prometheus, exporters, targets)
    await prometheus.wait_for(
        'sum(rate(splitserve_router_model_prompt_tokens_total{deployment="chat",model="b"}[3s]))',
        lambda v: (v or 0) > 360,
    )

    spec = make_spec({"model": {"name": "chat-model", "parameterCount": 8_000_000_000}})
    report = await run_diagnosis(spec, name="chat", namespace="ml", prometheus_url=prometheus.url, window="3s")
    telemetry = report.inp.telemetry
    assert telemetry is not None, report.inp.telemetry_note
    explain = report.text()
    shares = {model.model: model.prefix_hit_share for model in telemetry.models}
    assert list(shares) == ["chat-model", "b"], explain
    assert shares["chat-model"] == pytest.approx(0.65, abs=0.05) and shares["b"] == pytest.approx(0.05, abs=0.02)
    redundancy = {result.key: result for result in report.results}["prompt-redundancy"]
    far = r"adapter b: [3-7]% of its prompt tokens found cached, the other models 6\d%"
    assert re.search(far, redundancy.verdict), explain
    # The decode worker's KV cache is 97% full: b's blocks serve b alone, evicted between its requests.
    assert redundancy.status == "recommend" and "make KV room (question 4)" in redundancy.recommendation, explain


def calm_worker_metrics(t: float) -> str:
    """A decode engine with free slots; its inter-token gaps all 25-75 ms, 90% of them over 50 ms (vLLM's buckets)."""
    labels = 'model_name="chat-model"'
    return "\n".join(
        [
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} 2",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} 0",
            histogram(
                "vllm:inter_token_latency_seconds",
                {"0.025": 0, "0.05": 10, "0.075": 100, "0.1": 100, "+Inf": 100},
                6.0,
                t,
                labels,
            ),
            "",
        ]
    )


def router_ttft_metrics(buckets: dict[str, float]) -> Callable[[float], str]:
    def render(t: float) -> str:
        return "\n".join(
            [
                histogram("splitserve_router_ttft_seconds", buckets, 20.0, t),
                histogram("splitserve_router_prompt_tokens", {"1024.0": 0, "2048.0": 10, "+Inf": 10}, 20_000.0, t),
                histogram("splitserve_router_output_tokens", {"64.0": 0, "128.0": 10, "+Inf": 10}, 1000.0, t),
                "",
            ]
        )

    return render


async def test_quantiles_in_the_slos_bucket_are_judged_from_the_scraped_le_labels(
    prometheus: PrometheusServer, exporters: list[StaticExporter], make_spec: SpecFactory
) -> None:
    """The bucket bounds come from the `le` labels Prometheus scraped, per histogram and per deployment: the
    router's TTFT p90 (~2.25 s) and the engines' ITL p90 (~72 ms) each lie in the bucket that holds their SLO
    (1.0-2.5 s around 2 s, vLLM's 50-75 ms around 60 ms), so neither verdict says over or within."""
    targets = [
        (calm_worker_metrics, {**CHAT, "role": "decode"}),
        # 40% of first bytes within 1 s, all within 2.5 s.
        (router_ttft_metrics({"0.5": 0, "1.0": 4, "2.5": 10, "5.0": 10, "+Inf": 10}), {**CHAT, "role": "router"}),
        # Another deployment's router with a bound at 2 s: its buckets must not be read for "chat".
        (router_ttft_metrics({"1.0": 4, "2.0": 7, "2.5": 10, "+Inf": 10}), {**OTHER, "role": "router"}),
    ]
    await scrape(prometheus, exporters, targets)
    for ready in (
        'sum(rate(splitserve_router_ttft_seconds_count{deployment="chat"}[5s]))',
        'sum(rate(vllm:inter_token_latency_seconds_count{deployment="chat"}[5s]))',
        'sum(rate(splitserve_router_ttft_seconds_count{deployment="other"}[5s]))',
    ):
        await prometheus.wait_for(ready, lambda v: (v or 0) > 5)

    spec = make_spec(
        {
            "model": {"name": "chat-model", "parameterCount": 8_000_000_000},
            "prefill": {"resources": {"gpus": 0, "cpu": "4", "memory": "16Gi"}},
            "decode": {"resources": {"gpus": 0, "cpu": "4", "memory": "16Gi"}},
            "autoscaling": {"prefill": {"ttftSloSeconds": 2.0}, "decode": {"itlSloSeconds": 0.06}},
        }
    )
    report = await run_diagnosis(spec, name="chat", namespace="ml", prometheus_url=prometheus.url, window="5s")
    telemetry = report.inp.telemetry
    assert telemetry is not None, report.inp.telemetry_note
    explain = report.text()
    assert telemetry.router.ttft_p90.buckets == (0.5, 1.0, 2.5, 5.0, math.inf), explain
    assert telemetry.itl_p90.buckets == (0.025, 0.05, 0.075, 0.1, math.inf), explain
    by_key = {result.key: result for result in report.results}

    ttft = by_key["disaggregation"]
    assert ttft.status == "unknown", explain
    assert re.match(
        r"TTFT p90 ≈ 2\.\d+ s at the router is within one histogram bucket of the 2 s SLO "
        r"\(the bucket is 1\.0-2\.5 s\): the histogram cannot tell",
        ttft.verdict,
    ), explain
    itl = by_key["per-token-latency"]
    assert itl.status == "unknown" and itl.patch is None, explain
    assert re.match(
        r"ITL p90 ≈ \d+ ms \(engines\) is within one histogram bucket of the 60 ms SLO \(the bucket is 50-75 ms\)",
        itl.verdict,
    ), explain

    document = report.document()
    assert document["telemetry"]["histogramBuckets"] == {
        "splitserve_router_ttft_seconds": [0.5, 1.0, 2.5, 5.0],
        "vllm:inter_token_latency_seconds": [0.025, 0.05, 0.075, 0.1],
    }, document["telemetry"]
