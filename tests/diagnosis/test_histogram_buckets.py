"""A quantile against an SLO is judged only as finely as its histogram bucket (issue 26).

histogram_quantile interpolates inside the bucket that holds the quantile: when that bucket also holds the
SLO, the verdict says the histogram cannot tell, names the bucket, and is no problem (and no patch).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from splitserve.diagnosis.buckets import bucket_of, judge
from splitserve.diagnosis.questions import per_token_latency
from splitserve.diagnosis.render import summarise, to_json_document
from splitserve.diagnosis.scale import disaggregation
from splitserve.diagnosis.telemetry import Reading, Telemetry, read_bounds
from tests.diagnosis.conftest import InputFactory, SpecFactory
from tests.diagnosis.test_capacity import CPU_POOLS, FACTS_8B, TRAFFIC, UNSATURATED_PREFILL, telemetry

# Coarse buckets, as the router had before issue 26 (and as vLLM's engines still have around 1-5 s).
COARSE = (0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, math.inf)
# vLLM's inter-token latency buckets (fixed by vLLM).
VLLM_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, math.inf)


def with_buckets(reading: Reading, buckets: tuple[float, ...]) -> Reading:
    return dataclasses.replace(reading, buckets=buckets)


def router_ttft(p90: float, p99: float) -> Telemetry:
    """No pool saturated; the router's TTFT quantiles read from the coarse buckets."""
    tel = telemetry(
        prefill=UNSATURATED_PREFILL,
        decode={"replicas": 1, "running": 2.0, "generation_tokens_rate": 80.0},
        router={"arrival_rate": 1.68, "completion_rate": 1.68, "ttft_mean": 0.8, "ttft_p90": p90, "ttft_p99": p99},
        **TRAFFIC,
    )
    router = dataclasses.replace(
        tel.router,
        ttft_p90=with_buckets(tel.router.ttft_p90, COARSE),
        ttft_p99=with_buckets(tel.router.ttft_p99, COARSE),
    )
    return dataclasses.replace(tel, router=router, histogram_buckets_query="q_bounds")


TTFT_SLO_2S: dict[str, Any] = {**CPU_POOLS, "autoscaling": {"prefill": {"ttftSloSeconds": 2.0}}}


@pytest.mark.parametrize("p90", [2.05, 1.5])
def test_a_ttft_p90_in_the_slos_bucket_cannot_be_told(
    make_spec: SpecFactory, make_input: InputFactory, p90: float
) -> None:
    """Interpolated over the SLO (2.05 s) or under it (1.5 s): the 1.0-2.5 s bucket holds both, so neither."""
    inp = make_input(make_spec(TTFT_SLO_2S), telemetry=router_ttft(p90, 2.4), facts=FACTS_8B)
    result = disaggregation(inp)
    assert result.status == "unknown", result.verdict
    assert result.verdict.startswith(
        f"TTFT p90 ≈ {p90:.3g} s at the router is within one histogram bucket of the 2 s SLO "
        "(the bucket is 1.0-2.5 s): the histogram cannot tell"
    ), result.verdict
    assert "over" not in result.verdict.split(":")[0] and "holds" not in result.verdict
    assert result.patch is None and result.recommendation == ""
    assert any("1.0-2.5 s" in e.text and e.source == "prometheus: q_bounds" for e in result.evidence)
    # Never counted as something to change, whether read from the result or from status.diagnosis.
    assert summarise([result]) == summarise([result.to_finding()]) == "fit unknown; no recommendations"


def test_a_ttft_p90_clearly_above_the_slos_bucket_is_over(make_spec: SpecFactory, make_input: InputFactory) -> None:
    result = disaggregation(make_input(make_spec(TTFT_SLO_2S), telemetry=router_ttft(3.0, 4.5), facts=FACTS_8B))
    assert result.status == "problem"
    assert result.verdict.startswith("TTFT p90 3.00 s at the router is over the 2 s SLO"), result.verdict


def test_a_ttft_p90_clearly_below_the_slos_bucket_is_ok(make_spec: SpecFactory, make_input: InputFactory) -> None:
    result = disaggregation(make_input(make_spec(TTFT_SLO_2S), telemetry=router_ttft(0.8, 0.95), facts=FACTS_8B))
    assert result.status == "ok", result.verdict


def test_a_certain_p99_stays_a_problem_beside_an_uncertain_p90(
    make_spec: SpecFactory, make_input: InputFactory
) -> None:
    result = disaggregation(make_input(make_spec(TTFT_SLO_2S), telemetry=router_ttft(2.05, 9.0), facts=FACTS_8B))
    assert result.status == "problem"
    assert result.verdict.startswith(
        "TTFT p90 ≈ 2.05 s at the router is within one histogram bucket of the 2 s SLO (the bucket is 1.0-2.5 s), "
        "but p99 9.00 s is 4.5x it"
    ), result.verdict


def decode_itl(p90: float, p99: float) -> Telemetry:
    tel = telemetry(prefill={}, decode={}, itl_p90=p90, itl_p99=p99, running_per_replica=4.0)
    return dataclasses.replace(
        tel, itl_p90=with_buckets(tel.itl_p90, VLLM_ITL), itl_p99=with_buckets(tel.itl_p99, VLLM_ITL)
    )


ITL_SLO_60MS: dict[str, Any] = {**CPU_POOLS, "autoscaling": {"decode": {"itlSloSeconds": 0.06}}}


def test_an_itl_p90_in_the_slos_bucket_turns_nothing_on(make_spec: SpecFactory, make_input: InputFactory) -> None:
    """At a small batch an ITL over the SLO turns speculative decoding on; one the bucket cannot place does not."""
    result = per_token_latency(make_input(make_spec(ITL_SLO_60MS), telemetry=decode_itl(0.062, 0.07), facts=FACTS_8B))
    assert result.status == "unknown", result.verdict
    assert result.verdict == (
        "ITL p90 ≈ 62 ms (engines) is within one histogram bucket of the 60 ms SLO (the bucket is 50-75 ms): "
        "the histogram cannot tell"
    )
    assert result.patch is None and result.recommendation == ""


def test_an_itl_p90_above_or_below_the_slos_bucket_is_judged(make_spec: SpecFactory, make_input: InputFactory) -> None:
    spec = make_spec(ITL_SLO_60MS)
    over = per_token_latency(make_input(spec, telemetry=decode_itl(0.08, 0.09), facts=FACTS_8B))
    assert over.status == "recommend" and "ITL p90 80 ms over the 60 ms SLO at low load" in over.verdict
    within = per_token_latency(make_input(spec, telemetry=decode_itl(0.04, 0.045), facts=FACTS_8B))
    assert within.status == "ok" and within.verdict.startswith("ITL p90 40 ms, p99 45 ms meet the 60 ms SLO")
    # A p99 in the bucket that holds twice the SLO (100-150 ms holds 120 ms) cannot be told either.
    tail = per_token_latency(make_input(spec, telemetry=decode_itl(0.04, 0.13), facts=FACTS_8B))
    assert tail.status == "unknown"
    assert tail.verdict.startswith("engine ITL p99 ≈ 130 ms is within one histogram bucket of 2x the 60 ms SLO")
    # Far outside: a problem even while the p90 cannot be placed.
    stalls = per_token_latency(make_input(spec, telemetry=decode_itl(0.062, 3.9), facts=FACTS_8B))
    assert stalls.status == "problem"
    assert stalls.verdict.startswith(
        "ITL p90 ≈ 62 ms (engines) is within one histogram bucket of the 60 ms SLO (the bucket is 50-75 ms), "
        "but the tail does not: engine ITL p99 3900 ms is 65.0x the SLO"
    ), stalls.verdict


@pytest.mark.parametrize(
    ("value", "limit", "side", "bucket"),
    [
        (2.05, 2.0, "unsure", (1.0, 2.5)),
        (2.5, 2.0, "unsure", (1.0, 2.5)),  # on a bound: the top of the bucket below it
        (3.0, 2.5, "over", (2.5, 5.0)),  # an SLO on a bound is judged exactly
        (2.5, 2.5, "within", (1.0, 2.5)),
        (0.2, 2.0, "within", (0.0, 0.25)),  # below the first bound: from 0
        (10.0, 12.0, "unsure", (5.0, math.inf)),  # the highest bound is also the +Inf bucket's answer
    ],
)
def test_judge_places_the_quantile_in_its_bucket(
    value: float, limit: float, side: str, bucket: tuple[float, float]
) -> None:
    assert bucket_of(value, COARSE) == bucket
    assert judge(value, limit, COARSE).side == side


def test_without_bounds_the_value_is_taken_as_exact() -> None:
    assert judge(2.05, 2.0).side == "over" and judge(1.95, 2.0).side == "within"


def test_bounds_are_those_every_series_has() -> None:
    """An old router (1.0, 2.5) beside a new one (1.0, 2.0, 2.5): the sum is whole only on the shared bounds."""

    def labels(le: str) -> frozenset[tuple[str, str]]:
        return frozenset({("histogram", "splitserve_router_ttft_seconds"), ("le", le)})

    counts = {labels("1.0"): 2.0, labels("2.0"): 1.0, labels("2.5"): 2.0, labels("+Inf"): 2.0}
    assert read_bounds(counts) == {"splitserve_router_ttft_seconds": (1.0, 2.5, math.inf)}


def test_json_carries_the_bucket_bounds(make_spec: SpecFactory, make_input: InputFactory) -> None:
    tel = dataclasses.replace(router_ttft(2.05, 2.4), histogram_buckets=(("splitserve_router_ttft_seconds", COARSE),))
    inp = make_input(make_spec(TTFT_SLO_2S), telemetry=tel, facts=FACTS_8B)
    document = to_json_document("chat", "ml", inp, [disaggregation(inp)], "http://prometheus")
    assert document["telemetry"]["histogramBuckets"] == {"splitserve_router_ttft_seconds": list(COARSE[:-1])}
    assert "(the bucket is 1.0-2.5 s)" in document["findings"][0]["verdict"]
