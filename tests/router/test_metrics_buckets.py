"""The router's latency buckets: dense where SLOs lie, round, and holding every bound a rule reads."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from splitserve.router.metrics import LATENCY_BUCKETS, RouterMetrics

RULES = Path(__file__).resolve().parents[2] / "deploy" / "monitoring" / "prometheusrule.yaml"
LATENCY_HISTOGRAMS = (
    "ttft_seconds",
    "generation_ttft_seconds",
    "itl_seconds",
    "e2e_seconds",
    "kv_handoff_seconds",
    "queue_wait_seconds",
    "prefill_seconds",
)


def exported_bounds() -> dict[str, list[str]]:
    """`le` labels of each latency histogram as a scrape reads them."""
    metrics = RouterMetrics()
    metrics.ttft.observe(0.3)
    metrics.generation_ttft.labels("g1").observe(0.3)
    metrics.queue_wait.labels("decode").observe(0.0)
    bounds: dict[str, list[str]] = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                name = sample.name.removeprefix("splitserve_router_").removesuffix("_bucket")
                les = bounds.setdefault(name, [])
                if sample.labels["le"] not in les:
                    les.append(sample.labels["le"])
    return bounds


def test_every_latency_histogram_exports_the_same_buckets() -> None:
    bounds = exported_bounds()
    expected = [*(repr(bound) for bound in LATENCY_BUCKETS), "+Inf"]
    assert {name: bounds.get(name) for name in LATENCY_HISTOGRAMS} == dict.fromkeys(LATENCY_HISTOGRAMS, expected)


def test_buckets_are_dense_between_10_ms_and_10_s() -> None:
    dense = [bound for bound in LATENCY_BUCKETS if 0.01 <= bound <= 10.0]
    assert dense[0] == 0.01 and dense[-1] == 10.0
    widest = max(upper / lower for lower, upper in itertools.pairwise(dense))
    assert widest <= 1.17, widest


def test_round_slos_and_their_doubles_are_bounds() -> None:
    """An SLO on a bound is judged exactly; the diagnosis also judges p99 against 2x the SLO."""
    slos = (0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0)
    missing = [slo for slo in slos for limit in (slo, 2 * slo) if round(limit, 6) not in LATENCY_BUCKETS]
    assert not missing


def test_earlier_bounds_and_the_alert_rules_bounds_are_kept() -> None:
    earlier_latency = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0)
    earlier_itl = (0.02, 0.03, 0.2, 0.3)
    earlier_tail = (10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
    assert set(earlier_latency + earlier_itl + earlier_tail) <= set(LATENCY_BUCKETS)
    exported = exported_bounds()
    read = re.findall(r"splitserve_router_(\w+?)_bucket\{le=\"([^\"]+)\"\}", RULES.read_text())
    assert read, "the alert rules read no router bucket any more: drop this check"
    for histogram, le in read:
        assert le in exported[histogram], (histogram, le)
