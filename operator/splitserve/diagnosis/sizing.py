"""Back-of-the-envelope physics and statistics behind the verdicts (pure functions).

Memory fit: weights per GPU against vLLM's budget and the KV cache left over. Throughput: prefill is
compute-bound, decode is bandwidth-bound. Output-length spread from histogram buckets.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from splitserve.api.spec import InferenceDeploymentSpec
from splitserve.diagnosis.findings import arg_value
from splitserve.diagnosis.gpus import GIB, GpuChoice
from splitserve.diagnosis.model_facts import ModelFacts

TIGHT_WEIGHT_SHARE = 0.90  # weights at or above this share of vLLM's memory budget leave the KV cache no room
RUNTIME_OVERHEAD_GIB = 2.0  # per GPU inside vLLM's budget: activations, CUDA graphs, non-torch allocations
PREFILL_MFU = 0.4  # share of peak FLOPS a prefill achieves
DECODE_BANDWIDTH_EFFICIENCY = 0.6  # share of peak HBM bandwidth a decode step achieves

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
