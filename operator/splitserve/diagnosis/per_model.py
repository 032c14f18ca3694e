"""Question 2 per model name (the base model and its LoRA adapters), from the router's per-model series.

vLLM counts its prefix cache over all requests together, whatever adapter computed a block, so the
pool-wide share cannot tell one adapter from another. The router counts, per model name a client sent,
the prompt tokens and how many of them the worker it chose already held in its prefix cache (precise-
prefix: the engines' KV events; prefix-aware: its table of where it sent each prefix). When more than
one model name carries traffic, question 2 lists each with its request rate and hit share, and names a
adapter whose share is far from the other models'. With one model name the answer is the pool-wide one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from splitserve.api.spec import Mode, RoutingPolicy
from splitserve.diagnosis.findings import DiagnosisInput, Evidence, Patch, QuestionResult, fmt_value, pct
from splitserve.diagnosis.telemetry import ModelReadings, Telemetry, window_seconds

# A model's share is far from the other models' when it is at most half of theirs (or at least twice)
# and at least 20 points away: 4% against 8% is noise, 10% against 60% is not.
FAR_SHARE_RATIO = 2.0
FAR_SHARE_POINTS = 0.20
# Requests of a model in the window before its share is compared: a few requests say nothing.
MIN_COMPARED_REQUESTS = 10.0


@dataclass(frozen=True)
class FarShare:
    """A model whose prefix-hit share is far from the share of every other model's traffic together."""

    model: ModelReadings
    share: float
    others: float

    @property
    def low(self) -> bool:
        return self.share < self.others


def carrying_traffic(tel: Telemetry) -> list[ModelReadings]:
    return [model for model in tel.models if (model.requests_rate.value or 0.0) > 0]


def model_label(model: str, base: str) -> str:
    return f"base model {model}" if model == base else f"adapter {model}"


def model_evidence(model: ModelReadings, base: str, policy: RoutingPolicy) -> Evidence:
    """One model name's request rate and prefix-hit share, with the queries they came from."""
    requests, prompts, hits = model.requests_rate, model.prompt_tokens_rate, model.prefix_hit_tokens_rate
    share = model.prefix_hit_share
    label = model_label(model.model, base)
    if share is None:
        text = (
            f"{label}: {fmt_value(requests.value)} requests/s, {fmt_value(prompts.value)} prompt tokens/s, "
            f"prefix hits not counted (the router counts them under prefix-aware and precise-prefix)"
        )
        return Evidence(text, f"prometheus: {requests.query}; {prompts.query}")
    looked_up = model.prefix_lookup_tokens_rate
    view = "its KV-event index" if policy is RoutingPolicy.PRECISE_PREFIX else "its prefix table"
    text = (
        f"{label}: {fmt_value(requests.value)} requests/s, {pct(share)} of its {fmt_value(looked_up.value)} "
        f"looked-up prompt tokens/s held by the worker the router chose ({view})"
    )
    return Evidence(text, f"prometheus: {requests.query}; {hits.query} / {looked_up.query}")


def far_shares(models: Sequence[ModelReadings], window: str, base: str) -> list[FarShare]:
    """The adapters whose share is far from the other models' together (the low ones when any, else the
    high ones). The base model is the reference, never named itself: with one adapter beside it, the two
    shares are far from each other and the adapter is the one that differs."""
    seconds = window_seconds(window)

    def sampled(model: ModelReadings) -> bool:
        requests = model.requests_rate.value or 0.0
        return model.prefix_hit_share is not None and (seconds is None or requests * seconds >= MIN_COMPARED_REQUESTS)

    counted = [model for model in models if sampled(model)]
    found: list[FarShare] = []
    for model in counted:
        share = model.prefix_hit_share
        others = [other for other in counted if other is not model]
        looked_up = sum(other.prefix_lookup_tokens_rate.value or 0.0 for other in others)
        if model.model == base or share is None or not looked_up:
            continue
        rest = sum(other.prefix_hit_tokens_rate.value or 0.0 for other in others) / looked_up
        low = share * FAR_SHARE_RATIO <= rest and rest - share >= FAR_SHARE_POINTS
        high = share >= rest * FAR_SHARE_RATIO and share - rest >= FAR_SHARE_POINTS
        if low or high:
            found.append(FarShare(model, share, rest))
    lows = [far for far in found if far.low]
    return lows or found


def _far_text(far: FarShare, base: str) -> str:
    return (
        f"{model_label(far.model.model, base)}: {pct(far.share)} of its prompt tokens found cached, "
        f"the other models {pct(far.others)}"
    )


def _low_advice(
    inp: DiagnosisInput, lows: Sequence[FarShare], policy: RoutingPolicy, policy_field: str
) -> tuple[str, Patch | None]:
    """What to do about adapters whose prompts find their prefix cached far less often than the others'."""
    tel = inp.telemetry
    assert tel is not None
    names = " and ".join(model_label(far.model.model, inp.spec.model.name) for far in lows)
    its = "its" if len(lows) == 1 else "their"
    usage, target = tel.kv_usage_max.value, inp.spec.autoscaling.decode.kv_cache_usage
    patch: Patch | None = None
    if usage is not None and usage >= target:
        action = "make KV room (question 4)"
        why = (
            f"the busiest worker's KV cache is {pct(usage)} full, and blocks computed under an adapter serve that "
            f"adapter alone, so {its} prefixes are evicted between {its} requests"
        )
    elif policy is RoutingPolicy.PREFIX_AWARE:
        action = "route by precise-prefix"
        why = (
            f"{its} requests reach workers that do not hold {its} prefix; prefix-aware routes on this router's "
            "memory of where it sent each prompt, blind to evictions and to other router replicas, where "
            "precise-prefix follows the blocks each engine reports, keyed by adapter as vLLM hashes them"
        )
        patch = {"router": {"routingPolicy": {policy_field: RoutingPolicy.PRECISE_PREFIX.value}}}
    elif policy is RoutingPolicy.PRECISE_PREFIX:
        pool = "prefill" if inp.spec.mode is Mode.DISAGGREGATED else "decode"
        action = f"add {pool} replicas if that pool is saturated (question 6)"
        why = (
            f"precise-prefix already routes on the engines' own blocks, so {its} requests pass the workers holding "
            f"{its} prefix for the load bound, or for workers where the adapter is already active"
        )
    else:
        action = "route by prefix"
        why = f"{policy} sends prompts to workers whatever they hold"
        patch = {"router": {"routingPolicy": {policy_field: RoutingPolicy.PREFIX_AWARE.value}}}
    advice = (
        f"{action} if the prompts of {names} repeat (a shared system prompt or preamble): {why}; "
        "if they do not repeat, a low share is expected and nothing needs to change"
    )
    return advice, patch


def per_model(inp: DiagnosisInput, overall: QuestionResult, policy: RoutingPolicy, policy_field: str) -> QuestionResult:
    """Question 2's pool-wide answer, with each model name's evidence when more than one carries traffic."""
    tel = inp.telemetry
    if tel is None:
        return overall
    models = carrying_traffic(tel)
    if len(models) < 2:
        return overall
    base = inp.spec.model.name
    evidence = (*overall.evidence, *(model_evidence(model, base, policy) for model in models))
    far = far_shares(models, tel.window, base)
    if not far:
        return dataclasses.replace(overall, evidence=evidence)
    verdict = f"{overall.verdict}; by model, " + ", ".join(_far_text(one, base) for one in far)
    lows = [one for one in far if one.low]
    if not lows:
        return dataclasses.replace(overall, verdict=verdict, evidence=evidence)
    advice, patch = _low_advice(inp, lows, policy, policy_field)
    if overall.recommendation:
        advice = f"{overall.recommendation}; {advice}"
    status = overall.status if overall.status == "problem" else "recommend"
    return dataclasses.replace(
        overall,
        status=status,
        verdict=verdict,
        evidence=evidence,
        recommendation=advice,
        patch=overall.patch or patch,
    )
