"""The six-question diagnosis, as pure functions of a `DiagnosisInput`.

Each question returns a `QuestionResult`: a verdict, the evidence (every number with where it came
from: "spec", "model config", "prometheus: <query>"), a recommendation and, when there is something
to change, a JSON merge patch (RFC 7386, camelCase) on the InferenceDeployment. Thresholds are named
constants below and documented in docs/diagnosis.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from splitserve.api.patch import changes_spec
from splitserve.api.spec import MAX_POOL_REPLICAS, InferenceDeploymentSpec, Mode, PoolSpec, RoutingPolicy
from splitserve.diagnosis.buckets import CANNOT_TELL, Judged, judge, within_one_bucket
from splitserve.diagnosis.findings import (
    Alternative,
    DiagnosisInput,
    Evidence,
    Patch,
    QuestionResult,
    Status,
    Tail,
    answer,
    arg_value,
    bucket_evidence,
    fmt_value,
    judged,
    merge_patches,
    pct,
    pool_args,
    pools_in_use,
    prom_source,
    tokens_text,
    without_arg,
)
from splitserve.diagnosis.model_facts import parameter_count_from_name
from splitserve.diagnosis.per_model import per_model
from splitserve.diagnosis.scale import TAIL_OVER_SLO, disaggregation, traffic_needs, whole_replicas
from splitserve.diagnosis.sizing import (
    RUNTIME_OVERHEAD_GIB,
    TIGHT_WEIGHT_SHARE,
    FitEstimate,
    Precision,
    estimate_fit,
    histogram_cv,
    precision,
)

# 1. Hardware-model fit
TP_CANDIDATES = (1, 2, 4, 8)
# 2. Prompt redundancy
SIGNIFICANT_PREFIX_SHARE = 0.20
# 3. Output length variance
HIGH_OUTPUT_CV = 0.5
LOW_MAX_NUM_SEQS = 8
# 4. KV pressure
PREEMPTIONS_PER_SECOND = 0.01  # more than about one preemption every 100 s
WAITING_FOR_CAPACITY = 0.5  # requests waiting for KV blocks, window average over all workers
RECOMMENDED_GPU_MEMORY_UTILIZATION = 0.9
LARGE_BLOCK_SIZE = 32
# 5. Per-token latency: speculative decoding pays while decode is memory-bound (small batches)
LOW_LOAD_BATCH = 8.0
HIGH_LOAD_BATCH = 32.0
# 6. Disaggregation and scale: constants in scale.py


# --------------------------------------------------------------------------- 1. hardware-model fit


def _tp_patch(pools: Sequence[tuple[str, PoolSpec]], tp: int) -> Patch:
    patch: Patch = {}
    for name, pool in pools:
        engines_per_replica = max(1, pool.resources.gpus // pool.tensor_parallel_size)
        patch[name] = {"tensorParallelSize": tp, "resources": {"gpus": tp * engines_per_replica}}
    return patch


def hardware_fit(inp: DiagnosisInput) -> QuestionResult:
    spec, facts = inp.spec, inp.facts
    evidence: list[Evidence] = []
    in_use = pools_in_use(spec)
    if all(pool.resources.gpus == 0 for _, pool in in_use):
        # CPU-only pools (vLLM-CPU, the local tiny model): no GPU memory to fit, so no GPU to assume either.
        names = " and ".join(name for name, _ in in_use)
        return answer(
            1,
            "unknown",
            f"fit unknown: {names} pool{'s' if len(in_use) > 1 else ''} CPU-only, the GPU memory check does not apply",
            (Evidence(f"{names}: resources.gpus 0", "spec (resources.gpus)"),),
        )
    for name, _pool in in_use:
        choice = inp.gpus[name]
        evidence.append(Evidence(f"{name} GPU {choice.gpu.name}, {choice.gpu.memory_gib:g} GiB", choice.source))
    if facts.parameter_count is None or facts.kv_shape is None:
        note = f"; {facts.config_note}" if facts.config_note else ""
        return answer(
            1,
            "unknown",
            "fit unknown: parameter count not known",
            (*evidence, Evidence(f"model config not readable{note}", "model config")),
            "set spec.model.parameterCount (or make the model's config.json readable, e.g. --model-dir)",
        )
    params = facts.parameter_count
    evidence.append(Evidence(f"{params / 1e9:.2f}B parameters", facts.parameter_source))
    draft = _draft_parameters(spec)
    if draft:
        # A draft model is loaded next to the target on every GPU set; count its weights too.
        params += draft
        evidence.append(
            Evidence(f"draft model adds {draft / 1e9:.2f}B parameters", "spec (speculativeDecoding.draftModel name)")
        )
    if facts.config_note:
        evidence.append(Evidence(facts.config_note, "model config"))
    required = spec.model.max_model_len or facts.max_position_embeddings
    required_source = "spec (model.maxModelLen)" if spec.model.max_model_len else "model config"
    if required:
        evidence.append(Evidence(f"max model len {required} tokens", required_source))

    worst: FitEstimate | None = None
    worst_pool = ""
    prec_worst: Precision | None = None
    per_pool: dict[str, tuple[FitEstimate, Precision]] = {}
    for name, pool in pools_in_use(spec):
        prec = precision(spec, facts, pool_args(spec, pool))
        kv_per_token = facts.kv_shape.bytes_per_token(prec.kv_bytes)
        fit = estimate_fit(
            params,
            prec.weight_bytes,
            kv_per_token,
            pool.tensor_parallel_size,
            inp.gpus[name].gpu.memory_gib,
            spec.engine.gpu_memory_utilization,
            required,
        )
        per_pool[name] = (fit, prec)
        evidence.append(
            Evidence(
                f"{name}: {prec.label} {prec.weight_bytes:g} B/param, TP {fit.tp}: "
                f"weights {fit.weights_per_gpu_gib:.1f} GiB/GPU = {pct(fit.weight_share)} "
                f"of {fit.usable_per_gpu_gib:.1f} GiB usable "
                f"(gpuMemoryUtilization {spec.engine.gpu_memory_utilization:g}); "
                f"KV cache {tokens_text(fit.kv_tokens)} tokens at {kv_per_token / 1024:.0f} KiB/token",
                f"{prec.source}; {facts.kv_source}",
            )
        )
        order = {"fits": 0, "tight": 1, "does not fit": 2}
        if worst is None or order[fit.state] > order[worst.state]:
            worst, worst_pool, prec_worst = fit, name, prec
    assert worst is not None and prec_worst is not None

    if worst.state == "fits":
        return answer(
            1,
            "ok",
            f"fits: weights take {pct(worst.weight_share)} of usable memory, KV cache holds "
            f"{tokens_text(min(f.kv_tokens for f, _ in per_pool.values()))} tokens",
            tuple(evidence),
        )

    pool = dict(pools_in_use(spec))[worst_pool]
    gpu = inp.gpus[worst_pool].gpu
    kv_per_token = facts.kv_shape.bytes_per_token(prec_worst.kv_bytes)
    options = _fit_options(inp, pool, prec_worst, kv_per_token, gpu.memory_gib, required, gpu.native_fp8)
    if worst.state == "does not fit":
        why = (
            f"weights {worst.weights_per_gpu_gib:.1f} GiB/GPU + {RUNTIME_OVERHEAD_GIB:g} GiB runtime overhead "
            f"exceed the {worst.usable_per_gpu_gib:.1f} GiB budget"
        )
    elif worst.weight_share >= TIGHT_WEIGHT_SHARE:
        why = (
            f"weights take {pct(worst.weight_share)} of usable memory, "
            f"KV cache only {tokens_text(worst.kv_tokens)} tokens"
        )
    else:
        why = (
            f"KV cache holds {tokens_text(worst.kv_tokens)} tokens, less than one {required}-token sequence "
            "(vLLM refuses to start)"
        )
        shortest = min(fit.kv_tokens for fit, _ in per_pool.values())
        max_len = int(shortest // 1024 * 1024)
        if max_len >= 1024:
            limit = Alternative(
                f"limit model.maxModelLen to {max_len} tokens (no extra GPUs)", {"model": {"maxModelLen": max_len}}
            )
            options = [limit, *options]
    affected = [name for name, (fit, _) in per_pool.items() if fit.state == worst.state]
    verdict = f"{worst.state}: {' and '.join(affected)} pool{'s' if len(affected) > 1 else ''}, {why}"
    if not options:
        return answer(
            1,
            "problem",
            verdict,
            tuple(evidence),
            "nothing up to TP 8 with 8-bit weights fits: use GPUs with more memory, pipeline parallelism "
            "or a smaller/distilled model",
        )
    primary = options[0]
    recommendation = "; or ".join(option.description for option in options)
    return answer(1, "problem", verdict, tuple(evidence), recommendation, primary.patch, tuple(options))


def _draft_parameters(spec: InferenceDeploymentSpec) -> float:
    """Parameters of the speculative-decoding draft model, from its name; 0 when none or unknown."""
    speculative = spec.engine.speculative_decoding
    if speculative.method != "draft" or not speculative.draft_model:
        return 0.0
    return parameter_count_from_name(speculative.draft_model) or 0.0


def _fit_options(
    inp: DiagnosisInput,
    pool: PoolSpec,
    prec: Precision,
    kv_per_token: float,
    gpu_memory_gib: float,
    required: int | None,
    native_fp8: bool,
) -> list[Alternative]:
    """Smallest TP that fits at the current precision, and at 8-bit weights; fewest GPUs first."""
    spec, facts = inp.spec, inp.facts
    assert facts.parameter_count is not None
    heads = facts.num_attention_heads
    precisions: list[tuple[str | None, float]] = [(None, prec.weight_bytes)]
    eight_bit = "fp8" if native_fp8 else "int8"
    if prec.weight_bytes > 1.0:
        precisions.append((eight_bit, 1.0))
    found: list[tuple[int, int, Alternative]] = []
    for rank, (quant, weight_bytes) in enumerate(precisions):
        for tp in TP_CANDIDATES:
            if tp < pool.tensor_parallel_size or (heads is not None and heads % tp != 0):
                continue
            fit = estimate_fit(
                facts.parameter_count + _draft_parameters(spec),
                weight_bytes,
                kv_per_token,
                tp,
                gpu_memory_gib,
                spec.engine.gpu_memory_utilization,
                required,
            )
            if fit.state != "fits":
                continue
            patch = _tp_patch(pools_in_use(spec), tp) if tp != pool.tensor_parallel_size else {}
            label = f"{quant} weights at TP {tp}" if quant else f"TP {tp} ({prec.label})"
            if quant:
                patch = merge_patches({"model": {"quantization": quant}}, patch) or {}
            description = (
                f"{label}: weights {fit.weights_per_gpu_gib:.1f} GiB/GPU ({pct(fit.weight_share)}), "
                f"KV cache {tokens_text(fit.kv_tokens)} tokens"
            )
            found.append((tp, rank, Alternative(description, patch)))
            break
    found.sort(key=lambda item: (item[0], item[1]))
    return [alternative for _, _, alternative in found]


# --------------------------------------------------------------------------- 2. prompt redundancy


def prompt_redundancy(inp: DiagnosisInput) -> QuestionResult:
    """The pool-wide share of prompt tokens served from the prefix cache; per model name (base model and
    LoRA adapters, per_model.py) as well when more than one carries traffic."""
    spec = inp.spec
    policy_field = "prefill" if spec.mode is Mode.DISAGGREGATED else "decode"
    policy: RoutingPolicy = getattr(spec.router.routing_policy, policy_field)
    overall = _pool_wide_redundancy(inp, policy_field, policy)
    if not spec.engine.prefix_caching:
        return overall
    return per_model(inp, overall, policy, policy_field)


def _pool_wide_redundancy(inp: DiagnosisInput, policy_field: str, policy: RoutingPolicy) -> QuestionResult:
    spec, tel = inp.spec, inp.telemetry
    evidence = [
        Evidence(f"prefixCaching {str(spec.engine.prefix_caching).lower()}", "spec (engine.prefixCaching)"),
        Evidence(f"router {policy_field} policy {policy}", f"spec (router.routingPolicy.{policy_field})"),
    ]
    enable_caching: Patch = {"engine": {"prefixCaching": True}}
    if not spec.engine.prefix_caching:
        why = "prompt redundancy cannot be measured while it is off"
        verdict = "prefix caching off: " + (inp.no_telemetry(why) if tel is None else why)
        return answer(
            2,
            "recommend",
            verdict,
            tuple(evidence),
            "turn prefix caching on (vLLM's default; near-zero cost when prompts do not repeat)",
            enable_caching,
        )
    if tel is None:
        return answer(2, "unknown", inp.no_telemetry("prefix-cache hit rate unknown"), tuple(evidence))
    hits, queries = tel.prefix_hits_rate, tel.prefix_queries_rate
    evidence += [
        Evidence(f"prefix-cache hits {fmt_value(hits.value)} tokens/s", prom_source(hits)),
        Evidence(f"prefix-cache queries {fmt_value(queries.value)} tokens/s", prom_source(queries)),
    ]
    if hits.value is None or not queries.value:
        return answer(2, "unknown", "no prompt traffic in the window", tuple(evidence))
    share = hits.value / queries.value
    prefix_routed = policy in (RoutingPolicy.PREFIX_AWARE, RoutingPolicy.KV_AWARE, RoutingPolicy.PRECISE_PREFIX)
    pool = spec.prefill if policy_field == "prefill" else spec.decode
    replicas = max(pool.replicas, pool.max_replicas if spec.autoscaling.enabled else 0)
    if not prefix_routed and replicas > 1:
        # Requests sharing a prefix land on the replica holding it only about 1/replicas of the time.
        evidence.append(
            Evidence(
                f"cache hit share {pct(share)}; the shared-prefix share may be up to "
                f"{pct(min(1.0, share * replicas))} ({policy} scatters prefixes over {replicas} replicas)",
                "derived",
            )
        )
    if share < SIGNIFICANT_PREFIX_SHARE:
        return answer(
            2, "ok", f"little prompt redundancy: {pct(share)} of prompt tokens hit the prefix cache", tuple(evidence)
        )
    if prefix_routed:
        return answer(
            2,
            "ok",
            f"prefix caching pays: {pct(share)} of prompt tokens hit the cache, routing is {policy}",
            tuple(evidence),
        )
    return answer(
        2,
        "recommend",
        f"{pct(share)} of prompt tokens share a cached prefix, but routing is {policy}",
        tuple(evidence),
        "route by prefix so requests sharing a prefix reach the replica that caches it",
        {"router": {"routingPolicy": {policy_field: RoutingPolicy.PREFIX_AWARE.value}}},
    )


# --------------------------------------------------------------------------- 3. output length variance


def _max_num_seqs(spec: InferenceDeploymentSpec) -> tuple[int | None, str, Patch | None]:
    """The lowest max-num-seqs any pool in use runs with, where it is set, and the patch removing it."""
    lowest: tuple[int | None, str, Patch | None] = (None, "", None)
    if spec.engine.max_num_seqs is not None:
        lowest = (spec.engine.max_num_seqs, "spec (engine.maxNumSeqs)", {"engine": {"maxNumSeqs": None}})
    for name, pool in pools_in_use(spec):
        for owner, args, path in (("engine", spec.engine.extra_args, "engine"), (name, pool.extra_args, name)):
            value = arg_value(args, "--max-num-seqs")
            if value is None or not value.isdigit():
                continue
            if lowest[0] is None or int(value) < lowest[0]:
                patch = {path: {"extraArgs": without_arg(args, "--max-num-seqs")}}
                lowest = (int(value), f"spec ({owner}.extraArgs)", patch)
    return lowest


def output_variance(inp: DiagnosisInput) -> QuestionResult:
    spec, tel = inp.spec, inp.telemetry
    seqs, seqs_source, seqs_patch = _max_num_seqs(spec)
    evidence: list[Evidence] = []
    if seqs is not None:
        evidence.append(Evidence(f"max-num-seqs {seqs}", seqs_source))
    cv: float | None = None
    if tel is not None:
        total, count = tel.output_tokens_sum_rate, tel.output_tokens_count_rate
        evidence.append(Evidence(f"output tokens/s {fmt_value(total.value)}", prom_source(total)))
        evidence.append(Evidence(f"requests/s {fmt_value(count.value)}", prom_source(count)))
        if total.value is not None and count.value:
            mean = total.value / count.value
            cv = histogram_cv(tel.output_tokens_buckets, mean)
            evidence.append(
                Evidence(
                    f"mean output {mean:.0f} tokens, coefficient of variation {fmt_value(cv, '{:.2f}')}",
                    f"prometheus: {tel.output_tokens_buckets_query}",
                )
            )
    if seqs is not None and seqs < LOW_MAX_NUM_SEQS:
        spread = f" with output-length CV {cv:.2f}" if cv is not None else ""
        return answer(
            3,
            "problem",
            f"max-num-seqs {seqs} defeats continuous batching{spread}: short answers wait behind long ones",
            tuple(evidence),
            "remove the max-num-seqs override so vLLM's continuous batching can fill the batch",
            seqs_patch,
        )
    defaults = "continuous batching is on (vLLM's default) and nothing in the spec defeats it"
    if tel is None:
        return answer(3, "ok", inp.no_telemetry(defaults), tuple(evidence))
    if cv is None:
        return answer(3, "ok", f"no output-length data in the window; {defaults}", tuple(evidence))
    spread = "high" if cv >= HIGH_OUTPUT_CV else "low"
    return answer(3, "ok", f"{spread} output-length variance (CV {cv:.2f}); {defaults}", tuple(evidence))


# --------------------------------------------------------------------------- 4. KV fragmentation and pressure


def kv_pressure(inp: DiagnosisInput) -> QuestionResult:
    spec, tel = inp.spec, inp.telemetry
    util = spec.engine.gpu_memory_utilization
    block = spec.engine.block_size
    evidence = [
        Evidence(f"gpuMemoryUtilization {util:g}", "spec (engine.gpuMemoryUtilization)"),
        Evidence(f"blockSize {block if block is not None else 'default (16)'}", "spec (engine.blockSize)"),
    ]
    settings_patch: Patch | None = None
    settings_why: list[str] = []
    if util < RECOMMENDED_GPU_MEMORY_UTILIZATION:
        settings_patch = merge_patches(
            settings_patch, {"engine": {"gpuMemoryUtilization": RECOMMENDED_GPU_MEMORY_UTILIZATION}}
        )
        settings_why.append(
            f"raise gpuMemoryUtilization {util:g} -> {RECOMMENDED_GPU_MEMORY_UTILIZATION:g} for more KV blocks"
        )
    if block is not None and block > LARGE_BLOCK_SIZE:
        settings_patch = merge_patches(settings_patch, {"engine": {"blockSize": 16}})
        settings_why.append(f"block size {block} wastes up to {block - 1} tokens per sequence: use 16")

    if tel is None:
        status: Status = "recommend" if block is not None and block > LARGE_BLOCK_SIZE else "unknown"
        return answer(
            4,
            status,
            inp.no_telemetry("preemptions and KV usage unknown; paged attention is always on in vLLM"),
            tuple(evidence),
            "; ".join(settings_why) if status == "recommend" else "",
            {"engine": {"blockSize": 16}} if status == "recommend" else None,
        )
    pre, usage, waiting = tel.preemptions_rate, tel.kv_usage_max, tel.waiting_for_capacity
    target = spec.autoscaling.decode.kv_cache_usage
    evidence += [
        Evidence(f"preemptions {fmt_value(pre.value)}/s", prom_source(pre)),
        Evidence(f"KV cache usage {fmt_value(usage.value, '{:.0%}')} (busiest worker)", prom_source(usage)),
        Evidence(f"waiting for KV capacity {fmt_value(waiting.value, '{:.2f}')}", prom_source(waiting)),
    ]
    if not (pre.known or usage.known or waiting.known):
        return answer(4, "unknown", "no KV metrics in the window", tuple(evidence))
    preempting = (pre.value or 0.0) > PREEMPTIONS_PER_SECOND
    queued = (waiting.value or 0.0) >= WAITING_FOR_CAPACITY
    if preempting or queued:
        signs = []
        if preempting:
            signs.append(f"{pre.value:.2g} preemptions/s")
        if queued:
            signs.append(f"{waiting.value:.1f} requests waiting for KV blocks")
        verdict = "KV pressure: " + ", ".join(signs)
        if settings_patch is not None:
            return answer(4, "problem", verdict, tuple(evidence), "; ".join(settings_why), settings_patch)
        recommendation, patch = _more_decode_replicas(inp)
        return answer(4, "problem", verdict, tuple(evidence), recommendation, patch)
    if usage.value is not None and usage.value >= target:
        return answer(
            4,
            "ok",
            f"KV cache busy ({usage.value:.0%} >= target {target:.0%}) but no preemptions or capacity waits",
            tuple(evidence),
        )
    return answer(4, "ok", "no KV pressure: no preemptions or capacity waits", tuple(evidence))


def _more_decode_replicas(inp: DiagnosisInput) -> tuple[str, Patch]:
    """One more decode replica, or as many as the observed traffic needs when that is more."""
    spec, decode = inp.spec, inp.spec.decode
    needs = traffic_needs(inp)
    needed = min(MAX_POOL_REPLICAS, whole_replicas(needs[1])) if needs is not None else 0
    if spec.autoscaling.enabled:
        ceiling = min(MAX_POOL_REPLICAS, max(decode.max_replicas + 1, needed))
        return (
            f"add decode capacity: the autoscaler is capped at decode.maxReplicas {decode.max_replicas}",
            {"decode": {"maxReplicas": ceiling}},
        )
    replicas = min(MAX_POOL_REPLICAS, max(decode.replicas + 1, needed))
    patch: Patch = {"decode": {"replicas": replicas}}
    if replicas > decode.max_replicas:
        patch["decode"]["maxReplicas"] = replicas
    why = f"; traffic needs {needs[1]:.1f}" if needs is not None and needed > decode.replicas + 1 else ""
    return f"add decode replicas ({decode.replicas} -> {replicas}{why})", patch


# --------------------------------------------------------------------------- 5. per-token latency


def per_token_latency(inp: DiagnosisInput) -> QuestionResult:
    spec, tel = inp.spec, inp.telemetry
    spec_decode = spec.engine.speculative_decoding
    slo = spec.autoscaling.decode.itl_slo_seconds
    evidence = [
        Evidence(f"ITL SLO {slo * 1000:.0f} ms", "spec (autoscaling.decode.itlSloSeconds)"),
        Evidence(f"speculative decoding {spec_decode.method}", "spec (engine.speculativeDecoding.method)"),
    ]
    turn_on: Patch = {"engine": {"speculativeDecoding": {"method": "ngram", "numSpeculativeTokens": 3}}}
    turn_off: Patch = {"engine": {"speculativeDecoding": {"method": "off"}}}
    if tel is None:
        caveat = " (it pays only at small batch sizes)" if spec_decode.method != "off" else ""
        return answer(
            5,
            "unknown",
            inp.no_telemetry(f"inter-token latency vs SLO unknown; speculative decoding {spec_decode.method}{caveat}"),
            tuple(evidence),
        )
    itl, batch = tel.itl_p90, tel.running_per_replica
    evidence += [
        Evidence(f"ITL p90 {_ms(itl.value)} (engines)", prom_source(itl)),
        Evidence(f"ITL p99 {_ms(tel.itl_p99.value)} (engines)", prom_source(tel.itl_p99)),
        Evidence(f"batch size {fmt_value(batch.value, '{:.1f}')} (busiest worker)", prom_source(batch)),
    ]
    router = tel.router
    if router.itl_p90.known:
        evidence.append(
            Evidence(
                f"ITL at the router (as clients see it) p90 {_ms(router.itl_p90.value)}, "
                f"p99 {_ms(router.itl_p99.value)}",
                prom_source(router.itl_p90),
            )
        )
    if itl.value is None:
        return answer(5, "unknown", "no decode traffic in the window", tuple(evidence))
    load = batch.value if batch.value is not None else 0.0
    high = load >= HIGH_LOAD_BATCH
    # Over only when the p90's whole histogram bucket is: one that also holds the SLO cannot tell (the tail).
    p90 = judge(itl.value, slo, itl.buckets)
    if spec_decode.method != "off" and high:
        return answer(
            5,
            "recommend",
            f"speculative decoding on at high load (batch {load:.0f}): verification steps cost throughput",
            tuple(evidence),
            "turn speculative decoding off while the batch stays large",
            turn_off,
        )
    if p90.over and spec_decode.method == "off" and load <= LOW_LOAD_BATCH:
        return answer(
            5,
            "recommend",
            f"ITL p90 {itl.value * 1000:.0f} ms over the {slo * 1000:.0f} ms SLO at low load (batch {load:.1f})",
            tuple(evidence),
            "turn on speculative decoding: ngram prompt lookup needs no extra model (or method draft with a small "
            "draft model of the same family)",
            turn_on,
        )
    if p90.over:
        recommendation, patch = _lower_decode_batch(inp, itl.value, slo)
        # "Too busy" only explains the miss when speculative decoding is off and the batch is past the
        # low-load range; with it already on at a small batch the engine is simply too slow per step.
        why = (
            f"even with speculative decoding ({spec_decode.method}) on"
            if spec_decode.method != "off"
            else "too busy for speculative decoding to pay"
        )
        return answer(
            5,
            "problem",
            f"ITL p90 {itl.value * 1000:.0f} ms over the {slo * 1000:.0f} ms SLO at batch {load:.1f}: {why}",
            tuple(evidence),
            recommendation,
            patch,
        )
    tail = _itl_tail(inp, p90)
    if tail is not None:
        return answer(5, tail.status, tail.verdict, (*evidence, *tail.evidence), tail.recommendation, tail.patch)
    return answer(
        5,
        "ok",
        f"ITL p90 {itl.value * 1000:.0f} ms, p99 {_ms(tel.itl_p99.value)} meet the {slo * 1000:.0f} ms SLO"
        + (f" (at the router p90 {_ms(router.itl_p90.value)})" if router.itl_p90.known else ""),
        tuple(evidence),
    )


def _ms(seconds: float | None) -> str:
    if seconds is None or math.isnan(seconds):
        return "no data"
    return f"{seconds * 1000:.0f} ms" if seconds >= 0.01 else f"{seconds * 1000:.1f} ms"


def _itl_tail(inp: DiagnosisInput, p90: Judged) -> Tail | None:
    """With the engines' p90 not over the SLO: a p99 far outside it, or clients seeing worse than the engines,
    is a problem; a quantile in the same histogram bucket as its limit (the p90 too) cannot be told either way."""
    tel = inp.telemetry
    assert tel is not None
    slo = p90.limit
    at_slo, at_twice = f"the {_ms(slo)} SLO", f"{TAIL_OVER_SLO:g}x the {_ms(slo)} SLO"
    p90_words = f"ITL p90 ≈ {_ms(p90.value)} (engines)"
    unsure = [(p90_words, at_slo, p90)] if p90.unsure else []
    over = []
    for label, reading, limit, limit_words in (
        ("engine ITL p99", tel.itl_p99, slo * TAIL_OVER_SLO, at_twice),
        ("router ITL p90", tel.router.itl_p90, slo, at_slo),
        ("router ITL p99", tel.router.itl_p99, slo * TAIL_OVER_SLO, at_twice),
    ):
        found = judged(reading, limit)
        if found is not None and found.over:
            over.append(f"{label} {_ms(found.value)} is {found.value / slo:.1f}x the SLO")
        elif found is not None and found.unsure:
            unsure.append((f"{label} ≈ {_ms(found.value)}", limit_words, found))
    evidence = tuple(bucket_evidence(quantile, limit, found, "ms", tel) for quantile, limit, found in unsure)
    if not over:
        if not unsure:
            return None
        clauses = ", and ".join(within_one_bucket(quantile, limit, found, "ms") for quantile, limit, found in unsure)
        return Tail("unknown", f"{clauses}: {CANNOT_TELL}", evidence)
    held = f"ITL p90 {p90.value * 1000:.0f} ms meets the {slo * 1000:.0f} ms SLO"
    if p90.unsure:
        held = within_one_bucket(p90_words, at_slo, p90, "ms")
    verdict = f"{held}, but the tail does not: " + ", ".join(over)
    decode_busy = traffic_needs(inp)
    if decode_busy is not None and decode_busy[1] > inp.spec.decode.replicas:
        advice, patch = _more_decode_replicas(inp)
        return Tail("problem", verdict, evidence, advice, patch)
    advice = (
        "tail stalls come from steps that take far longer than usual: decode steps that also take in KV or "
        "prefill chunks, or a saturated decode pool (see question 6); one more decode replica spreads them"
    )
    return Tail("problem", verdict, evidence, advice)


def _lower_decode_batch(inp: DiagnosisInput, itl: float, slo: float) -> tuple[str, Patch]:
    spec = inp.spec
    if spec.autoscaling.enabled:
        current = spec.autoscaling.decode.running_per_replica
        target = max(1.0, math.floor(current * slo / itl))
        return (
            f"scale decode on a smaller batch: runningPerReplica {current:g} -> {target:g}",
            {"autoscaling": {"decode": {"runningPerReplica": target}}},
        )
    return _more_decode_replicas(inp)


# --------------------------------------------------------------------------- all questions

QUESTIONS: tuple[Callable[[DiagnosisInput], QuestionResult], ...] = (
    hardware_fit,
    prompt_redundancy,
    output_variance,
    kv_pressure,
    per_token_latency,
    disaggregation,
)


def diagnose(inp: DiagnosisInput) -> list[QuestionResult]:
    return [without_noop_patches(inp.spec, question(inp)) for question in QUESTIONS]


def without_noop_patches(spec: InferenceDeploymentSpec, result: QuestionResult) -> QuestionResult:
    """A finding never carries a patch that leaves the spec as it is (or makes it invalid).

    The questions try not to build one; this is the net under them. A "recommend" whose only change is
    already in the spec has nothing left to recommend; a "problem" stands, with the patch dropped and
    the recommendation saying so.
    """
    alternatives = tuple(option for option in result.alternatives if changes_spec(spec, option.patch))
    if result.patch is None or changes_spec(spec, result.patch):
        return dataclasses.replace(result, alternatives=alternatives)
    if result.status == "recommend":
        verdict = f"{result.verdict} (the spec already has the change this calls for)"
        return dataclasses.replace(
            result, status="ok", verdict=verdict, recommendation="", patch=None, alternatives=alternatives
        )
    note = "the spec already asks for this: the change has to come from outside it"
    recommendation = f"{result.recommendation} ({note})" if result.recommendation else note
    return dataclasses.replace(result, recommendation=recommendation, patch=None, alternatives=alternatives)
