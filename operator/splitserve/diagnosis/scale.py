"""Question 6, prefill/decode interference and scale: the saturated pool named, where TTFT goes, the
replicas that bring it back under the target load, and the prefill:decode ratio. Pure.

Capacity comes from capacity.py: observed where a pool is saturated, a datasheet only where one
applies, otherwise unknown (a lower bound sizes nothing).
"""

from __future__ import annotations

import dataclasses
import math

from splitserve.api.spec import MAX_POOL_REPLICAS, InferenceDeploymentSpec, Mode
from splitserve.diagnosis.buckets import CANNOT_TELL, within_one_bucket
from splitserve.diagnosis.capacity import (
    SATURATED_WAITING,
    Offered,
    PoolCapacity,
    TtftBreakdown,
    kv_intake_queue,
    needed_replicas,
    offered_load,
    pool_capacity,
    roles_in_use,
    server_backlog,
    ttft_breakdown,
)
from splitserve.diagnosis.findings import (
    DiagnosisInput,
    Evidence,
    Patch,
    QuestionResult,
    Tail,
    answer,
    bucket_evidence,
    fmt_value,
    judged,
    merge_patches,
    pct,
    prom_source,
)
from splitserve.diagnosis.telemetry import Telemetry

TTFT_INFLATION = 2.0  # TTFT p90 / prefill time p90 above this: prompts wait behind other work
CAPACITY_HEADROOM = 0.7  # plan replicas to run at 70% of their capacity
RATIO_MISMATCH = 1.5  # current vs needed prefill:decode ratio off by more than this factor
MIN_REQUEST_RATE = 0.01  # requests/s below which the window is "no traffic"
BACKLOG = 1.2  # arrivals above completions by this factor: a backlog builds somewhere
TAIL_OVER_SLO = 2.0  # a p99 above this multiple of the SLO is a finding even when the p90 holds
ADMISSION_WORDS = (
    "or limit admission so queued requests wait in the router instead of holding decode slots: the router's "
    "--max-inflight-per-worker (not in the InferenceDeployment spec; set it on the router's arguments)"
)


def capacities(inp: DiagnosisInput, offered: Offered) -> dict[str, PoolCapacity]:
    context = offered.mean_prompt + offered.mean_output / 2
    return {role: pool_capacity(inp, role, context) for role in ("prefill", "decode")}


def traffic_needs(inp: DiagnosisInput) -> tuple[float, float] | None:
    """(prefill, decode) replicas the observed traffic needs at the planning headroom; None unless both pools'
    capacities are estimated (observed saturated, or a datasheet that applies), never from a lower bound."""
    tel = inp.telemetry
    if tel is None:
        return None
    offered = offered_load(tel)
    if offered is None or offered.requests_rate < MIN_REQUEST_RATE:
        return None
    caps = capacities(inp, offered)
    prefill = needed_replicas(caps["prefill"], offered.prefill_tokens, CAPACITY_HEADROOM)
    decode = needed_replicas(caps["decode"], offered.decode_tokens, CAPACITY_HEADROOM)
    if prefill is None or decode is None:
        return None
    return prefill, decode


def whole_replicas(needed: float) -> int:
    """Replicas to ask for, rounded up; a need beyond any pool (a capacity near zero makes it infinite)
    comes out as one more than a pool may have, so callers clamp it and can say the load needs more."""
    if not math.isfinite(needed) or needed > MAX_POOL_REPLICAS:
        return MAX_POOL_REPLICAS + 1
    return math.ceil(needed)


def ratio_patch(spec: InferenceDeploymentSpec, prefill: float, decode: float) -> Patch:
    prefill_replicas = min(MAX_POOL_REPLICAS, max(1, whole_replicas(prefill)))
    decode_replicas = min(MAX_POOL_REPLICAS, max(1, whole_replicas(decode)))
    if spec.autoscaling.enabled:
        ratio = prefill_replicas / decode_replicas
        bounds = spec.autoscaling.prefill_decode_ratio
        if bounds is None or bounds.min <= ratio <= bounds.max:
            return {}
        return {"autoscaling": {"prefillDecodeRatio": {"min": min(bounds.min, ratio), "max": max(bounds.max, ratio)}}}
    patch: Patch = {}
    for name, replicas, pool in (("prefill", prefill_replicas, spec.prefill), ("decode", decode_replicas, spec.decode)):
        if replicas == pool.replicas:
            continue  # no change asked of this pool
        entry: dict[str, int] = {"replicas": replicas}
        if replicas > pool.max_replicas:
            entry["maxReplicas"] = replicas
        patch[name] = entry
    return patch


def grow_pool(spec: InferenceDeploymentSpec, role: str, replicas: int) -> tuple[str, Patch]:
    """The change that lets `role` run `replicas` (at least one more than now)."""
    pool = spec.prefill if role == "prefill" else spec.decode
    if spec.autoscaling.enabled:
        if replicas <= pool.max_replicas:
            return (
                f"the autoscaler may already grow {role} to {replicas} (maxReplicas {pool.max_replicas}): "
                f"lower its {role} targets in spec.autoscaling.{role} so it scales before the queue builds",
                {},
            )
        return f"raise {role}.maxReplicas {pool.max_replicas} -> {replicas}", {role: {"maxReplicas": replicas}}
    entry: dict[str, int] = {"replicas": replicas}
    if replicas > pool.max_replicas:
        entry["maxReplicas"] = replicas
    return f"{role} replicas {pool.replicas} -> {replicas}", {role: entry}


def _serving_text(spec: InferenceDeploymentSpec) -> str:
    if spec.mode is Mode.AGGREGATED:
        plural = "s" if spec.decode.replicas != 1 else ""
        return f"mode {spec.mode}, {spec.decode.replicas} replica{plural} (decode pool)"
    return f"mode {spec.mode}, {spec.prefill.replicas} prefill / {spec.decode.replicas} decode replicas"


def _capacity_evidence(caps: dict[str, PoolCapacity], roles: tuple[str, ...]) -> list[Evidence]:
    out = []
    for role in roles:
        cap = caps[role]
        unit = cap.load.unit if cap.load else ""
        figure = "unknown" if cap.per_replica is None else f"{cap.per_replica:,.0f} {unit}"
        prefix = "at least " if cap.basis == "lower bound" else ""
        out.append(Evidence(f"{role} capacity per replica: {prefix}{figure} ({cap.basis})", cap.source))
    return out


def _where_time_goes(tel: Telemetry, breakdown: TtftBreakdown | None, caps: dict[str, PoolCapacity]) -> str:
    if breakdown is None:
        return ""
    largest = breakdown.largest
    text = f"{largest.name} takes {pct(breakdown.share(largest))} of TTFT ({breakdown.text()})"
    if largest.name == "KV handoff":
        transfer = tel.kv_transfer_mean.value
        if transfer is not None and not math.isnan(transfer):
            text += f"; the KV transfer itself takes {transfer * 1000:.0f} ms"
        load = caps["decode"].load
        intake = kv_intake_queue(load, transfer) if load is not None else None
        if intake is not None and intake >= SATURATED_WAITING:
            text += (
                f"; {intake:.1f} requests on average wait in decode for their KV beyond that: decode's KV intake queues"
            )
        held = server_backlog(load, tel.router.decode_inflight.value) if load is not None else None
        if held is not None and held >= 1:
            text += (
                f"; {held:.1f} of the {tel.router.decode_inflight.value:.1f} requests in flight at decode are not in "
                "its engine yet: decode's server takes them in slower than they come"
            )
        if load is not None and load.decoding is not None and load.stalled >= 1:
            text += (
                f"; {load.stalled:.1f} of decode's {load.running:.1f} running requests produce no token: "
                "the time goes into decode's KV intake"
            )
    return text


def saturation(
    inp: DiagnosisInput,
    tel: Telemetry,
    offered: Offered,
    caps: dict[str, PoolCapacity],
    evidence: list[Evidence],
    breakdown: TtftBreakdown | None,
) -> QuestionResult | None:
    """The saturated pool(s) named, with the replicas that serve the offered load at the planning headroom."""
    roles = roles_in_use(inp)
    saturated = [caps[role] for role in roles if _saturated(caps[role])]
    if not saturated:
        return None
    spec = inp.spec
    changes: list[str] = []
    patches: list[Patch] = []
    for cap in saturated:
        tokens = offered.prefill_tokens if cap.role == "prefill" else offered.decode_tokens
        pool = spec.prefill if cap.role == "prefill" else spec.decode
        needed = needed_replicas(cap, tokens, CAPACITY_HEADROOM)
        wanted = max(pool.replicas + 1, whole_replicas(needed) if needed is not None else 0)
        replicas = min(wanted, MAX_POOL_REPLICAS)
        change, patch = grow_pool(spec, cap.role, replicas)
        if wanted > replicas:
            change += " (the most a pool may have; the load needs more)"
        if needed is not None:
            change += (
                f" (offered {tokens:,.0f} {cap.load.unit if cap.load else ''} at {pct(CAPACITY_HEADROOM)} of "
                f"{cap.per_replica or 0:,.0f} per replica needs {needed:.1f})"
            )
        changes.append(change)
        patches.append(patch)
    where = _where_time_goes(tel, breakdown, caps)
    names = " and ".join(cap.role for cap in saturated)
    if len(saturated) == len(roles) and len(roles) > 1:
        head = (
            f"overload: offered {offered.requests_rate:.2f} req/s is above the capacity of every pool "
            f"({names} saturated)"
        )
    else:
        head = f"{names} pool saturated"
    verdict = head + (f": {where}" if where else "")
    words = ["; ".join(changes)]
    if any(cap.role == "decode" for cap in saturated) and spec.mode is Mode.DISAGGREGATED:
        words.append(ADMISSION_WORDS)
    words.append("each added replica needs its own machine's CPUs or GPUs: check the cluster has them")
    return answer(6, "problem", verdict, tuple(evidence), "; ".join(words), merge_patches(*patches))


def _saturated(cap: PoolCapacity) -> bool:
    return cap.load is not None and cap.load.saturated


def backlog(offered: Offered, tel: Telemetry, evidence: list[Evidence]) -> QuestionResult | None:
    """More arriving than finishing with no pool saturated: the limit is outside the pools."""
    completed = tel.router.completion_rate.value
    queue = tel.router.queue_depth.value or 0.0
    if completed is None or offered.requests_rate <= completed * BACKLOG or queue < 1:
        return None
    return answer(
        6,
        "problem",
        f"overload with no pool to blame: {offered.requests_rate:.2f} req/s arrive, {completed:.2f} finish, "
        f"{queue:.1f} wait in the router, and no pool's engines are saturated",
        tuple(evidence),
        "the router's admission (max in-flight per worker) or the router itself limits: give the router more "
        "replicas (router.replicas) or let more requests reach each worker",
    )


def disaggregation(inp: DiagnosisInput) -> QuestionResult:
    spec, tel = inp.spec, inp.telemetry
    evidence = [Evidence(_serving_text(spec), "spec")]
    if tel is None:
        return answer(6, "unknown", inp.no_telemetry(f"traffic unknown; serving {spec.mode}"), tuple(evidence))
    rate, prompt_rate, gen_rate = tel.request_rate, tel.prompt_tokens_rate, tel.generation_tokens_rate
    ttft, prefill_time = tel.ttft_p90, tel.prefill_time_p90
    evidence += [
        Evidence(f"requests {fmt_value(rate.value)}/s", prom_source(rate)),
        Evidence(f"prompt tokens {fmt_value(prompt_rate.value)}/s", prom_source(prompt_rate)),
        Evidence(f"generated tokens {fmt_value(gen_rate.value)}/s", prom_source(gen_rate)),
        Evidence(f"TTFT p90 {fmt_value(ttft.value)} s (engines)", prom_source(ttft)),
        Evidence(f"prefill time p90 {fmt_value(prefill_time.value)} s", prom_source(prefill_time)),
    ]
    offered = offered_load(tel)
    if offered is None or offered.requests_rate < MIN_REQUEST_RATE:
        return answer(6, "unknown", "no traffic in the window", tuple(evidence))
    inflation = ttft.value / prefill_time.value if ttft.value and prefill_time.value else None
    evidence.append(
        Evidence(
            f"mean prompt {offered.mean_prompt:.0f} tokens, mean output {offered.mean_output:.0f} tokens, "
            f"TTFT inflation {fmt_value(inflation, '{:.1f}x')}",
            "derived",
        )
    )
    router = tel.router
    slo = spec.autoscaling.prefill.ttft_slo_seconds
    if router.ttft_p90.known:
        evidence.append(
            Evidence(
                f"TTFT at the router (as clients see it) p90 {fmt_value(router.ttft_p90.value)} s, "
                f"p99 {fmt_value(router.ttft_p99.value)} s; SLO {slo:g} s",
                f"{prom_source(router.ttft_p90)}; spec (autoscaling.prefill.ttftSloSeconds)",
            )
        )
    breakdown = ttft_breakdown(tel)
    if breakdown is not None:
        evidence.append(Evidence(breakdown.text(), "derived from the router's ttft, queue_wait, prefill, kv_handoff"))
    caps = capacities(inp, offered)
    evidence += _capacity_evidence(caps, roles_in_use(inp))
    for role in roles_in_use(inp):
        load = caps[role].load
        if load is not None:
            decoding = f", {load.decoding:.1f} producing tokens" if load.decoding is not None else ""
            evidence.append(
                Evidence(
                    f"{role}: {load.replicas:.0f} replica(s), {load.running:.1f} running{decoding}, "
                    f"{load.waiting:.1f} waiting for a slot, {load.deferred:.1f} deferred (KV pulls) (window "
                    f"averages), queue growth {load.growth:+.2f}/s",
                    prom_source(tel.pool(role).running),
                )
            )
    long_prompts = offered.mean_prompt >= max(1, spec.router.disaggregation_threshold_tokens)
    interfering = inflation is not None and inflation >= TTFT_INFLATION
    # Aggregated with prompts held up behind decode work: separating the two is the change that
    # helps, however busy the pool (saturation is then part of the same story).
    if not (spec.mode is Mode.AGGREGATED and interfering and long_prompts):
        found = saturation(inp, tel, offered, caps, evidence, breakdown) or backlog(offered, tel, evidence)
        if found is not None:
            return found
    tail = _ttft_tail(tel, slo, breakdown, caps)
    evidence += tail.evidence if tail is not None else ()
    prefill_need = needed_replicas(caps["prefill"], offered.prefill_tokens, CAPACITY_HEADROOM)
    decode_need = needed_replicas(caps["decode"], offered.decode_tokens, CAPACITY_HEADROOM)
    needs = None if prefill_need is None or decode_need is None else (prefill_need, decode_need)
    if needs is not None:
        evidence.append(
            Evidence(
                f"needed at {pct(CAPACITY_HEADROOM)} load: {needs[0]:.2f} prefill, {needs[1]:.2f} decode replicas",
                "derived from the capacities above",
            )
        )
    if spec.mode is Mode.AGGREGATED:
        busy = needs is None or needs[0] + needs[1] >= 1.0
        if interfering and long_prompts and busy:
            patch: Patch = {"mode": Mode.DISAGGREGATED.value}
            if spec.kv_transfer.connector.value == "None":
                patch["kvTransfer"] = {"connector": "NixlConnector"}
            if needs is not None:
                patch = merge_patches(patch, ratio_patch(spec, needs[0], needs[1])) or patch
            return answer(
                6,
                "recommend",
                f"prefill/decode interference: TTFT p90 is {inflation:.1f}x the prefill time with "
                f"{offered.mean_prompt:.0f}-token prompts",
                tuple(evidence),
                "disaggregate: prefill and decode in separate pools, scaled independently",
                patch,
            )
        if tail is not None and tail.status == "problem":
            return answer(6, "problem", tail.verdict, tuple(evidence), tail.recommendation)
        enough = answer(
            6,
            "ok",
            f"aggregated is enough (TTFT inflation {fmt_value(inflation, '{:.1f}x')}, "
            f"mean prompt {offered.mean_prompt:.0f} tokens)",
            tuple(evidence),
        )
        return _settled(enough, tail)
    if needs is not None and needs[0] + needs[1] < 1.0 and not interfering:
        return answer(
            6,
            "recommend",
            f"traffic fits one aggregated replica ({needs[0] + needs[1]:.2f} replicas of work): "
            "disaggregation only adds a KV hop and idle GPUs",
            tuple(evidence),
            "serve aggregated until traffic grows",
            {"mode": Mode.AGGREGATED.value},
        )
    if tail is not None and tail.status == "problem":
        return answer(6, "problem", tail.verdict, tuple(evidence), tail.recommendation)
    if needs is None:
        unknown = [role for role in ("prefill", "decode") if not caps[role].estimated]
        unmeasured = answer(
            6,
            "ok",
            f"disaggregated, no pool saturated; prefill:decode ratio not estimated ({' and '.join(unknown)} "
            "capacity not measurable below saturation)",
            tuple(evidence),
        )
        return _settled(unmeasured, tail)
    return _settled(_ratio(inp, needs, evidence), tail)


def _ttft_tail(
    tel: Telemetry, slo: float, breakdown: TtftBreakdown | None, caps: dict[str, PoolCapacity]
) -> Tail | None:
    """The TTFT clients see against the SLO while no pool is saturated: a p90 over it, or a p99 over twice it,
    is a problem; a quantile whose histogram bucket also holds its limit cannot be told either way."""
    router = tel.router
    p90, p99 = judged(router.ttft_p90, slo), judged(router.ttft_p99, slo * TAIL_OVER_SLO)
    limits = {"p90": f"the {slo:g} s SLO", "p99": f"{TAIL_OVER_SLO:g}x the {slo:g} s SLO"}
    unsure = {name: found for name, found in (("p90", p90), ("p99", p99)) if found is not None and found.unsure}
    quantiles = {name: f"TTFT {name} ≈ {fmt_value(found.value)} s at the router" for name, found in unsure.items()}
    clauses = {name: within_one_bucket(quantiles[name], limits[name], found, "s") for name, found in unsure.items()}
    evidence = tuple(bucket_evidence(quantiles[name], limits[name], found, "s", tel) for name, found in unsure.items())
    where = _where_time_goes(tel, breakdown, caps)
    if p90 is not None and p90.over:
        head = f"TTFT p90 {p90.value:.2f} s at the router is over the {slo:g} s SLO"
    elif p99 is not None and p99.over:
        held = f"TTFT p90 {fmt_value(router.ttft_p90.value)} s holds the {slo:g} s SLO"
        if "p90" in clauses:
            held = clauses["p90"] + ","
        head = f"{held} but p99 {p99.value:.2f} s is {p99.value / slo:.1f}x it"
    elif clauses:
        verdict = ", and ".join(clauses.values()) + f": {CANNOT_TELL}" + (f"; {where}" if where else "")
        return Tail("unknown", verdict, evidence)
    else:
        return None
    advice = (
        "no pool is saturated over the window, so the tail comes from bursts: scale on a lower queue target "
        "(spec.autoscaling) or give the pool that takes the time one more replica"
    )
    return Tail("problem", head + (f": {where}" if where else ""), evidence, advice)


def _settled(result: QuestionResult, tail: Tail | None) -> QuestionResult:
    """Nothing to change stands only while the TTFT clients see is known to meet the SLO: with a quantile in the
    same histogram bucket as its limit, the answer is that the histogram cannot tell (never a problem)."""
    if tail is None or result.status != "ok":
        return result
    return dataclasses.replace(result, status=tail.status, verdict=tail.verdict)


def _ratio(inp: DiagnosisInput, needs: tuple[float, float], evidence: list[Evidence]) -> QuestionResult:
    spec = inp.spec
    needed_ratio = needs[0] / needs[1] if needs[1] > 0 else math.inf
    if spec.autoscaling.enabled:
        bounds_patch = ratio_patch(spec, needs[0], needs[1])
        if not bounds_patch:
            return answer(
                6,
                "ok",
                f"disaggregated; the autoscaler sets the pools (needed prefill:decode {needed_ratio:.2f})",
                tuple(evidence),
            )
        return answer(
            6,
            "recommend",
            f"needed prefill:decode ratio {needed_ratio:.2f} lies outside autoscaling.prefillDecodeRatio",
            tuple(evidence),
            "widen the autoscaler's prefill:decode ratio bounds",
            bounds_patch,
        )
    current_ratio = spec.prefill.replicas / spec.decode.replicas if spec.decode.replicas else math.inf
    evidence.append(Evidence(f"prefill:decode needed {needed_ratio:.2f}, current {current_ratio:.2f}", "derived"))
    off = max(needed_ratio, current_ratio) / max(min(needed_ratio, current_ratio), 1e-9)
    patch = ratio_patch(spec, needs[0], needs[1])
    if off <= RATIO_MISMATCH or not patch:
        # Whole replicas cannot come closer than this (one of each is the least a disaggregated pair runs).
        return answer(
            6,
            "ok",
            f"disaggregated with a fitting prefill:decode ratio ({current_ratio:.2f}, needed {needed_ratio:.2f}"
            + ("" if patch else "; whole replicas come no closer")
            + ")",
            tuple(evidence),
        )
    return answer(
        6,
        "recommend",
        f"prefill:decode ratio {current_ratio:.2f} but traffic needs {needed_ratio:.2f}",
        tuple(evidence),
        "rebalance the pools to the traffic's prefill:decode ratio",
        patch,
    )
