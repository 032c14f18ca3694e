from __future__ import annotations

import pytest

from splitserve.diagnosis.gpus import DEFAULT_GPU, GPU_TABLE, UnknownGpu, choose_gpu, find_gpu


@pytest.mark.parametrize(
    ("label", "expected"),
    [
        ("NVIDIA-H100-80GB-HBM3", "H100-80GB"),
        ("NVIDIA-H100-NVL", "H100-94GB"),
        ("NVIDIA-H200", "H200"),
        ("NVIDIA-GH200-480GB", "GH200"),
        ("NVIDIA-A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA-A100-SXM4-40GB", "A100-40GB"),
        ("nvidia-tesla-a100", "A100-40GB"),
        ("nvidia-a100-80gb", "A100-80GB"),
        ("NVIDIA-A10G", "A10G"),
        ("nvidia-l4", "L4"),
        ("NVIDIA-L40S", "L40S"),
        ("Tesla-T4", "T4"),
        ("NVIDIA-B200", "B200"),
        ("AMD_Instinct_MI300X", "MI300X"),
        ("h100", "H100-80GB"),
        ("NVIDIA-GeForce-RTX-4090", "RTX-4090"),
    ],
)
def test_find_gpu_recognises_node_label_values(label: str, expected: str) -> None:
    gpu = find_gpu(label)
    assert gpu is not None and gpu.name == expected


def test_unknown_names_are_not_guessed() -> None:
    assert find_gpu("quantum-abacus") is None
    assert find_gpu("") is None


def test_every_table_name_finds_itself() -> None:
    for gpu in GPU_TABLE:
        assert find_gpu(gpu.name) == gpu


def test_override_beats_node_selector_and_bad_override_is_an_error() -> None:
    choice = choose_gpu("L4", {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"})
    assert choice.gpu.name == "L4" and not choice.assumed
    with pytest.raises(UnknownGpu):
        choose_gpu("H1OO", {})


def test_node_selector_with_gpu_memory_label_uses_exact_memory() -> None:
    choice = choose_gpu(None, {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.memory": "81559"})
    assert choice.gpu.memory_gib == pytest.approx(79.65, abs=0.01)
    assert "nvidia.com/gpu.product" in choice.source


def test_no_selector_assumes_the_default_and_says_so() -> None:
    choice = choose_gpu(None, {"kubernetes.io/arch": "amd64"})
    assert choice.assumed and choice.gpu.name == DEFAULT_GPU
    assert "assuming" in choice.source
