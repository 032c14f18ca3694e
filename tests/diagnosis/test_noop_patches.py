"""A recommendation changes something (issue 14 §4): no finding carries a patch that leaves the spec as it is.

Two layers are tested. The questions themselves must not build a no-op patch: one case of each kind
of patch they emit is fed a spec where that change is already made, and a property test runs all six
questions over random specs and telemetry. `diagnose` then drops any no-op patch that slips through
(`without_noop_patches`), which is tested on its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitserve.api.patch import changes_spec
from splitserve.api.spec import InferenceDeploymentSpec
from splitserve.diagnosis.findings import DiagnosisInput, answer
from splitserve.diagnosis.gpus import choose_gpu
from splitserve.diagnosis.model_facts import KvShape, ModelFacts
from splitserve.diagnosis.questions import QUESTIONS, diagnose, without_noop_patches
from splitserve.diagnosis.telemetry import PoolReadings, Reading, RouterReadings, Telemetry
from tests.diagnosis.conftest import InputFactory, SpecFactory

FACTS_8B = ModelFacts(8.03e9, "model config (test)", KvShape(32, 8, 128), "model config (test)", 32, 131072)
CPU_POOLS = {"resources": {"gpus": 0, "cpu": "4", "memory": "16Gi"}}


def readings(cls: type[Any], **values: float | None) -> Any:
    return cls(**{name: Reading(value, f"q_{name}") for name, value in values.items()})


def assert_changes(spec: InferenceDeploymentSpec, inp: DiagnosisInput) -> None:
    for question in QUESTIONS:
        result = question(inp)
        patches = [result.patch] + [option.patch for option in result.alternatives]
        for patch in patches:
            if patch is not None:
                assert changes_spec(spec, patch), f"Q{result.number} {result.status}: {result.verdict}: {patch}"


# --------------------------------------------------------------------------- one case of each kind


def test_the_issue_example_ratio_patch_of_the_current_replicas_is_not_emitted(
    make_spec: SpecFactory, make_input: InputFactory
) -> None:
    # The reported run: CPU pools, 1 prefill + 1 decode, light traffic. Before, the datasheet's
    # 232M tokens/s "needed 0.00 replicas" and the patch {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}.
    spec = make_spec({"prefill": CPU_POOLS, "decode": CPU_POOLS})
    telemetry = Telemetry(
        request_rate=Reading(1.68, "q"),
        prompt_tokens_rate=Reading(1.68 * 576, "q"),
        generation_tokens_rate=Reading(1.68 * 48, "q"),
        ttft_p90=Reading(0.9, "q"),
        prefill_time_p90=Reading(0.29, "q"),
        prefill=readings(PoolReadings, replicas=1, running=1.0, waiting=0.0, prompt_tokens_rate=170.0),
        decode=readings(PoolReadings, replicas=1, running=2.0, waiting=0.0, generation_tokens_rate=80.0, itl_mean=0.02),
    )
    result = next(r for r in diagnose(make_input(spec, telemetry=telemetry, facts=FACTS_8B)) if r.number == 6)
    assert result.patch != {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}
    assert result.patch is None and "ratio not estimated" in result.verdict


@pytest.mark.parametrize(
    ("kind", "spec_patch", "values"),
    [
        # Q2: prefix caching off would be turned on, prefix routing would be set: both already are.
        ("prefix routing", {"router": {"routingPolicy": {"prefill": "prefix-aware"}}}, {"prefix_hits_rate": 600.0}),
        # Q3: variance with maxNumSeqs unset: nothing to raise.
        ("max-num-seqs", {}, {"output_tokens_count_rate": 1.0}),
        # Q5: ITL over the SLO at low batch asks for speculative decoding: it is already on.
        (
            "speculative decoding",
            {"engine": {"speculativeDecoding": {"method": "ngram", "numSpeculativeTokens": 3}}},
            {"itl_p90": 0.2, "running_per_replica": 1.0},
        ),
        # Q4/Q5: more decode replicas when the pool is already at its autoscaling ceiling... raises the ceiling.
        ("more decode replicas", {"autoscaling": {"enabled": True}}, {"itl_p90": 0.2, "running_per_replica": 64.0}),
        # Q6: aggregated traffic that would go disaggregated is already disaggregated.
        ("mode", {"mode": "disaggregated"}, {"ttft_p90": 5.0, "prefill_time_p90": 0.2}),
    ],
)
def test_a_change_already_made_is_not_recommended_again(
    make_spec: SpecFactory, make_input: InputFactory, kind: str, spec_patch: dict[str, Any], values: dict[str, float]
) -> None:
    spec = make_spec(spec_patch)
    base = {
        "request_rate": 2.0,
        "prompt_tokens_rate": 2000.0,
        "generation_tokens_rate": 200.0,
        "prefix_queries_rate": 1000.0,
        "preemptions_rate": 1.0,
        "kv_usage_max": 0.99,
        "waiting_for_capacity": 4.0,
        "itl_p90": 0.01,
        "running_per_replica": 8.0,
        "ttft_p90": 0.2,
        "prefill_time_p90": 0.2,
    }
    telemetry = Telemetry(
        output_tokens_buckets=((4.0, 50.0), (300.0, 50.0), (float("inf"), 100.0)),
        **{name: Reading(value, f"q_{name}") for name, value in {**base, **values}.items()},  # type: ignore[arg-type]
    )
    assert_changes(spec, make_input(spec, telemetry=telemetry, facts=FACTS_8B))


def test_grow_a_pool_patch_is_never_the_current_size(make_spec: SpecFactory, make_input: InputFactory) -> None:
    # A saturated decode pool: the patch grows it (replicas 1 -> n > 1), it never restates replicas: 1.
    spec = make_spec({"prefill": CPU_POOLS, "decode": CPU_POOLS})
    telemetry = Telemetry(
        request_rate=Reading(2.0, "q"),
        prompt_tokens_rate=Reading(1000.0, "q"),
        generation_tokens_rate=Reading(80.0, "q"),
        decode=readings(
            PoolReadings,
            replicas=1,
            running=40.0,
            waiting_for_capacity=10.0,
            generation_tokens_rate=80.0,
            itl_mean=0.05,
        ),
    )
    inp = make_input(spec, telemetry=telemetry, facts=FACTS_8B)
    result = next(r for r in diagnose(inp) if r.number == 6)
    assert result.status == "problem" and result.patch is not None
    assert result.patch["decode"]["replicas"] > 1
    assert_changes(spec, inp)


def test_the_net_drops_a_noop_patch_and_says_so(make_spec: SpecFactory) -> None:
    spec = make_spec({"decode": {"replicas": 2}})
    noop = {"decode": {"replicas": 2}}
    recommend = without_noop_patches(spec, answer(6, "recommend", "v", (), "do it", noop))
    assert (recommend.status, recommend.patch) == ("ok", None) and "already" in recommend.verdict
    problem = without_noop_patches(spec, answer(6, "problem", "v", (), "do it", noop))
    assert problem.status == "problem" and problem.patch is None and "already asks" in problem.recommendation
    # A patch that makes the spec invalid is dropped too; a real change is kept.
    assert without_noop_patches(spec, answer(6, "problem", "v", (), "r", {"decode": {"replicas": -1}})).patch is None
    kept = without_noop_patches(spec, answer(6, "recommend", "v", (), "r", {"decode": {"replicas": 3}}))
    assert kept.patch == {"decode": {"replicas": 3}} and kept.status == "recommend"


# --------------------------------------------------------------------------- the property

SPEC_VARIANTS: list[dict[str, Any]] = [
    {},
    {"mode": "aggregated"},
    {"prefill": CPU_POOLS, "decode": CPU_POOLS},
    {"mode": "aggregated", "decode": CPU_POOLS},
    {"autoscaling": {"enabled": True}},
    {"autoscaling": {"enabled": True, "prefillDecodeRatio": {"min": 0.5, "max": 2.0}}},
    {"prefill": {"replicas": 2}, "decode": {"replicas": 3, "maxReplicas": 4}},
    {"engine": {"speculativeDecoding": {"method": "ngram", "numSpeculativeTokens": 3}}},
    {"engine": {"prefixCaching": False, "maxNumSeqs": 8}},
    {"router": {"routingPolicy": {"prefill": "round-robin", "decode": "round-robin"}}},
    {"mode": "aggregated", "kvTransfer": {"connector": "None"}},
]
rate = st.one_of(st.none(), st.floats(0.0, 5e4, allow_nan=False))
small = st.one_of(st.none(), st.floats(0.0, 200.0, allow_nan=False))
seconds = st.one_of(st.none(), st.floats(0.0, 60.0, allow_nan=False))


def pool_strategy() -> st.SearchStrategy[PoolReadings]:
    return st.builds(
        lambda **v: readings(PoolReadings, **v),
        replicas=st.one_of(st.none(), st.integers(1, 4).map(float)),
        running=small,
        waiting=small,
        waiting_for_capacity=small,
        waiting_growth=st.one_of(st.none(), st.floats(-1.0, 1.0)),
        waiting_floor=small,
        waiting_for_capacity_growth=st.one_of(st.none(), st.floats(-1.0, 1.0)),
        waiting_for_capacity_floor=small,
        prompt_tokens_rate=rate,
        prefix_hits_rate=rate,
        generation_tokens_rate=rate,
        requests_rate=small,
        itl_mean=st.one_of(st.none(), st.floats(0.001, 2.0)),
    )


telemetry_strategy = st.builds(
    lambda prefill, decode, router, **v: dataclasses.replace(
        readings(Telemetry, **v), prefill=prefill, decode=decode, router=router
    ),
    prefill=pool_strategy(),
    decode=pool_strategy(),
    router=st.builds(
        lambda **v: readings(RouterReadings, **v),
        arrival_rate=small,
        completion_rate=small,
        ttft_mean=seconds,
        ttft_p90=seconds,
        ttft_p99=seconds,
        itl_p90=seconds,
        itl_p99=seconds,
        kv_handoff_mean=seconds,
        queue_depth=small,
    ),
    request_rate=small,
    prompt_tokens_rate=rate,
    generation_tokens_rate=rate,
    prefix_hits_rate=rate,
    prefix_queries_rate=rate,
    itl_p90=st.one_of(st.none(), st.floats(0.001, 2.0)),
    itl_p99=st.one_of(st.none(), st.floats(0.001, 5.0)),
    running_per_replica=small,
    ttft_p90=seconds,
    prefill_time_p90=seconds,
    preemptions_rate=small,
    kv_usage_max=st.one_of(st.none(), st.floats(0.0, 1.0)),
    waiting_for_capacity=small,
)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(variant=st.sampled_from(SPEC_VARIANTS), telemetry=telemetry_strategy, gpu=st.sampled_from([None, "H100-80GB"]))
def test_no_question_builds_a_noop_patch(variant: dict[str, Any], telemetry: Telemetry, gpu: str | None) -> None:
    base: dict[str, Any] = {"model": {"name": "m", "source": {"uri": "/nonexistent/model"}}}
    spec = InferenceDeploymentSpec.model_validate({**base, **variant})
    gpus = {
        role: choose_gpu(gpu, pool.node_selector) for role, pool in (("prefill", spec.prefill), ("decode", spec.decode))
    }
    assert_changes(spec, DiagnosisInput(spec, FACTS_8B, gpus, telemetry, "test"))
