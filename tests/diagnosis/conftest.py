"""Fixtures for the diagnosis tests: spec factories, model configs on disk, a fake Prometheus."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from splitserve.api.patch import merge_patch
from splitserve.api.spec import InferenceDeploymentSpec
from splitserve.diagnosis.findings import DiagnosisInput
from splitserve.diagnosis.gpus import GpuChoice, choose_gpu
from splitserve.diagnosis.model_facts import ModelFacts, model_facts
from splitserve.diagnosis.telemetry import Telemetry
from splitserve.io.prometheus import PrometheusUnavailable

LLAMA_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
LLAMA_70B: dict[str, Any] = {
    **LLAMA_8B,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
}


def deep_merge(base: dict[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in patch.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


SpecFactory = Callable[..., InferenceDeploymentSpec]


@pytest.fixture
def make_spec() -> SpecFactory:
    """make_spec({"engine": {...}}) -> a validated spec; the model defaults to a local URI."""

    def build(overrides: Mapping[str, Any] | None = None) -> InferenceDeploymentSpec:
        base: dict[str, Any] = {"model": {"name": "m", "source": {"uri": "/nonexistent/model"}}}
        return InferenceDeploymentSpec.model_validate(deep_merge(base, overrides or {}))

    return build


@pytest.fixture
def model_dir(tmp_path: Path) -> Callable[[dict[str, Any]], Path]:
    def write(config: dict[str, Any]) -> Path:
        directory = tmp_path / f"model-{config['hidden_size']}-{config['num_hidden_layers']}"
        directory.mkdir(exist_ok=True)
        (directory / "config.json").write_text(json.dumps(config))
        return directory

    return write


InputFactory = Callable[..., DiagnosisInput]


@pytest.fixture
def make_input(tmp_path: Path) -> InputFactory:
    """DiagnosisInput for a spec: facts read as the CLI would (no HF cache), GPU from --gpu or the spec."""

    def build(
        spec: InferenceDeploymentSpec,
        *,
        gpu: str | None = "H100-80GB",
        telemetry: Telemetry | None = None,
        facts: ModelFacts | None = None,
    ) -> DiagnosisInput:
        gpus: dict[str, GpuChoice] = {
            "prefill": choose_gpu(gpu, spec.prefill.node_selector),
            "decode": choose_gpu(gpu, spec.decode.node_selector),
        }
        return DiagnosisInput(
            spec=spec,
            facts=facts or model_facts(spec, cache_dirs=[tmp_path / "no-hf-cache"]),
            gpus=gpus,
            telemetry=telemetry,
            telemetry_note="test" if telemetry is not None else "no --prometheus given",
        )

    return build


class FakePrometheus:
    """Answers queries by the first metric name (a key) the PromQL text contains; records every query."""

    def __init__(
        self,
        scalars: Mapping[str, float | None] | None = None,
        buckets: Mapping[float, float] | None = None,
        *,
        vectors: Mapping[str, Mapping[frozenset[tuple[str, str]], float]] | None = None,
        down: bool = False,
    ) -> None:
        self.scalars = dict(scalars or {})
        self.buckets = dict(buckets or {})
        self.vectors = dict(vectors or {})  # vector answers by the first metric name the PromQL contains
        self.down = down
        self.queries: list[str] = []

    async def query_scalar(self, promql: str) -> float | None:
        self.queries.append(promql)
        if self.down:
            raise PrometheusUnavailable("cannot reach Prometheus at http://fake: connection refused")
        if promql == "vector(1)":
            return 1.0
        for key, value in self.scalars.items():
            if key in promql:
                return value
        return None

    async def query_vector(self, promql: str) -> dict[frozenset[tuple[str, str]], float]:
        self.queries.append(promql)
        if self.down:
            raise PrometheusUnavailable("down")
        for key, answer in self.vectors.items():
            if key in promql:
                return dict(answer)
        if "_bucket" not in promql:
            return {}
        return {
            frozenset({("le", "+Inf" if bound == float("inf") else repr(float(bound)))}): value
            for bound, value in self.buckets.items()
        }


@pytest.fixture
def fake_prometheus() -> Callable[..., FakePrometheus]:
    return FakePrometheus


def patched(spec: InferenceDeploymentSpec, patch: Mapping[str, Any] | None) -> InferenceDeploymentSpec:
    """The spec after a recommendation's patch, validated again (a patch must keep the spec valid)."""
    return InferenceDeploymentSpec.model_validate(merge_patch(spec.to_wire(), patch or {}))
