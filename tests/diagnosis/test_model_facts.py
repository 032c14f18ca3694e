from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from splitserve.diagnosis.model_facts import (
    KV_SHAPE_BY_SIZE,
    heuristic_kv_shape,
    model_facts,
    parameter_count_from_name,
    parameters_from_config,
)
from tests.diagnosis.conftest import LLAMA_8B, LLAMA_70B, SpecFactory


@pytest.mark.parametrize(
    ("config", "billions"),
    [(LLAMA_8B, 8.03), (LLAMA_70B, 70.55)],
)
def test_parameter_count_from_llama_configs_matches_published_sizes(config: dict[str, Any], billions: float) -> None:
    count, shape, heads = parameters_from_config(config)
    assert count / 1e9 == pytest.approx(billions, abs=0.01)
    assert (shape.layers, shape.kv_heads, shape.head_dim) == (config["num_hidden_layers"], 8, 128)
    assert heads == config["num_attention_heads"]


def test_kv_bytes_per_token_of_llama_8b_bf16_is_128_kib() -> None:
    _, shape, _ = parameters_from_config(LLAMA_8B)
    assert shape.bytes_per_token(2) == 128 * 1024


def test_tied_embeddings_and_mixture_of_experts_change_the_count() -> None:
    tied, _, _ = parameters_from_config({**LLAMA_8B, "tie_word_embeddings": True})
    dense, _, _ = parameters_from_config(LLAMA_8B)
    assert dense - tied == LLAMA_8B["vocab_size"] * LLAMA_8B["hidden_size"]
    mixtral = {**LLAMA_8B, "intermediate_size": 14336, "num_local_experts": 8, "vocab_size": 32000}
    moe, _, _ = parameters_from_config(mixtral)
    assert moe > 5 * dense


def test_missing_sizes_raise_key_error() -> None:
    with pytest.raises(KeyError):
        parameters_from_config({"hidden_size": 10})


@pytest.mark.parametrize(
    ("name", "count"),
    [
        ("meta-llama/Llama-3.1-70B-Instruct", 70e9),
        ("Qwen/Qwen2.5-0.5B", 0.5e9),
        ("mistralai/Mixtral-8x7B-v0.1", 56e9),
        ("facebook/opt-125m", 125e6),
        ("my-model", None),
        ("llama-3.1", None),
    ],
)
def test_parameter_count_from_name(name: str, count: float | None) -> None:
    assert parameter_count_from_name(name) == count


@given(st.floats(min_value=1e6, max_value=2e12))
def test_heuristic_kv_shape_grows_with_model_size(count: float) -> None:
    smaller = heuristic_kv_shape(count / 4)
    assert heuristic_kv_shape(count).layers >= smaller.layers
    assert heuristic_kv_shape(count) in [shape for _, shape in KV_SHAPE_BY_SIZE]


def test_facts_from_local_uri_config(make_spec: SpecFactory, model_dir: Callable[[dict[str, Any]], Path]) -> None:
    directory = model_dir(LLAMA_8B)
    facts = model_facts(make_spec({"model": {"source": {"uri": str(directory)}}}), cache_dirs=[])
    assert facts.parameter_count is not None and facts.parameter_count / 1e9 == pytest.approx(8.03, abs=0.01)
    assert facts.parameter_source.startswith("model config")
    assert facts.max_position_embeddings == 131072
    assert facts.config_dtype == "bfloat16"


def test_hugging_face_repo_without_network_is_not_reachable_and_falls_back(
    make_spec: SpecFactory, tmp_path: Path
) -> None:
    spec = make_spec(
        {"model": {"name": "chat", "source": {"uri": None, "huggingFace": {"repo": "meta-llama/Llama-3.1-70B"}}}}
    )
    facts = model_facts(spec, cache_dirs=[tmp_path])
    assert "not reachable" in facts.config_note
    assert facts.parameter_count == 70e9
    assert "name" in facts.parameter_source
    assert facts.kv_shape is not None and facts.kv_shape.layers == 80
    assert "heuristic" in facts.kv_source


def test_hugging_face_cache_snapshot_is_read(make_spec: SpecFactory, tmp_path: Path) -> None:
    repo_dir = tmp_path / "models--org--tiny"
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text("abc123\n")
    (repo_dir / "snapshots" / "abc123").mkdir(parents=True)
    (repo_dir / "snapshots" / "abc123" / "config.json").write_text(json.dumps(LLAMA_8B))
    spec = make_spec({"model": {"source": {"uri": None, "huggingFace": {"repo": "org/tiny"}}}})
    facts = model_facts(spec, cache_dirs=[tmp_path])
    assert facts.parameter_source.startswith("model config")


def test_declared_parameter_count_wins_over_the_name(make_spec: SpecFactory) -> None:
    spec = make_spec({"model": {"name": "llama-70b", "parameterCount": 8_000_000_000}})
    facts = model_facts(spec, cache_dirs=[])
    assert facts.parameter_count == 8e9
    assert facts.parameter_source == "spec (model.parameterCount)"


def test_nothing_known_gives_unknown_facts(make_spec: SpecFactory) -> None:
    facts = model_facts(make_spec({"model": {"name": "mystery"}}), cache_dirs=[])
    assert facts.parameter_count is None and facts.kv_shape is None
    assert "not on this machine" in facts.config_note


def test_broken_config_json_is_reported(make_spec: SpecFactory, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    facts = model_facts(make_spec({"model": {"parameterCount": 1_000_000_000}}), model_dir=str(tmp_path), cache_dirs=[])
    assert facts.parameter_count == 1e9
    assert str(tmp_path) in facts.config_note
