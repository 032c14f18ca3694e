"""Question 1: does the model fit the GPU, and if not, what would."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.diagnosis.gpus import GPU_TABLE
from splitserve.diagnosis.model_facts import KvShape, ModelFacts
from splitserve.diagnosis.questions import hardware_fit
from splitserve.diagnosis.sizing import TIGHT_WEIGHT_SHARE, estimate_fit
from tests.diagnosis.conftest import LLAMA_8B, LLAMA_70B, InputFactory, SpecFactory, patched

ModelDir = Callable[[dict[str, Any]], Path]


def _spec_for(make_spec: SpecFactory, directory: Path, extra: dict[str, Any] | None = None) -> Any:
    return make_spec({"model": {"source": {"uri": str(directory)}, "dtype": "bfloat16", **(extra or {})}})


def test_70b_bf16_on_one_80gb_gpu_does_not_fit_and_is_told_what_would(
    make_spec: SpecFactory, make_input: InputFactory, model_dir: ModelDir
) -> None:
    spec = _spec_for(make_spec, model_dir(LLAMA_70B), {"maxModelLen": 32768})
    result = hardware_fit(make_input(spec, gpu="H100-80GB"))

    assert result.status == "problem"
    assert result.verdict.startswith("does not fit")
    descriptions = [alternative.description for alternative in result.alternatives]
    # fp8 at TP 1 is still over 90% of the budget, so fp8 needs TP 2; bf16 at TP 2 is tight too, so TP 4.
    assert descriptions[0].startswith("fp8 weights at TP 2")
    assert descriptions[1].startswith("TP 4 (bfloat16)")
    assert all("KV cache" in d and "tokens" in d for d in descriptions)
    assert result.patch == {
        "model": {"quantization": "fp8"},
        "prefill": {"tensorParallelSize": 2, "resources": {"gpus": 2}},
        "decode": {"tensorParallelSize": 2, "resources": {"gpus": 2}},
    }
    assert "fp8 weights at TP 2" in result.recommendation and "TP 4" in result.recommendation
    assert any("model config" in e.source for e in result.evidence)


def test_every_fit_alternative_really_fits_when_applied(
    make_spec: SpecFactory, make_input: InputFactory, model_dir: ModelDir
) -> None:
    spec = _spec_for(make_spec, model_dir(LLAMA_70B), {"maxModelLen": 32768})
    result = hardware_fit(make_input(spec))
    assert len(result.alternatives) == 2
    for alternative in result.alternatives:
        after = hardware_fit(make_input(patched(spec, alternative.patch)))
        assert after.status == "ok", (alternative.description, after.verdict)
        assert after.verdict.startswith("fits")


def test_8b_bf16_on_one_80gb_gpu_fits_with_room_for_kv(
    make_spec: SpecFactory, make_input: InputFactory, model_dir: ModelDir
) -> None:
    spec = _spec_for(make_spec, model_dir(LLAMA_8B))
    result = hardware_fit(make_input(spec, gpu="A100-80GB"))
    assert result.status == "ok"
    assert result.verdict.startswith("fits")
    assert result.patch is None
    # 80 GiB x 0.9 - 15 GiB weights - 2 GiB overhead = 55 GiB of KV at 128 KiB/token: ~450k tokens.
    fit_line = next(e.text for e in result.evidence if e.text.startswith("decode:"))
    assert "KV cache 45" in fit_line and "128 KiB/token" in fit_line


def test_70b_fp8_on_one_gpu_is_tight(make_spec: SpecFactory, make_input: InputFactory, model_dir: ModelDir) -> None:
    spec = _spec_for(make_spec, model_dir(LLAMA_70B), {"quantization": "fp8", "maxModelLen": 8192})
    result = hardware_fit(make_input(spec, gpu="H100-80GB"))
    assert result.verdict.startswith("tight")
    assert result.patch is not None and result.patch["decode"]["tensorParallelSize"] == 2
    assert "quantization" not in result.patch.get("model", {})


def test_70b_awq_fits_one_gpu(make_spec: SpecFactory, make_input: InputFactory, model_dir: ModelDir) -> None:
    spec = _spec_for(make_spec, model_dir(LLAMA_70B), {"quantization": "awq", "maxModelLen": 8192})
    assert hardware_fit(make_input(spec, gpu="H100-80GB")).status == "ok"


def test_kv_shorter_than_max_model_len_offers_a_shorter_context_first(
    make_spec: SpecFactory, make_input: InputFactory, model_dir: ModelDir
) -> None:
    spec = _spec_for(make_spec, model_dir(LLAMA_8B))  # config's 131072-token context on a 24 GB L4
    result = hardware_fit(make_input(spec, gpu="L4"))
    assert result.verdict.startswith("tight")
    assert "less than one 131072-token sequence" in result.verdict
    assert result.patch is not None and set(result.patch) == {"model"}
    max_len = result.patch["model"]["maxModelLen"]
    assert 1024 <= max_len < 131072 and max_len % 1024 == 0
    assert hardware_fit(make_input(patched(spec, result.patch), gpu="L4")).status == "ok"


def test_gpu_from_node_selector_and_default_assumption_are_evidence(
    make_spec: SpecFactory, make_input: InputFactory, model_dir: ModelDir
) -> None:
    directory = model_dir(LLAMA_8B)
    on_h200 = _spec_for(make_spec, directory).model_copy()
    selector = {"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"}}
    spec = make_spec({"model": {"source": {"uri": str(directory)}}, "prefill": selector, "decode": selector})
    result = hardware_fit(make_input(spec, gpu=None))
    assert any("H200" in e.text and "nodeSelector" in e.source for e in result.evidence)
    assumed = hardware_fit(make_input(on_h200, gpu=None))
    assert any("assuming H100-80GB" in e.source for e in assumed.evidence)


def test_aggregated_mode_checks_only_the_serving_pool(
    make_spec: SpecFactory, make_input: InputFactory, model_dir: ModelDir
) -> None:
    directory = model_dir(LLAMA_70B)
    spec = make_spec(
        {
            "model": {"source": {"uri": str(directory)}, "maxModelLen": 8192},
            "mode": "aggregated",
            "decode": {"tensorParallelSize": 4, "resources": {"gpus": 4}},
        }
    )
    result = hardware_fit(make_input(spec))
    assert result.status == "ok"
    assert not any(e.text.startswith("prefill") for e in result.evidence)


def test_unknown_parameter_count_is_unknown_not_a_guess(make_spec: SpecFactory, make_input: InputFactory) -> None:
    result = hardware_fit(make_input(make_spec({"model": {"name": "mystery"}})))
    assert result.status == "unknown"
    assert "parameterCount" in result.recommendation


def test_nothing_fits_says_so_without_a_patch(make_spec: SpecFactory, make_input: InputFactory) -> None:
    spec = make_spec({"model": {"name": "huge", "parameterCount": 2_000_000_000_000}})
    result = hardware_fit(make_input(spec, gpu="L4"))
    assert result.status == "problem" and result.patch is None
    assert "pipeline parallelism" in result.recommendation


@settings(max_examples=60, deadline=None)
@given(
    params=st.floats(min_value=5e8, max_value=1e12),
    tp=st.sampled_from([1, 2, 4, 8]),
    gpu=st.sampled_from(GPU_TABLE),
    util=st.floats(min_value=0.5, max_value=0.95),
)
def test_fit_state_agrees_with_its_numbers(params: float, tp: int, gpu: Any, util: float) -> None:
    fit = estimate_fit(params, 2.0, 131072.0, tp, gpu.memory_gib, util, None)
    if fit.state == "fits":
        assert fit.weight_share < TIGHT_WEIGHT_SHARE and fit.kv_tokens > 0
    elif fit.state == "does not fit":
        assert fit.kv_tokens == 0
    more_tp = estimate_fit(params, 2.0, 131072.0, tp * 2, gpu.memory_gib, util, None)
    assert more_tp.weights_per_gpu_gib < fit.weights_per_gpu_gib
    assert more_tp.kv_tokens >= fit.kv_tokens


def test_heuristic_kv_when_only_parameter_count_is_declared(make_spec: SpecFactory, make_input: InputFactory) -> None:
    facts = ModelFacts(8e9, "spec (model.parameterCount)", KvShape(32, 8, 128), "heuristic")
    result = hardware_fit(make_input(make_spec(), facts=facts))
    assert result.status == "ok"
    assert any(e.source.endswith("heuristic") for e in result.evidence)


@pytest.mark.parametrize(("quantization", "ok"), [("none", False), ("fp8", False), ("gptq", True)])
def test_quantization_shrinks_weights(
    make_spec: SpecFactory, make_input: InputFactory, quantization: str, ok: bool
) -> None:
    spec = make_spec({"model": {"name": "m-70b", "quantization": quantization, "maxModelLen": 4096}})
    assert (hardware_fit(make_input(spec)).status == "ok") is ok


def test_a_draft_model_counts_against_memory(make_spec: SpecFactory, make_input: InputFactory) -> None:
    base = {"model": {"name": "m", "parameterCount": 30_000_000_000, "maxModelLen": 4096}, "mode": "aggregated"}
    alone = hardware_fit(make_input(make_spec(base), gpu="A100-80GB"))
    draft = {"engine": {"speculativeDecoding": {"method": "draft", "draftModel": "org/helper-8B"}}}
    with_draft = hardware_fit(make_input(make_spec({**base, **draft}), gpu="A100-80GB"))
    assert alone.status == "ok"
    # 38B parameters in 16 bit: 70.8 GiB of weights + 2 GiB overhead > 72 GiB (80 GiB x 0.9).
    assert with_draft.verdict.startswith("does not fit")
    assert "70.8 GiB/GPU + 2 GiB runtime overhead exceed the 72.0 GiB budget" in with_draft.verdict
    assert any("draft model adds 8.00B" in e.text for e in with_draft.evidence)
