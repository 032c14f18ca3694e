"""Question 2 per model name (base model and LoRA adapters), from the router's per-model series."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from splitserve.diagnosis.per_model import far_shares
from splitserve.diagnosis.questions import prompt_redundancy
from splitserve.diagnosis.telemetry import ModelReadings, Reading, Telemetry, TelemetryScope, collect
from tests.diagnosis.conftest import FakePrometheus, InputFactory, SpecFactory, patched
from tests.diagnosis.test_telemetry_questions import FACTS_8B


def model(name: str, requests: float, prompts: float, hits: float | None) -> ModelReadings:
    return ModelReadings(
        name,
        Reading(requests, f"q_requests_{name}"),
        Reading(prompts, f"q_prompts_{name}"),
        Reading(hits, f"q_hits_{name}"),
        Reading(None if hits is None else prompts, f"q_lookups_{name}"),
    )


def tel(*models: ModelReadings, kv_usage: float = 0.5, window: str = "5m") -> Telemetry:
    """60% of prompt tokens hit the prefix cache pool-wide (vLLM's counters, every model together)."""
    return Telemetry(
        window=window,
        prefix_hits_rate=Reading(600.0, "q_hits"),
        prefix_queries_rate=Reading(1000.0, "q_queries"),
        kv_usage_max=Reading(kv_usage, "q_kv"),
        models=models,
    )


BASE = model("m", 8.0, 800.0, 520.0)  # 65%, the spec's model name (make_spec's "m")


def test_only_the_base_model_leaves_the_answer_as_it_was(make_spec: SpecFactory, make_input: InputFactory) -> None:
    spec = make_spec()
    alone = prompt_redundancy(make_input(spec, telemetry=tel(BASE), facts=FACTS_8B))
    unread = prompt_redundancy(make_input(spec, telemetry=tel(), facts=FACTS_8B))
    assert alone == unread
    assert alone.status == "ok" and alone.verdict.startswith("prefix caching pays: 60%")


def test_an_adapter_without_traffic_leaves_the_answer_as_it_was(
    make_spec: SpecFactory, make_input: InputFactory
) -> None:
    spec = make_spec()
    idle = prompt_redundancy(make_input(spec, telemetry=tel(BASE, model("a", 0.0, 0.0, 0.0)), facts=FACTS_8B))
    assert idle == prompt_redundancy(make_input(spec, telemetry=tel(), facts=FACTS_8B))


def test_each_model_carrying_traffic_gets_its_evidence_line(make_spec: SpecFactory, make_input: InputFactory) -> None:
    telemetry = tel(BASE, model("a", 2.0, 200.0, 110.0))  # 55%: near the base model's 65%
    result = prompt_redundancy(make_input(make_spec(), telemetry=telemetry, facts=FACTS_8B))
    assert (result.status, result.patch) == ("ok", None)
    assert "by model" not in result.verdict
    lines = {e.text.split(":")[0]: e for e in result.evidence if e.text.startswith(("base model", "adapter"))}
    assert list(lines) == ["base model m", "adapter a"]
    assert lines["adapter a"].text == (
        "adapter a: 2 requests/s, 55% of its 200 looked-up prompt tokens/s held by the worker the router chose "
        "(its prefix table)"
    )
    assert lines["adapter a"].source == "prometheus: q_requests_a; q_hits_a / q_lookups_a"


def test_an_adapter_whose_prompts_miss_the_cache_is_named_with_advice(
    make_spec: SpecFactory, make_input: InputFactory
) -> None:
    """Requests for adapter b scatter (5% found cached against 65%): under prefix-aware, route precisely."""
    spec = make_spec()
    telemetry = tel(BASE, model("b", 1.0, 400.0, 20.0))
    result = prompt_redundancy(make_input(spec, telemetry=telemetry, facts=FACTS_8B))
    assert result.status == "recommend"
    assert result.verdict.endswith(
        "; by model, adapter b: 5% of its prompt tokens found cached, the other models 65%"
    ), result.verdict
    assert result.recommendation.startswith("route by precise-prefix if the prompts of adapter b repeat")
    assert result.patch == {"router": {"routingPolicy": {"prefill": "precise-prefix"}}}
    patched(spec, result.patch)  # the patch keeps the spec valid


@pytest.mark.parametrize(
    ("spec_patch", "kv_usage", "advice", "patch"),
    [
        # A full KV cache evicts a less-used adapter's blocks (they serve no other model): question 4's remedy.
        ({}, 0.95, "KV cache is 95% full", None),
        # precise-prefix already follows the engines' blocks: the load bound or adapter affinity sends them away.
        (
            {"router": {"routingPolicy": {"prefill": "precise-prefix"}}},
            0.5,
            "add prefill replicas if that pool is saturated (question 6)",
            None,
        ),
        # Aggregated mode routes prompts by the decode policy.
        (
            {"mode": "aggregated", "router": {"routingPolicy": {"decode": "prefix-aware"}}},
            0.5,
            "precise-prefix follows the blocks each engine reports",
            {"router": {"routingPolicy": {"decode": "precise-prefix"}}},
        ),
    ],
)
def test_the_advice_follows_what_keeps_prefixes_from_the_requests(
    make_spec: SpecFactory,
    make_input: InputFactory,
    spec_patch: dict[str, Any],
    kv_usage: float,
    advice: str,
    patch: dict[str, Any] | None,
) -> None:
    telemetry = tel(BASE, model("b", 1.0, 400.0, 20.0), kv_usage=kv_usage)
    result = prompt_redundancy(make_input(make_spec(spec_patch), telemetry=telemetry, facts=FACTS_8B))
    assert result.status == "recommend" and advice in result.recommendation, result.recommendation
    assert result.patch == patch


def test_an_adapter_whose_prompts_repeat_more_is_noted_without_advice(
    make_spec: SpecFactory, make_input: InputFactory
) -> None:
    telemetry = tel(model("m", 8.0, 800.0, 80.0), model("a", 2.0, 200.0, 180.0))  # 10% and 90%
    result = prompt_redundancy(make_input(make_spec(), telemetry=telemetry, facts=FACTS_8B))
    assert (result.status, result.recommendation, result.patch) == ("ok", "", None)
    assert result.verdict.endswith("; by model, adapter a: 90% of its prompt tokens found cached, the other models 10%")


def test_every_adapter_far_below_the_others_is_named(make_spec: SpecFactory, make_input: InputFactory) -> None:
    telemetry = tel(BASE, model("a", 1.0, 300.0, 15.0), model("b", 1.0, 300.0, 9.0), model("c", 1.0, 300.0, 180.0))
    result = prompt_redundancy(make_input(make_spec(), telemetry=telemetry, facts=FACTS_8B))
    assert "adapter a: 5% of its prompt tokens found cached, the other models 51%" in result.verdict
    assert "adapter b: 3% of its" in result.verdict and "adapter c" not in result.verdict
    assert "if the prompts of adapter a and adapter b repeat" in result.recommendation


def test_a_few_requests_are_not_compared() -> None:
    """0.02 requests/s over 5 minutes is 6 requests: not enough to say its prompts scatter."""
    assert far_shares([BASE, model("b", 0.02, 8.0, 0.0)], "5m", "m") == []
    assert [far.model.model for far in far_shares([BASE, model("b", 0.04, 16.0, 0.0)], "5m", "m")] == ["b"]


def test_hits_not_counted_under_round_robin_say_so(make_spec: SpecFactory, make_input: InputFactory) -> None:
    spec = make_spec({"router": {"routingPolicy": {"prefill": "round-robin"}}})
    telemetry = tel(model("m", 8.0, 800.0, None), model("a", 2.0, 200.0, None))
    result = prompt_redundancy(make_input(spec, telemetry=telemetry, facts=FACTS_8B))
    assert result.patch == {"router": {"routingPolicy": {"prefill": "prefix-aware"}}}  # the pool-wide answer
    assert any(
        e.text.startswith("adapter a: 2 requests/s, 200 prompt tokens/s, prefix hits not counted")
        for e in result.evidence
    )


def test_prefix_caching_off_is_answered_pool_wide(make_spec: SpecFactory, make_input: InputFactory) -> None:
    spec = make_spec({"engine": {"prefixCaching": False}})
    telemetry = tel(BASE, model("b", 1.0, 400.0, 20.0))
    result = prompt_redundancy(make_input(spec, telemetry=telemetry, facts=FACTS_8B))
    assert result.patch == {"engine": {"prefixCaching": True}}
    assert not any(e.text.startswith("adapter") for e in result.evidence)


async def test_collect_reads_each_model_name(fake_prometheus: Callable[..., FakePrometheus]) -> None:
    def by_model(**values: float) -> dict[frozenset[tuple[str, str]], float]:
        return {frozenset({("model", name.replace("_", "-"))}): value for name, value in values.items()}

    prom = fake_prometheus(
        vectors={
            "model_requests_total": {**by_model(m=8.0, lora_b=1.0), frozenset({("model", "")}): 3.0},
            "model_prompt_tokens_total": by_model(m=800.0, lora_b=400.0),
            "model_prefix_hit_tokens_total": by_model(m=520.0, lora_b=20.0),
            "model_prefix_lookup_tokens_total": by_model(m=800.0, lora_b=400.0),
        }
    )
    telemetry = await collect(prom, TelemetryScope('namespace="ml"', 'namespace="ml",deployment="chat"', "5m"))
    assert [(m.model, m.requests_rate.value, m.prefix_hit_share) for m in telemetry.models] == [
        ("m", 8.0, 0.65),
        ("lora-b", 1.0, 0.05),
    ]  # "" (names no worker serves) is nobody's traffic
    assert telemetry.models[1].prefix_hit_tokens_rate.query == (
        'sum(rate(splitserve_router_model_prefix_hit_tokens_total{namespace="ml",deployment="chat",'
        'model="lora-b"}[5m]))'
    )
    assert 'sum by (model) (rate(splitserve_router_model_requests_total{namespace="ml",deployment="chat"}[5m]))' in (
        prom.queries
    )
