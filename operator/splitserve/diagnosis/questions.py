"""The six-question diagnosis, as pure functions of a `DiagnosisInput`.

Each question returns a `QuestionResult`: a verdict, the evidence (every number with where it came
from: "spec", "model config", "prometheus: <query>"), a recommendation and, when there is something
to change, a JSON merge patch (RFC 7386, camelCase) on the InferenceDeployment. Thresholds are named
constants below and documented in docs/diagnosis.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from splitserve.api.spec import InferenceDeploymentSpec, Mode, PoolSpec, RoutingPolicy
from splitserve.api.status import Finding
from splitserve.diagnosis.gpus import GIB, GpuChoice
from splitserve.diagnosis.model_facts import ModelFacts
from splitserve.diagnosis.telemetry import Reading, Telemetry

Status = Literal["ok", "recommend", "problem", "unknown"]
Patch = dict[str, Any]

# 1. Hardware-model fit
TIGHT_WEIGHT_SHARE = 0.90  # weights at or above this share of vLLM's memory budget leave the KV cache no room
RUNTIME_OVERHEAD_GIB = 2.0  # per GPU inside vLLM's budget: activations, CUDA graphs, non-torch allocations
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
# 6. Disaggregation
TTFT_INFLATION = 2.0  # TTFT p90 / prefill time p90 above this: prompts wait behind other work
PREFILL_MFU = 0.4  # share of peak FLOPS a prefill achieves
DECODE_BANDWIDTH_EFFICIENCY = 0.6  # share of peak HBM bandwidth a decode step achieves
CAPACITY_HEADROOM = 0.7  # plan replicas to run at 70% of their estimated capacity
RATIO_MISMATCH = 1.5  # current vs needed prefill:decode ratio off by more than this factor
MIN_REQUEST_RATE = 0.01  # requests/s below which the window is "no traffic"


@dataclass(frozen=True)
class Evidence:
    text: str
    source: str

    def render(self) -> str:
        return f"{self.text} [{self.source}]"


@dataclass(frozen=True)
class Alternative:
    description: str
    patch: Patch


@dataclass(frozen=True)
class QuestionResult:
    number: int
    key: str
    title: str
    status: Status
    verdict: str
    evidence: tuple[Evidence, ...] = ()
    recommendation: str = ""
    patch: Patch | None = None
    alternatives: tuple[Alternative, ...] = ()

    def to_finding(self) -> Finding:
        return Finding(
            question=f"{self.number}. {self.title}",
            verdict=self.verdict,
            evidence="; ".join(e.render() for e in self.evidence),
            recommendation=self.recommendation,
            patch=self.patch,
        )


@dataclass(frozen=True)
class DiagnosisInput:
    spec: InferenceDeploymentSpec
    facts: ModelFacts
    gpus: Mapping[str, GpuChoice]  # pool name -> GPU it runs on
    telemetry: Telemetry | None = None
    telemetry_note: str = "no --prometheus given"
    notes: tuple[str, ...] = field(default_factory=tuple)

    def no_telemetry(self, what: str) -> str:
        return f"no telemetry: {what} ({self.telemetry_note})"


# --------------------------------------------------------------------------- helpers


def pools_in_use(spec: InferenceDeploymentSpec) -> list[tuple[str, PoolSpec]]:
    """Aggregated mode serves from one pool with decode's settings."""
    if spec.mode is Mode.AGGREGATED:
        return [("decode", spec.decode)]
    return [("prefill", spec.prefill), ("decode", spec.decode)]


def arg_value(args: Sequence[str], name: str) -> str | None:
    """Value of `--name v` or `--name=v` in a vLLM argument list; the last one wins, as in argparse."""
    value: str | None = None
    for index, arg in enumerate(args):
        if arg == name and index + 1 < len(args):
            value = args[index + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def without_arg(args: Sequence[str], name: str) -> list[str]:
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg == name:
            skip = True
            continue
        if arg.startswith(name + "="):
            continue
        out.append(arg)
    return out


def pool_args(spec: InferenceDeploymentSpec, pool: PoolSpec) -> list[str]:
    """Engine-wide then per-pool extra args: the pool's come later on the command line and win."""
    return [*spec.engine.extra_args, *pool.extra_args]


def merge_patches(*patches: Patch | None) -> Patch | None:
    merged: Patch = {}
    for patch in patches:
        if patch:
            _merge_into(merged, patch)
    return merged or None


def _merge_into(target: Patch, patch: Patch) -> None:
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge_into(target[key], value)
        else:
            target[key] = value


def _pct(value: float) -> str:
    return f"{value * 100:.0f}%"


def _tokens(value: float) -> str:
    if value >= 1e6:
        return f"{value / 1e6:.2f}M"
    if value >= 1e4:
        return f"{value / 1e3:.0f}k"
    return f"{value:.0f}"


def _prom(reading: Reading) -> str:
    return f"prometheus: {reading.query}"


# --------------------------------------------------------------------------- 1. hardware-model fit

QUANT_BYTES: dict[str, float] = {"fp8": 1.0, "int8": 1.0, "awq": 0.5625, "gptq": 0.5625}
DTYPE_BYTES: dict[str, float] = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0}


@dataclass(frozen=True)
class Precision:
    weight_bytes: float
    kv_bytes: float
    label: str
    source: str


def precision(spec: InferenceDeploymentSpec, facts: ModelFacts, args: Sequence[str]) -> Precision:
    """Bytes per parameter and per KV element, from spec quantization, dtype, config and --kv-cache-dtype.

    awq/gptq are 4-bit plus about 12% for group scales/zeros and the 16-bit embeddings (0.5625 B/param).
    dtype auto follows vLLM: 16-bit for fp16/bf16/fp32 checkpoints.
    """
    dtype = spec.model.dtype
    kv_bytes = 4.0 if dtype == "float32" else 2.0
    kv_arg = arg_value(args, "--kv-cache-dtype")
    if kv_arg and kv_arg.startswith("fp8"):
        kv_bytes = 1.0
    quant = spec.model.quantization
    if quant != "none":
        return Precision(QUANT_BYTES[quant], kv_bytes, quant, "spec (model.quantization)")
    if facts.config_quantization:
        method = facts.config_quantization
        bytes_ = QUANT_BYTES.get(method, 0.5625 if method in ("bitsandbytes", "awq_marlin", "gptq_marlin") else 1.0)
        return Precision(bytes_, kv_bytes, f"{method} (pre-quantized checkpoint)", "model config")
    if dtype == "auto":
        return Precision(2.0, kv_bytes, "16-bit (dtype auto)", "spec (model.dtype auto)")
    return Precision(DTYPE_BYTES[dtype], kv_bytes, dtype, "spec (model.dtype)")


@dataclass(frozen=True)
class FitEstimate:
    tp: int
    weight_bytes_per_param: float
    weights_per_gpu_gib: float
    usable_per_gpu_gib: float
    kv_tokens: float
    state: Literal["fits", "tight", "does not fit"]

    @property
    def weight_share(self) -> float:
        return self.weights_per_gpu_gib / self.usable_per_gpu_gib


def estimate_fit(
    parameters: float,
    weight_bytes: float,
    kv_bytes_per_token: float,
    tp: int,
    gpu_memory_gib: float,
    memory_utilization: float,
    required_tokens: int | None,
) -> FitEstimate:
    """Weights per GPU against vLLM's budget (memory x utilisation) and the KV tokens left over.

    The KV cache is sharded like the weights, so the tokens it holds are the leftover per GPU times TP.
    """
    weights_per_gpu = parameters * weight_bytes / tp / GIB
    usable = gpu_memory_gib * memory_utilization
    kv_room = usable - weights_per_gpu - RUNTIME_OVERHEAD_GIB
    kv_tokens = max(0.0, kv_room * GIB * tp / kv_bytes_per_token)
    state: Literal["fits", "tight", "does not fit"]
    if kv_room <= 0:
        state = "does not fit"
    elif weights_per_gpu >= TIGHT_WEIGHT_SHARE * usable or (required_tokens and kv_tokens < required_tokens):
        state = "tight"
    else:
        state = "fits"
    return FitEstimate(tp, weight_bytes, weights_per_gpu, usable, kv_tokens, state)


def _tp_patch(pools: Sequence[tuple[str, PoolSpec]], tp: int) -> Patch:
    patch: Patch = {}
    for name, pool in pools:
        engines_per_replica = max(1, pool.resources.gpus // pool.tensor_parallel_size)
        patch[name] = {"tensorParallelSize": tp, "resources": {"gpus": tp * engines_per_replica}}
    return patch


def hardware_fit(inp: DiagnosisInput) -> QuestionResult:
    spec, facts = inp.spec, inp.facts
    title = "Hardware-model fit"
    evidence: list[Evidence] = []
    for name, _pool in pools_in_use(spec):
        choice = inp.gpus[name]
        evidence.append(Evidence(f"{name} GPU {choice.gpu.name}, {choice.gpu.memory_gib:g} GiB", choice.source))
    if facts.parameter_count is None or facts.kv_shape is None:
        note = f"; {facts.config_note}" if facts.config_note else ""
        return QuestionResult(
            1,
            "hardware-fit",
            title,
            "unknown",
            "fit unknown: parameter count not known",
            (*evidence, Evidence(f"model config not readable{note}", "model config")),
            "set spec.model.parameterCount (or make the model's config.json readable, e.g. --model-dir)",
        )
    params = facts.parameter_count
    evidence.append(Evidence(f"{params / 1e9:.2f}B parameters", facts.parameter_source))
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
                f"weights {fit.weights_per_gpu_gib:.1f} GiB/GPU = {_pct(fit.weight_share)} "
                f"of {fit.usable_per_gpu_gib:.1f} GiB usable "
                f"(gpuMemoryUtilization {spec.engine.gpu_memory_utilization:g}); "
                f"KV cache {_tokens(fit.kv_tokens)} tokens at {kv_per_token / 1024:.0f} KiB/token",
                f"{prec.source}; {facts.kv_source}",
            )
        )
        order = {"fits": 0, "tight": 1, "does not fit": 2}
        if worst is None or order[fit.state] > order[worst.state]:
            worst, worst_pool, prec_worst = fit, name, prec
    assert worst is not None and prec_worst is not None

    if worst.state == "fits":
        return QuestionResult(
            1,
            "hardware-fit",
            title,
            "ok",
            f"fits: weights take {_pct(worst.weight_share)} of usable memory, KV cache holds "
            f"{_tokens(min(f.kv_tokens for f, _ in per_pool.values()))} tokens",
            tuple(evidence),
        )

    pool = dict(pools_in_use(spec))[worst_pool]
    gpu = inp.gpus[worst_pool].gpu
    kv_per_token = facts.kv_shape.bytes_per_token(prec_worst.kv_bytes)
    options = _fit_options(inp, pool, prec_worst, kv_per_token, gpu.memory_gib, required, gpu.native_fp8)
    if worst.state == "does not fit":
        why = f"weights {worst.weights_per_gpu_gib:.1f} GiB/GPU exceed the {worst.usable_per_gpu_gib:.1f} GiB budget"
    elif worst.weight_share >= TIGHT_WEIGHT_SHARE:
        why = (
            f"weights take {_pct(worst.weight_share)} of usable memory, KV cache only {_tokens(worst.kv_tokens)} tokens"
        )
    else:
        why = (
            f"KV cache holds {_tokens(worst.kv_tokens)} tokens, less than one {required}-token sequence "
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
        return QuestionResult(
            1,
            "hardware-fit",
            title,
            "problem",
            verdict,
            tuple(evidence),
            "nothing up to TP 8 with 8-bit weights fits: use GPUs with more memory, pipeline parallelism "
            "or a smaller/distilled model",
        )
    primary = options[0]
    recommendation = "; or ".join(option.description for option in options)
    return QuestionResult(
        1,
        "hardware-fit",
        title,
        "problem",
        verdict,
        tuple(evidence),
        recommendation,
        primary.patch,
        tuple(options),
    )


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
                facts.parameter_count,
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
                f"{label}: weights {fit.weights_per_gpu_gib:.1f} GiB/GPU ({_pct(fit.weight_share)}), "
                f"KV cache {_tokens(fit.kv_tokens)} tokens"
            )
            found.append((tp, rank, Alternative(description, patch)))
            break
    found.sort(key=lambda item: (item[0], item[1]))
    return [alternative for _, _, alternative in found]


# --------------------------------------------------------------------------- 2. prompt redundancy


def prompt_redundancy(inp: DiagnosisInput) -> QuestionResult:
    spec, tel = inp.spec, inp.telemetry
    title = "Prompt redundancy"
    policy_field = "prefill" if spec.mode is Mode.DISAGGREGATED else "decode"
    policy = getattr(spec.router.routing_policy, policy_field)
    evidence = [
        Evidence(f"prefixCaching {str(spec.engine.prefix_caching).lower()}", "spec (engine.prefixCaching)"),
        Evidence(f"router {policy_field} policy {policy}", f"spec (router.routingPolicy.{policy_field})"),
    ]
    enable_caching: Patch = {"engine": {"prefixCaching": True}}
    if not spec.engine.prefix_caching:
        why = "prompt redundancy cannot be measured while it is off"
        verdict = "prefix caching off: " + (inp.no_telemetry(why) if tel is None else why)
        return QuestionResult(
            2,
            "prompt-redundancy",
            title,
            "recommend",
            verdict,
            tuple(evidence),
            "turn prefix caching on (vLLM's default; near-zero cost when prompts do not repeat)",
            enable_caching,
        )
    if tel is None:
        return QuestionResult(
            2, "prompt-redundancy", title, "unknown", inp.no_telemetry("prefix-cache hit rate unknown"), tuple(evidence)
        )
    hits, queries = tel.prefix_hits_rate, tel.prefix_queries_rate
    evidence += [
        Evidence(f"prefix-cache hits {_fmt(hits.value)} tokens/s", _prom(hits)),
        Evidence(f"prefix-cache queries {_fmt(queries.value)} tokens/s", _prom(queries)),
    ]
    if hits.value is None or not queries.value:
        return QuestionResult(
            2, "prompt-redundancy", title, "unknown", "no prompt traffic in the window", tuple(evidence)
        )
    share = hits.value / queries.value
    prefix_routed = policy in (RoutingPolicy.PREFIX_AWARE, RoutingPolicy.KV_AWARE)
    if share < SIGNIFICANT_PREFIX_SHARE:
        return QuestionResult(
            2,
            "prompt-redundancy",
            title,
            "ok",
            f"little prompt redundancy: {_pct(share)} of prompt tokens hit the prefix cache",
            tuple(evidence),
        )
    if prefix_routed:
        return QuestionResult(
            2,
            "prompt-redundancy",
            title,
            "ok",
            f"prefix caching pays: {_pct(share)} of prompt tokens hit the cache, routing is {policy}",
            tuple(evidence),
        )
    return QuestionResult(
        2,
        "prompt-redundancy",
        title,
        "recommend",
        f"{_pct(share)} of prompt tokens share a cached prefix, but routing is {policy}",
        tuple(evidence),
        "route by prefix so requests sharing a prefix reach the replica that caches it",
        {"router": {"routingPolicy": {policy_field: RoutingPolicy.PREFIX_AWARE.value}}},
    )


def _fmt(value: float | None, fmt: str = "{:.3g}") -> str:
    return "no data" if value is None else fmt.format(value)


# --------------------------------------------------------------------------- 3. output length variance


def histogram_cv(buckets: Sequence[tuple[float, float]], mean: float) -> float | None:
    """Coefficient of variation estimated from cumulative histogram buckets and the exact mean.

    Each bucket's observations are placed at the bucket's midpoint (the +Inf bucket at its lower
    bound, which understates the spread); the mean comes from _sum/_count, so only the spread is
    approximated. None when the histogram is empty or the mean is not positive.
    """
    ordered = sorted(buckets)
    total = ordered[-1][1] if ordered else 0.0
    if total <= 0 or mean <= 0:
        return None
    variance = 0.0
    previous_bound, previous_cumulative = 0.0, 0.0
    for bound, cumulative in ordered:
        count = max(0.0, cumulative - previous_cumulative)
        point = previous_bound if math.isinf(bound) else (previous_bound + bound) / 2
        variance += count * (point - mean) ** 2
        previous_bound, previous_cumulative = (bound if not math.isinf(bound) else previous_bound), cumulative
    return math.sqrt(variance / total) / mean


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
    title = "Output length variance"
    seqs, seqs_source, seqs_patch = _max_num_seqs(spec)
    evidence: list[Evidence] = []
    if seqs is not None:
        evidence.append(Evidence(f"max-num-seqs {seqs}", seqs_source))
    cv: float | None = None
    if tel is not None:
        total, count = tel.output_tokens_sum_rate, tel.output_tokens_count_rate
        evidence.append(Evidence(f"output tokens/s {_fmt(total.value)}", _prom(total)))
        evidence.append(Evidence(f"requests/s {_fmt(count.value)}", _prom(count)))
        if total.value is not None and count.value:
            mean = total.value / count.value
            cv = histogram_cv(tel.output_tokens_buckets, mean)
            evidence.append(
                Evidence(
                    f"mean output {mean:.0f} tokens, coefficient of variation {_fmt(cv, '{:.2f}')}",
                    f"prometheus: {tel.output_tokens_buckets_query}",
                )
            )
    if seqs is not None and seqs < LOW_MAX_NUM_SEQS:
        spread = f" with output-length CV {cv:.2f}" if cv is not None else ""
        return QuestionResult(
            3,
            "output-variance",
            title,
            "problem",
            f"max-num-seqs {seqs} defeats continuous batching{spread}: short answers wait behind long ones",
            tuple(evidence),
            "remove the max-num-seqs override so vLLM's continuous batching can fill the batch",
            seqs_patch,
        )
    defaults = "continuous batching is on (vLLM's default) and nothing in the spec defeats it"
    if tel is None:
        return QuestionResult(3, "output-variance", title, "ok", inp.no_telemetry(defaults), tuple(evidence))
    if cv is None:
        return QuestionResult(
            3, "output-variance", title, "ok", f"no output-length data in the window; {defaults}", tuple(evidence)
        )
    spread = "high" if cv >= HIGH_OUTPUT_CV else "low"
    return QuestionResult(
        3, "output-variance", title, "ok", f"{spread} output-length variance (CV {cv:.2f}); {defaults}", tuple(evidence)
    )


# --------------------------------------------------------------------------- 4. KV fragmentation and pressure


def kv_pressure(inp: DiagnosisInput) -> QuestionResult:
    spec, tel = inp.spec, inp.telemetry
    title = "KV cache fragmentation and pressure"
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
        return QuestionResult(
            4,
            "kv-pressure",
            title,
            status,
            inp.no_telemetry("preemptions and KV usage unknown; paged attention is always on in vLLM"),
            tuple(evidence),
            "; ".join(settings_why) if status == "recommend" else "",
            {"engine": {"blockSize": 16}} if status == "recommend" else None,
        )
    pre, usage, waiting = tel.preemptions_rate, tel.kv_usage_max, tel.waiting_for_capacity
    target = spec.autoscaling.decode.kv_cache_usage
    evidence += [
        Evidence(f"preemptions {_fmt(pre.value)}/s", _prom(pre)),
        Evidence(f"KV cache usage {_fmt(usage.value, '{:.0%}')} (busiest worker)", _prom(usage)),
        Evidence(f"waiting for KV capacity {_fmt(waiting.value, '{:.2f}')}", _prom(waiting)),
    ]
    if not (pre.known or usage.known or waiting.known):
        return QuestionResult(4, "kv-pressure", title, "unknown", "no KV metrics in the window", tuple(evidence))
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
            return QuestionResult(
                4, "kv-pressure", title, "problem", verdict, tuple(evidence), "; ".join(settings_why), settings_patch
            )
        recommendation, patch = _more_decode_replicas(spec)
        return QuestionResult(4, "kv-pressure", title, "problem", verdict, tuple(evidence), recommendation, patch)
    if usage.value is not None and usage.value >= target:
        return QuestionResult(
            4,
            "kv-pressure",
            title,
            "ok",
            f"KV cache busy ({usage.value:.0%} >= target {target:.0%}) but no preemptions or capacity waits",
            tuple(evidence),
        )
    return QuestionResult(
        4, "kv-pressure", title, "ok", "no KV pressure: no preemptions or capacity waits", tuple(evidence)
    )


def _more_decode_replicas(spec: InferenceDeploymentSpec) -> tuple[str, Patch]:
    decode = spec.decode
    if spec.autoscaling.enabled:
        return (
            f"add decode capacity: the autoscaler is capped at decode.maxReplicas {decode.max_replicas}",
            {"decode": {"maxReplicas": decode.max_replicas + 1}},
        )
    replicas = decode.replicas + 1
    patch: Patch = {"decode": {"replicas": replicas}}
    if replicas > decode.max_replicas:
        patch["decode"]["maxReplicas"] = replicas
    return f"add a decode replica ({decode.replicas} -> {replicas})", patch


# --------------------------------------------------------------------------- 5. per-token latency


def per_token_latency(inp: DiagnosisInput) -> QuestionResult:
    spec, tel = inp.spec, inp.telemetry
    title = "Per-token latency"
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
        return QuestionResult(
            5,
            "per-token-latency",
            title,
            "unknown",
            inp.no_telemetry(f"inter-token latency vs SLO unknown; speculative decoding {spec_decode.method}{caveat}"),
            tuple(evidence),
        )
    itl, batch = tel.itl_p90, tel.running_per_replica
    evidence += [
        Evidence(f"ITL p90 {_fmt(itl.value and itl.value * 1000, '{:.1f}')} ms", _prom(itl)),
        Evidence(f"batch size {_fmt(batch.value, '{:.1f}')} (busiest worker)", _prom(batch)),
    ]
    if itl.value is None:
        return QuestionResult(
            5, "per-token-latency", title, "unknown", "no decode traffic in the window", tuple(evidence)
        )
    load = batch.value if batch.value is not None else 0.0
    high = load >= HIGH_LOAD_BATCH
    over = itl.value > slo
    if spec_decode.method != "off" and high:
        return QuestionResult(
            5,
            "per-token-latency",
            title,
            "recommend",
            f"speculative decoding on at high load (batch {load:.0f}): verification steps cost throughput",
            tuple(evidence),
            "turn speculative decoding off while the batch stays large",
            turn_off,
        )
    if over and spec_decode.method == "off" and load <= LOW_LOAD_BATCH:
        return QuestionResult(
            5,
            "per-token-latency",
            title,
            "recommend",
            f"ITL p90 {itl.value * 1000:.0f} ms over the {slo * 1000:.0f} ms SLO at low load (batch {load:.1f})",
            tuple(evidence),
            "turn on speculative decoding: ngram prompt lookup needs no extra model (or method draft with a small "
            "draft model of the same family)",
            turn_on,
        )
    if over:
        recommendation, patch = _lower_decode_batch(spec, itl.value, slo)
        return QuestionResult(
            5,
            "per-token-latency",
            title,
            "problem",
            f"ITL p90 {itl.value * 1000:.0f} ms over the {slo * 1000:.0f} ms SLO at batch {load:.1f}: "
            "too busy for speculative decoding to pay",
            tuple(evidence),
            recommendation,
            patch,
        )
    return QuestionResult(
        5,
        "per-token-latency",
        title,
        "ok",
        f"ITL p90 {itl.value * 1000:.0f} ms meets the {slo * 1000:.0f} ms SLO",
        tuple(evidence),
    )


def _lower_decode_batch(spec: InferenceDeploymentSpec, itl: float, slo: float) -> tuple[str, Patch]:
    if spec.autoscaling.enabled:
        current = spec.autoscaling.decode.running_per_replica
        target = max(1.0, math.floor(current * slo / itl))
        return (
            f"scale decode on a smaller batch: runningPerReplica {current:g} -> {target:g}",
            {"autoscaling": {"decode": {"runningPerReplica": target}}},
        )
    return _more_decode_replicas(spec)


# --------------------------------------------------------------------------- 6. disaggregation and scale


@dataclass(frozen=True)
class Capacity:
    prefill_tokens_per_s: float
    decode_tokens_per_s: float


def replica_capacity(
    parameters: float,
    weight_bytes: float,
    kv_bytes_per_token: float,
    tp: int,
    choice: GpuChoice,
    batch: float,
    context: float,
) -> Capacity:
    """Rough per-replica throughput: prefill is compute-bound, decode is bandwidth-bound.

    prefill tokens/s = TP x peak FLOPS x MFU / (2 x parameters);
    decode tokens/s = batch / step time, a step reading all weights plus the batch's KV cache.
    """
    gpu = choice.gpu
    prefill = tp * gpu.bf16_tflops * 1e12 * PREFILL_MFU / (2 * parameters)
    bytes_per_step = parameters * weight_bytes + batch * context * kv_bytes_per_token
    step_seconds = bytes_per_step / (tp * gpu.bandwidth_tbps * 1e12 * DECODE_BANDWIDTH_EFFICIENCY)
    return Capacity(prefill, batch / step_seconds)


def disaggregation(inp: DiagnosisInput) -> QuestionResult:
    spec, tel, facts = inp.spec, inp.telemetry, inp.facts
    title = "Prefill/decode interference and scale"
    evidence = [
        Evidence(
            f"mode {spec.mode}, {spec.prefill.replicas} prefill / {spec.decode.replicas} decode replicas",
            "spec",
        )
    ]
    if tel is None:
        return QuestionResult(
            6,
            "disaggregation",
            title,
            "unknown",
            inp.no_telemetry(f"traffic unknown; serving {spec.mode}"),
            tuple(evidence),
        )
    rate, prompt_rate, gen_rate = tel.request_rate, tel.prompt_tokens_rate, tel.generation_tokens_rate
    ttft, prefill_time = tel.ttft_p90, tel.prefill_time_p90
    evidence += [
        Evidence(f"requests {_fmt(rate.value)}/s", _prom(rate)),
        Evidence(f"prompt tokens {_fmt(prompt_rate.value)}/s", _prom(prompt_rate)),
        Evidence(f"generated tokens {_fmt(gen_rate.value)}/s", _prom(gen_rate)),
        Evidence(f"TTFT p90 {_fmt(ttft.value)} s", _prom(ttft)),
        Evidence(f"prefill time p90 {_fmt(prefill_time.value)} s", _prom(prefill_time)),
    ]
    if rate.value is None or rate.value < MIN_REQUEST_RATE or prompt_rate.value is None or gen_rate.value is None:
        return QuestionResult(6, "disaggregation", title, "unknown", "no traffic in the window", tuple(evidence))
    mean_prompt = prompt_rate.value / rate.value
    mean_output = gen_rate.value / rate.value
    inflation = ttft.value / prefill_time.value if ttft.value and prefill_time.value else None
    evidence.append(
        Evidence(
            f"mean prompt {mean_prompt:.0f} tokens, mean output {mean_output:.0f} tokens, "
            f"TTFT inflation {_fmt(inflation, '{:.1f}x')}",
            "derived",
        )
    )
    needs = _needed_replicas(inp, prompt_rate.value, gen_rate.value, mean_prompt + mean_output / 2)
    if needs is None:
        capacity_note = "per-replica capacity unknown (parameter count unknown)"
        evidence.append(Evidence(capacity_note, "model config"))
    else:
        evidence.append(
            Evidence(
                f"needed at {_pct(CAPACITY_HEADROOM)} load: {needs[0]:.2f} prefill, {needs[1]:.2f} decode replicas "
                f"(estimated {needs[2].prefill_tokens_per_s:,.0f} prefill / {needs[2].decode_tokens_per_s:,.0f} "
                "decode tokens/s per replica)",
                f"estimate from GPU {inp.gpus['decode'].gpu.name} datasheet and {facts.parameter_source}",
            )
        )
    long_prompts = mean_prompt >= max(1, spec.router.disaggregation_threshold_tokens)
    interfering = inflation is not None and inflation >= TTFT_INFLATION
    if spec.mode is Mode.AGGREGATED:
        busy = needs is None or needs[0] + needs[1] >= 1.0
        if interfering and long_prompts and busy:
            patch: Patch = {"mode": Mode.DISAGGREGATED.value}
            if spec.kv_transfer.connector.value == "None":
                patch["kvTransfer"] = {"connector": "NixlConnector"}
            if needs is not None:
                patch = merge_patches(patch, _ratio_patch(spec, needs[0], needs[1])) or patch
            return QuestionResult(
                6,
                "disaggregation",
                title,
                "recommend",
                f"prefill/decode interference: TTFT p90 is {inflation:.1f}x the prefill time with "
                f"{mean_prompt:.0f}-token prompts",
                tuple(evidence),
                "disaggregate: prefill and decode in separate pools, scaled independently",
                patch,
            )
        return QuestionResult(
            6,
            "disaggregation",
            title,
            "ok",
            f"aggregated is enough (TTFT inflation {_fmt(inflation, '{:.1f}x')}, mean prompt {mean_prompt:.0f} tokens)",
            tuple(evidence),
        )
    if needs is not None and needs[0] + needs[1] < 1.0 and not interfering:
        return QuestionResult(
            6,
            "disaggregation",
            title,
            "recommend",
            f"traffic fits one aggregated replica ({needs[0] + needs[1]:.2f} replicas of work): "
            "disaggregation only adds a KV hop and idle GPUs",
            tuple(evidence),
            "serve aggregated until traffic grows",
            {"mode": Mode.AGGREGATED.value},
        )
    if needs is None:
        return QuestionResult(
            6, "disaggregation", title, "ok", "disaggregated; prefill:decode ratio not estimated", tuple(evidence)
        )
    needed_ratio = needs[0] / needs[1] if needs[1] > 0 else math.inf
    if spec.autoscaling.enabled:
        bounds_patch = _ratio_patch(spec, needs[0], needs[1])
        if not bounds_patch:
            return QuestionResult(
                6,
                "disaggregation",
                title,
                "ok",
                f"disaggregated; the autoscaler sets the pools (needed prefill:decode {needed_ratio:.2f})",
                tuple(evidence),
            )
        return QuestionResult(
            6,
            "disaggregation",
            title,
            "recommend",
            f"needed prefill:decode ratio {needed_ratio:.2f} lies outside autoscaling.prefillDecodeRatio",
            tuple(evidence),
            "widen the autoscaler's prefill:decode ratio bounds",
            bounds_patch,
        )
    current_ratio = spec.prefill.replicas / spec.decode.replicas if spec.decode.replicas else math.inf
    evidence.append(Evidence(f"prefill:decode needed {needed_ratio:.2f}, current {current_ratio:.2f}", "derived"))
    off = max(needed_ratio, current_ratio) / max(min(needed_ratio, current_ratio), 1e-9)
    if off <= RATIO_MISMATCH:
        return QuestionResult(
            6,
            "disaggregation",
            title,
            "ok",
            f"disaggregated with a fitting prefill:decode ratio ({current_ratio:.2f}, needed {needed_ratio:.2f})",
            tuple(evidence),
        )
    return QuestionResult(
        6,
        "disaggregation",
        title,
        "recommend",
        f"prefill:decode ratio {current_ratio:.2f} but traffic needs {needed_ratio:.2f}",
        tuple(evidence),
        "rebalance the pools to the traffic's prefill:decode ratio",
        _ratio_patch(spec, needs[0], needs[1]),
    )


def _needed_replicas(
    inp: DiagnosisInput, prompt_rate: float, gen_rate: float, context: float
) -> tuple[float, float, Capacity] | None:
    spec, facts, tel = inp.spec, inp.facts, inp.telemetry
    if facts.parameter_count is None or facts.kv_shape is None:
        return None
    pool = spec.decode
    prec = precision(spec, facts, pool_args(spec, pool))
    capacity = replica_capacity(
        facts.parameter_count,
        prec.weight_bytes,
        facts.kv_shape.bytes_per_token(prec.kv_bytes),
        pool.tensor_parallel_size,
        inp.gpus["decode"],
        spec.autoscaling.decode.running_per_replica,
        context,
    )
    hit_share = 0.0
    if tel is not None and tel.prefix_hits_rate.value is not None and tel.prefix_queries_rate.value:
        hit_share = min(1.0, tel.prefix_hits_rate.value / tel.prefix_queries_rate.value)
    computed_prompt = prompt_rate * (1 - hit_share)  # cached prefix tokens cost no prefill compute
    prefill = computed_prompt / (capacity.prefill_tokens_per_s * CAPACITY_HEADROOM)
    decode = gen_rate / (capacity.decode_tokens_per_s * CAPACITY_HEADROOM)
    return prefill, decode, capacity


def _ratio_patch(spec: InferenceDeploymentSpec, prefill: float, decode: float) -> Patch:
    prefill_replicas = max(1, math.ceil(prefill))
    decode_replicas = max(1, math.ceil(decode))
    if spec.autoscaling.enabled:
        ratio = prefill_replicas / decode_replicas
        bounds = spec.autoscaling.prefill_decode_ratio
        if bounds is None or bounds.min <= ratio <= bounds.max:
            return {}
        return {"autoscaling": {"prefillDecodeRatio": {"min": min(bounds.min, ratio), "max": max(bounds.max, ratio)}}}
    patch: Patch = {}
    for name, replicas, pool in (("prefill", prefill_replicas, spec.prefill), ("decode", decode_replicas, spec.decode)):
        entry: dict[str, int] = {"replicas": replicas}
        if replicas > pool.max_replicas:
            entry["maxReplicas"] = replicas
        patch[name] = entry
    return patch


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
    return [question(inp) for question in QUESTIONS]
