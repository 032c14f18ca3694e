"""A table of common accelerators and how to recognise them from a Kubernetes node selector.

Memory is in GiB (2**30 bytes) as the driver reports the device's total (`nvidia-smi`'s MiB / 1024),
not the marketing GB: an "80GB" H100 shows 81559 MiB = 79.6 GiB, and that is what vLLM's
`gpu_memory_utilization` is a fraction of. Compute (dense 16-bit tensor TFLOPS) and memory
bandwidth (TB/s) are datasheet figures used only for planning estimates (prefill:decode ratio);
they are order-of-magnitude numbers, not benchmarks.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

GIB = 2**30


@dataclass(frozen=True)
class GpuType:
    name: str
    memory_gib: float
    bf16_tflops: float
    bandwidth_tbps: float
    native_fp8: bool
    # Normalised substrings (upper case, letters and digits only) that identify this GPU in a
    # node label value; checked in table order, so more specific entries come first.
    patterns: tuple[str, ...]

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB


GPU_TABLE: tuple[GpuType, ...] = (
    GpuType("GH200", 95.0, 989, 4.0, True, ("GH200",)),
    GpuType("H200", 140.4, 989, 4.8, True, ("H200",)),
    GpuType("H100-94GB", 93.6, 989, 3.9, True, ("H100NVL", "H10094GB", "H100PCIE94GB")),
    GpuType("H100-80GB", 79.6, 989, 3.35, True, ("H100",)),
    GpuType("B200", 179.1, 2250, 8.0, True, ("B200",)),
    GpuType("A100-80GB", 80.0, 312, 2.0, False, ("A10080GB", "A100SXM480GB", "A100PCIE80GB")),
    GpuType("A100-40GB", 40.0, 312, 1.55, False, ("A100",)),
    GpuType("L40S", 45.0, 362, 0.86, True, ("L40S",)),
    GpuType("L40", 45.0, 181, 0.86, True, ("L40",)),
    GpuType("L4", 22.5, 121, 0.3, True, ("L4",)),
    GpuType("A10G", 22.5, 70, 0.6, False, ("A10G",)),
    GpuType("A10", 22.5, 125, 0.6, False, ("A10",)),
    GpuType("RTX-4090", 24.0, 165, 1.0, True, ("4090",)),
    GpuType("V100-32GB", 32.0, 125, 0.9, False, ("V10032GB", "V100SXM232GB")),
    GpuType("V100-16GB", 16.0, 125, 0.9, False, ("V100",)),
    GpuType("T4", 15.0, 65, 0.32, False, ("T4",)),
    GpuType("MI325X", 256.0, 1307, 6.0, True, ("MI325X",)),
    GpuType("MI300X", 191.7, 1307, 5.3, True, ("MI300X",)),
)

DEFAULT_GPU = "H100-80GB"

# Node labels that name the GPU model, in the order they are trusted.
PRODUCT_LABELS = (
    "nvidia.com/gpu.product",  # NVIDIA GPU feature discovery, e.g. NVIDIA-H100-80GB-HBM3
    "cloud.google.com/gke-accelerator",  # GKE, e.g. nvidia-h100-80gb
    "karpenter.k8s.aws/instance-gpu-name",  # EKS/Karpenter, e.g. a10g
    "amd.com/gpu.product-name",  # AMD device plugin labeller, e.g. AMD_Instinct_MI300X
    "node.kubernetes.io/instance-type",  # last resort: only helps when the type names the GPU
)
# GPU feature discovery also publishes the exact memory in MiB; when present it wins over the table.
MEMORY_LABEL = "nvidia.com/gpu.memory"


class UnknownGpu(ValueError):
    """An --gpu value that is not in the table."""


@dataclass(frozen=True)
class GpuChoice:
    """The GPU a pool is assumed to run on, and why we think so."""

    gpu: GpuType
    source: str
    assumed: bool = False


def _normalise(text: str) -> str:
    return re.sub(r"[^A-Z0-9]", "", text.upper())


def find_gpu(text: str) -> GpuType | None:
    """The table entry a name or label value refers to ('h100', 'NVIDIA-A100-SXM4-80GB'), or None."""
    key = _normalise(text)
    if not key:
        return None
    for gpu in GPU_TABLE:
        if key == _normalise(gpu.name):
            return gpu
    for gpu in GPU_TABLE:
        if any(pattern in key for pattern in gpu.patterns):
            return gpu
    return None


def known_gpu_names() -> list[str]:
    return [gpu.name for gpu in GPU_TABLE]


def choose_gpu(override: str | None, node_selector: Mapping[str, str]) -> GpuChoice:
    """--gpu if given, else the pool's node selector, else the default (marked as assumed).

    Raises UnknownGpu for an --gpu value that is not in the table: a typo must not silently
    fall back to a default GPU.
    """
    if override:
        gpu = find_gpu(override)
        if gpu is None:
            raise UnknownGpu(f"unknown GPU type {override!r}; known: {', '.join(known_gpu_names())}")
        return GpuChoice(gpu, f"--gpu {override}")
    for label in PRODUCT_LABELS:
        value = node_selector.get(label)
        gpu = find_gpu(value) if value else None
        if gpu is None:
            continue
        memory_mib = node_selector.get(MEMORY_LABEL, "")
        if memory_mib.isdigit():
            gpu = _with_memory(gpu, int(memory_mib) / 1024)
            return GpuChoice(gpu, f"nodeSelector {label}={value}, {MEMORY_LABEL}={memory_mib}")
        return GpuChoice(gpu, f"nodeSelector {label}={value}")
    default = find_gpu(DEFAULT_GPU)
    assert default is not None  # the table holds the default by construction
    return GpuChoice(default, f"GPU type unknown (no --gpu, no GPU node selector): assuming {DEFAULT_GPU}", True)


def _with_memory(gpu: GpuType, memory_gib: float) -> GpuType:
    return GpuType(gpu.name, memory_gib, gpu.bf16_tflops, gpu.bandwidth_tbps, gpu.native_fp8, gpu.patterns)
