"""Questions 2-6 over tables of telemetry that should and should not trigger each verdict."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from splitserve.diagnosis.findings import fmt_value
from splitserve.diagnosis.model_facts import KvShape, ModelFacts
from splitserve.diagnosis.questions import (
    disaggregation,
    kv_pressure,
    output_variance,
    per_token_latency,
    prompt_redundancy,
    traffic_needs,
)
from splitserve.diagnosis.sizing import histogram_cv
from splitserve.diagnosis.telemetry import Reading, Telemetry
from tests.diagnosis.conftest import InputFactory, SpecFactory, patched

FACTS_8B = ModelFacts(8.03e9, "model config (test)", KvShape(32, 8, 128), "model config (test)", 32, 131072)


def tel(buckets: dict[float, float] | None = None, /, **values: float | None) -> Telemetry:
    readings = {name: Reading(value, f"q_{name}") for name, value in values.items()}
    return Telemetry(
        output_tokens_buckets=tuple(sorted((buckets or {}).items())),
        output_tokens_buckets_query="q_buckets",
        **readings,  # type: ignore[arg-type]
    )


# --------------------------------------------------------------------------- 2. prompt redundancy


@pytest.mark.parametrize(
    ("spec_patch", "hits", "queries", "status", "patch"),
    [
        # 60% of prompt tokens hit the cache but round-robin scatters them: route by prefix.
        (
            {"router": {"routingPolicy": {"prefill": "round-robin"}}},
            600.0,
            1000.0,
            "recommend",
            {"router": {"routingPolicy": {"prefill": "prefix-aware"}}},
        ),
        # Aggregated mode routes on the decode policy.
        (
            {"mode": "aggregated", "router": {"routingPolicy": {"decode": "least-loaded"}}},
            600.0,
            1000.0,
            "recommend",
            {"router": {"routingPolicy": {"decode": "prefix-aware"}}},
        ),
        ({}, 600.0, 1000.0, "ok", None),  # already prefix-aware (the default)
        # precise-prefix routes by prefix too (on the engines' own cache events): nothing to recommend.
        ({"router": {"routingPolicy": {"prefill": "precise-prefix"}}}, 600.0, 1000.0, "ok", None),
        ({"router": {"routingPolicy": {"prefill": "round-robin"}}}, 50.0, 1000.0, "ok", None),  # little redundancy
        ({}, 0.0, 0.0, "unknown", None),  # no traffic
        ({"engine": {"prefixCaching": False}}, 0.0, 0.0, "recommend", {"engine": {"prefixCaching": True}}),
    ],
)
def test_prompt_redundancy(
    make_spec: SpecFactory,
    make_input: InputFactory,
    spec_patch: dict[str, Any],
    hits: float,
    queries: float,
    status: str,
    patch: dict[str, Any] | None,
) -> None:
    telemetry = tel(prefix_hits_rate=hits, prefix_queries_rate=queries)
    result = prompt_redundancy(make_input(make_spec(spec_patch), telemetry=telemetry, facts=FACTS_8B))
    assert (result.status, result.patch) == (status, patch)
    if queries:
        assert any("prometheus: q_prefix_hits_rate" in e.source for e in result.evidence)


def test_scattered_prefixes_are_pointed_out(make_spec: SpecFactory, make_input: InputFactory) -> None:
    spec = make_spec({"router": {"routingPolicy": {"prefill": "round-robin"}}, "prefill": {"replicas": 3}})
    result = prompt_redundancy(
        make_input(spec, telemetry=tel(prefix_hits_rate=100.0, prefix_queries_rate=1000.0), facts=FACTS_8B)
    )
    assert result.status == "ok"  # 10% measured: the decision stays on what was measured
    assert any("up to 30%" in e.text and "3 replicas" in e.text for e in result.evidence)


def test_prompt_redundancy_without_telemetry_says_so(make_spec: SpecFactory, make_input: InputFactory) -> None:
    result = prompt_redundancy(make_input(make_spec(), facts=FACTS_8B))
    assert result.status == "unknown" and result.verdict.startswith("no telemetry:")


# --------------------------------------------------------------------------- 3. output length variance


def test_histogram_cv_of_a_constant_length_is_near_zero() -> None:
    buckets = [(64.0, 0.0), (128.0, 10.0), (256.0, 10.0), (math.inf, 10.0)]
    cv = histogram_cv(buckets, 100.0)
    assert cv is not None and cv < 0.1


def test_histogram_cv_of_a_bimodal_mix_is_high() -> None:
    # Half answer in <= 8 tokens, half write ~1000: the spread is about the mean.
    buckets = [(8.0, 5.0), (512.0, 5.0), (1024.0, 10.0), (math.inf, 10.0)]
    cv = histogram_cv(buckets, (4 * 5 + 1000 * 5) / 10)
    assert cv is not None and 0.7 < cv < 1.2  # true CV 0.99; midpoints put the long half at 768


def test_histogram_cv_of_nothing_is_none() -> None:
    assert histogram_cv([], 10.0) is None
    assert histogram_cv([(8.0, 0.0), (math.inf, 0.0)], 10.0) is None


@given(st.lists(st.integers(min_value=9, max_value=4000), min_size=2, max_size=200))
def test_histogram_cv_error_is_bounded_by_the_bucket_resolution(lengths: list[int]) -> None:
    """Above 8 tokens the router's buckets double: a midpoint is off by at most half the value, so
    (the mean being exact) the estimated CV is within 0.5 * sqrt(1 + CV^2) of the true one."""
    bounds = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, math.inf]
    buckets = [(float(b), float(sum(1 for x in lengths if x <= b))) for b in bounds]
    mean = sum(lengths) / len(lengths)
    cv = histogram_cv(buckets, mean)
    assert cv is not None and cv >= 0
    true_cv = math.sqrt(sum((x - mean) ** 2 for x in lengths) / len(lengths)) / mean
    assert abs(cv - true_cv) <= 0.5 * math.sqrt(1 + true_cv**2) + 1e-9


@pytest.mark.parametrize(
    ("spec_patch", "status", "patch", "verdict_part"),
    [
        ({"engine": {"maxNumSeqs": 1}}, "problem", {"engine": {"maxNumSeqs": None}}, "max-num-seqs 1"),
        (
            {"decode": {"extraArgs": ["--enforce-eager", "--max-num-seqs", "2"]}},
            "problem",
            {"decode": {"extraArgs": ["--enforce-eager"]}},
            "max-num-seqs 2",
        ),
        ({"engine": {"extraArgs": ["--max-num-seqs=4"]}}, "problem", {"engine": {"extraArgs": []}}, "max-num-seqs 4"),
        ({"engine": {"maxNumSeqs": 256}}, "ok", None, "high output-length variance"),
        ({}, "ok", None, "high output-length variance"),
    ],
)
def test_output_variance(
    make_spec: SpecFactory,
    make_input: InputFactory,
    spec_patch: dict[str, Any],
    status: str,
    patch: dict[str, Any] | None,
    verdict_part: str,
) -> None:
    bimodal = tel(
        {8.0: 5.0, 512.0: 5.0, 1024.0: 10.0, math.inf: 10.0},
        output_tokens_sum_rate=5020.0,
        output_tokens_count_rate=10.0,
    )
    spec = make_spec(spec_patch)
    result = output_variance(make_input(spec, telemetry=bimodal, facts=FACTS_8B))
    assert (result.status, result.patch) == (status, patch)
    assert verdict_part in result.verdict
    if patch:
        assert output_variance(make_input(patched(spec, patch), telemetry=bimodal, facts=FACTS_8B)).status == "ok"


def test_low_output_variance_and_no_telemetry(make_spec: SpecFactory, make_input: InputFactory) -> None:
    steady = tel({64.0: 0.0, 128.0: 10.0, math.inf: 10.0}, output_tokens_sum_rate=1000.0, output_tokens_count_rate=10.0)
    assert "low output-length variance" in output_variance(make_input(make_spec(), telemetry=steady)).verdict
    blind = output_variance(make_input(make_spec()))
    assert blind.verdict.startswith("no telemetry:") and blind.status == "ok"


# --------------------------------------------------------------------------- 4. KV pressure


@pytest.mark.parametrize(
    ("spec_patch", "values", "status", "patch"),
    [
        # Preempting with a low memory budget: give vLLM more of the GPU first.
        (
            {"engine": {"gpuMemoryUtilization": 0.7}},
            {"preemptions_rate": 0.5, "kv_usage_max": 0.99, "waiting_for_capacity": 0.0},
            "problem",
            {"engine": {"gpuMemoryUtilization": 0.9}},
        ),
        # Waiting for KV blocks with a large block size: fragmentation.
        (
            {"engine": {"blockSize": 128}},
            {"preemptions_rate": 0.0, "kv_usage_max": 0.95, "waiting_for_capacity": 3.0},
            "problem",
            {"engine": {"blockSize": 16}},
        ),
        # Settings already good: more decode replicas.
        (
            {"decode": {"replicas": 2, "maxReplicas": 2}},
            {"preemptions_rate": 0.2, "kv_usage_max": 0.99, "waiting_for_capacity": 1.0},
            "problem",
            {"decode": {"replicas": 3, "maxReplicas": 3}},
        ),
        (
            {"autoscaling": {"enabled": True}, "decode": {"maxReplicas": 4}},
            {"preemptions_rate": 0.2},
            "problem",
            {"decode": {"maxReplicas": 5}},
        ),
        # Busy but healthy; idle; a trickle of preemptions under the threshold.
        ({}, {"preemptions_rate": 0.0, "kv_usage_max": 0.85, "waiting_for_capacity": 0.0}, "ok", None),
        ({}, {"preemptions_rate": 0.0, "kv_usage_max": 0.1, "waiting_for_capacity": 0.0}, "ok", None),
        ({}, {"preemptions_rate": 0.001, "kv_usage_max": 0.5, "waiting_for_capacity": 0.1}, "ok", None),
        ({}, {}, "unknown", None),
    ],
)
def test_kv_pressure(
    make_spec: SpecFactory,
    make_input: InputFactory,
    spec_patch: dict[str, Any],
    values: dict[str, float],
    status: str,
    patch: dict[str, Any] | None,
) -> None:
    spec = make_spec(spec_patch)
    result = kv_pressure(make_input(spec, telemetry=tel(**values), facts=FACTS_8B))
    assert (result.status, result.patch) == (status, patch)
    if patch:
        patched(spec, patch)  # stays a valid spec


def test_kv_pressure_without_telemetry(make_spec: SpecFactory, make_input: InputFactory) -> None:
    assert kv_pressure(make_input(make_spec())).verdict.startswith("no telemetry:")
    large_blocks = kv_pressure(make_input(make_spec({"engine": {"blockSize": 128}})))
    assert large_blocks.patch == {"engine": {"blockSize": 16}}


# --------------------------------------------------------------------------- 5. per-token latency

SPEC_ON = {"engine": {"speculativeDecoding": {"method": "ngram"}}}
TURN_ON = {"engine": {"speculativeDecoding": {"method": "ngram", "numSpeculativeTokens": 3}}}
TURN_OFF = {"engine": {"speculativeDecoding": {"method": "off"}}}


@pytest.mark.parametrize(
    ("spec_patch", "itl", "batch", "status", "patch"),
    [
        ({}, 0.080, 4.0, "recommend", TURN_ON),  # slow tokens at low load: speculate
        ({}, 0.030, 4.0, "ok", None),  # meets the 50 ms SLO
        ({}, 0.080, 20.0, "problem", {"decode": {"replicas": 2}}),  # too busy to speculate: scale out
        (
            {"autoscaling": {"enabled": True}},
            0.080,
            20.0,
            "problem",
            {"autoscaling": {"decode": {"runningPerReplica": 20}}},
        ),
        (SPEC_ON, 0.030, 48.0, "recommend", TURN_OFF),  # on at high load: turn off
        (SPEC_ON, 0.080, 48.0, "recommend", TURN_OFF),
        (SPEC_ON, 0.030, 4.0, "ok", None),  # on at low load and meeting the SLO: keep
    ],
)
def test_per_token_latency(
    make_spec: SpecFactory,
    make_input: InputFactory,
    spec_patch: dict[str, Any],
    itl: float,
    batch: float,
    status: str,
    patch: dict[str, Any] | None,
) -> None:
    telemetry = tel(itl_p90=itl, running_per_replica=batch)
    result = per_token_latency(make_input(make_spec(spec_patch), telemetry=telemetry, facts=FACTS_8B))
    assert (result.status, result.patch) == (status, patch)
    assert any(e.source == "prometheus: q_itl_p90" for e in result.evidence)


def test_per_token_latency_without_telemetry(make_spec: SpecFactory, make_input: InputFactory) -> None:
    result = per_token_latency(make_input(make_spec(SPEC_ON)))
    assert result.status == "unknown" and result.verdict.startswith("no telemetry:")
    assert "small batch" in result.verdict


# --------------------------------------------------------------------------- 6. disaggregation


def test_low_traffic_on_disaggregated_pools_recommends_aggregated(
    make_spec: SpecFactory, make_input: InputFactory
) -> None:
    telemetry = tel(
        request_rate=0.5, prompt_tokens_rate=500.0, generation_tokens_rate=100.0, ttft_p90=0.2, prefill_time_p90=0.15
    )
    result = disaggregation(make_input(make_spec(), telemetry=telemetry, facts=FACTS_8B))
    assert (result.status, result.patch) == ("recommend", {"mode": "aggregated"})


def test_interference_on_aggregated_pool_recommends_disaggregation(
    make_spec: SpecFactory, make_input: InputFactory
) -> None:
    # 20 req/s of 4k-token prompts, TTFT 3x the prefill time.
    telemetry = tel(
        request_rate=20.0,
        prompt_tokens_rate=80_000.0,
        generation_tokens_rate=4_000.0,
        ttft_p90=1.5,
        prefill_time_p90=0.5,
    )
    spec = make_spec({"mode": "aggregated", "kvTransfer": {"connector": "None"}})
    result = disaggregation(make_input(spec, telemetry=telemetry, facts=FACTS_8B))
    assert result.status == "recommend"
    assert result.patch is not None
    assert result.patch["mode"] == "disaggregated"
    assert result.patch["kvTransfer"] == {"connector": "NixlConnector"}
    assert result.patch["prefill"]["replicas"] >= 1 and result.patch["decode"]["replicas"] >= 1
    patched(spec, result.patch)


@pytest.mark.parametrize(
    ("ttft", "prefill", "prompt_rate"),
    [(0.6, 0.5, 80_000.0), (1.5, 0.5, 800.0)],  # no interference; short prompts (40 tokens)
)
def test_aggregated_stays_when_no_interference_or_short_prompts(
    make_spec: SpecFactory, make_input: InputFactory, ttft: float, prefill: float, prompt_rate: float
) -> None:
    telemetry = tel(
        request_rate=20.0,
        prompt_tokens_rate=prompt_rate,
        generation_tokens_rate=4_000.0,
        ttft_p90=ttft,
        prefill_time_p90=prefill,
    )
    result = disaggregation(make_input(make_spec({"mode": "aggregated"}), telemetry=telemetry, facts=FACTS_8B))
    assert (result.status, result.patch) == ("ok", None)


def test_prefill_decode_ratio_rebalanced_to_traffic(make_spec: SpecFactory, make_input: InputFactory) -> None:
    # Decode-heavy traffic (short prompts, long answers) served by 4 prefill : 1 decode.
    telemetry = tel(
        request_rate=50.0,
        prompt_tokens_rate=50 * 300.0,
        generation_tokens_rate=50 * 800.0,
        ttft_p90=0.3,
        prefill_time_p90=0.1,
    )
    spec = make_spec({"prefill": {"replicas": 4}, "decode": {"replicas": 1}})
    result = disaggregation(make_input(spec, telemetry=telemetry, facts=FACTS_8B))
    assert result.status == "recommend"
    assert result.patch is not None
    assert result.patch["decode"]["replicas"] > result.patch["prefill"]["replicas"]
    after = disaggregation(make_input(patched(spec, result.patch), telemetry=telemetry, facts=FACTS_8B))
    assert after.status == "ok", after.verdict


def test_disaggregation_without_telemetry_or_traffic(make_spec: SpecFactory, make_input: InputFactory) -> None:
    assert disaggregation(make_input(make_spec())).verdict.startswith("no telemetry:")
    idle = disaggregation(make_input(make_spec(), telemetry=tel(request_rate=0.0), facts=FACTS_8B))
    assert idle.verdict == "no traffic in the window"


def test_kv_pressure_sizes_decode_by_traffic_when_it_is_known(make_spec: SpecFactory, make_input: InputFactory) -> None:
    busy = tel(
        preemptions_rate=1.0,
        request_rate=50.0,
        prompt_tokens_rate=50 * 300.0,
        generation_tokens_rate=50 * 800.0,
    )
    inp = make_input(make_spec(), telemetry=busy, facts=FACTS_8B)
    needs = traffic_needs(inp)
    assert needs is not None and needs[1] > 3
    result = kv_pressure(inp)
    assert result.patch == {"decode": {"replicas": math.ceil(needs[1]), "maxReplicas": math.ceil(needs[1])}}
    assert "traffic needs" in result.recommendation


@pytest.mark.parametrize(
    ("value", "text"), [(None, "no data"), (0.0123, "0.0123"), (99.5, "99.5"), (20_000.0, "20,000"), (1234.6, "1,235")]
)
def test_numbers_are_shown_for_people(value: float | None, text: str) -> None:
    assert fmt_value(value) == text
