"""What the diagnosis knows about the model: parameter count and the shape of its KV cache.

The best source is the model's own `config.json`, read when the model is on this machine (a local
directory in `model.source.uri`, `--model-dir`, or a Hugging Face cache snapshot). There is no network
access: a Hugging Face repository that is not cached is reported as not reachable. The fallbacks,
in order, are `spec.model.parameterCount` and a size written in the model name ("...-70B-..."),
with the KV shape then taken from a per-size heuristic (see `KV_SHAPE_BY_SIZE`).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitserve.api.spec import InferenceDeploymentSpec


@dataclass(frozen=True)
class KvShape:
    layers: int
    kv_heads: int
    head_dim: int

    def bytes_per_token(self, dtype_bytes: float) -> float:
        """KV bytes one token needs across the whole model: K and V, every layer, every KV head."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


# Upper bound of parameter count -> typical GQA shape of that size (Llama 3 / Qwen 2.5 families:
# 8 KV heads of 128, layers growing with size). Used only when no config.json is readable.
KV_SHAPE_BY_SIZE: tuple[tuple[float, KvShape], ...] = (
    (2e9, KvShape(16, 8, 64)),  # Llama-3.2-1B
    (4e9, KvShape(28, 8, 128)),  # Llama-3.2-3B
    (10e9, KvShape(32, 8, 128)),  # Llama-3.1-8B
    (20e9, KvShape(48, 8, 128)),  # Qwen2.5-14B
    (40e9, KvShape(64, 8, 128)),  # Qwen2.5-32B
    (90e9, KvShape(80, 8, 128)),  # Llama-3.1-70B
    (float("inf"), KvShape(126, 8, 128)),  # Llama-3.1-405B
)


@dataclass(frozen=True)
class ModelFacts:
    parameter_count: float | None
    parameter_source: str
    kv_shape: KvShape | None
    kv_source: str
    num_attention_heads: int | None = None
    max_position_embeddings: int | None = None
    config_dtype: str | None = None
    config_quantization: str | None = None
    # Why the model's config could not be read, when it could not.
    config_note: str = ""


def heuristic_kv_shape(parameter_count: float) -> KvShape:
    for upper_bound, shape in KV_SHAPE_BY_SIZE:
        if parameter_count <= upper_bound:
            return shape
    return KV_SHAPE_BY_SIZE[-1][1]


def _first(config: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return None


def _int(config: dict[str, Any], *keys: str) -> int | None:
    value = _first(config, *keys)
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def parameters_from_config(config: dict[str, Any]) -> tuple[float, KvShape, int]:
    """(parameter count, KV shape, attention heads) of a decoder-only transformer config.

    Counts embeddings, the LM head (unless tied), attention projections with grouped KV heads, a
    gated MLP (three matrices, as in Llama, Mistral, Qwen, Gemma) and mixture-of-experts MLPs
    (`num_local_experts` / `num_experts`). Biases and norms are a rounding error and are left out.
    Raises KeyError when a required size is missing.
    """
    text = config.get("text_config")
    if isinstance(text, dict) and _first(config, "hidden_size", "n_embd", "d_model") is None:
        config = {**config, **text}
    hidden = _int(config, "hidden_size", "n_embd", "d_model")
    layers = _int(config, "num_hidden_layers", "n_layer", "num_layers")
    heads = _int(config, "num_attention_heads", "n_head", "num_heads")
    vocab = _int(config, "vocab_size")
    if hidden is None or layers is None or heads is None or vocab is None:
        raise KeyError("config.json lacks one of hidden_size, num_hidden_layers, num_attention_heads, vocab_size")
    kv_heads = _int(config, "num_key_value_heads", "num_kv_heads") or heads
    head_dim = _int(config, "head_dim") or hidden // heads
    intermediate = _int(config, "intermediate_size", "n_inner", "ffn_dim") or 4 * hidden
    experts = _int(config, "num_local_experts", "num_experts", "n_routed_experts") or 1
    expert_intermediate = _int(config, "moe_intermediate_size") or intermediate
    shared_experts = _int(config, "n_shared_experts") or 0

    embeddings = vocab * hidden
    lm_head = 0 if config.get("tie_word_embeddings", False) else vocab * hidden
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    if experts > 1:
        mlp = 3 * hidden * expert_intermediate * (experts + shared_experts) + hidden * experts  # + router
    else:
        mlp = 3 * hidden * intermediate
    total = embeddings + lm_head + layers * (attention + mlp)
    return float(total), KvShape(layers, kv_heads, head_dim), heads


def _config_dtype(config: dict[str, Any]) -> str | None:
    value = config.get("torch_dtype") or config.get("dtype")
    return str(value) if value else None


def _config_quantization(config: dict[str, Any]) -> str | None:
    quant = config.get("quantization_config")
    if isinstance(quant, dict):
        method = quant.get("quant_method") or quant.get("quant_type")
        return str(method).lower() if method else "unknown"
    return None


def parameter_count_from_name(name: str) -> float | None:
    """'meta-llama/Llama-3.1-70B-Instruct' -> 7e10; MoE names like '8x7B' multiply. None if no size."""
    match = re.search(r"(?<![A-Za-z0-9.])(?:(\d+)x)?(\d+(?:\.\d+)?)([BbMm])(?![A-Za-z0-9])", name)
    if not match:
        return None
    count = float(match.group(2)) * (1e9 if match.group(3) in "Bb" else 1e6)
    return count * int(match.group(1)) if match.group(1) else count


def hf_cache_dirs() -> list[Path]:
    hub = os.environ.get("HF_HUB_CACHE")
    if hub:
        return [Path(hub)]
    home = os.environ.get("HF_HOME")
    base = Path(home) if home else Path.home() / ".cache" / "huggingface"
    return [base / "hub"]


def _cached_snapshot(repo: str, revision: str, cache_dirs: list[Path]) -> Path | None:
    for cache in cache_dirs:
        repo_dir = cache / ("models--" + repo.replace("/", "--"))
        ref = repo_dir / "refs" / revision
        commit = ref.read_text().strip() if ref.is_file() else revision
        snapshot = repo_dir / "snapshots" / commit
        if (snapshot / "config.json").is_file():
            return snapshot
    return None


def locate_config(
    spec: InferenceDeploymentSpec, model_dir: str | None, cache_dirs: list[Path]
) -> tuple[Path | None, str]:
    """(config.json path or None, what was tried), never touching the network."""
    if model_dir:
        path = Path(model_dir)
        config = path if path.name == "config.json" else path / "config.json"
        return (config, f"--model-dir {model_dir}") if config.is_file() else (None, f"{config} does not exist")
    source = spec.model.source
    if source.uri is not None:
        local = source.uri.removeprefix("file://")
        if "://" in local:
            return None, f"model {source.uri} is remote and not reachable from here"
        config = Path(local) / "config.json"
        return (config, local) if config.is_file() else (None, f"{config} is not on this machine")
    if source.hugging_face is not None:
        repo = source.hugging_face.repo
        snapshot = _cached_snapshot(repo, source.hugging_face.revision, cache_dirs)
        if snapshot is not None:
            return snapshot / "config.json", f"Hugging Face cache {snapshot}"
        return None, f"Hugging Face repo {repo} not reachable (no network access, not in the local cache)"
    if source.pvc is not None:
        return None, f"model on PVC {source.pvc.claim_name} is not reachable from here"
    return None, "model source not readable"


def model_facts(
    spec: InferenceDeploymentSpec, model_dir: str | None = None, cache_dirs: list[Path] | None = None
) -> ModelFacts:
    """Facts from config.json when readable, else spec.model.parameterCount, else the model name."""
    path, where = locate_config(spec, model_dir, hf_cache_dirs() if cache_dirs is None else cache_dirs)
    note = ""
    if path is not None:
        try:
            config = json.loads(path.read_text())
            if not isinstance(config, dict):
                raise ValueError("config.json is not an object")
            count, shape, heads = parameters_from_config(config)
        except (OSError, ValueError, KeyError) as exc:
            note = f"{path}: {exc}"
        else:
            source = f"model config ({path})"
            return ModelFacts(
                parameter_count=count,
                parameter_source=source,
                kv_shape=shape,
                kv_source=source,
                num_attention_heads=heads,
                max_position_embeddings=_int(config, "max_position_embeddings", "n_positions"),
                config_dtype=_config_dtype(config),
                config_quantization=_config_quantization(config),
            )
    else:
        note = where
    declared = spec.model.parameter_count
    if declared is not None:
        count, source = float(declared), "spec (model.parameterCount)"
    else:
        guessed = parameter_count_from_name(spec.model.name) or _name_guess_from_source(spec)
        if guessed is None:
            return ModelFacts(None, "unknown", None, "unknown", config_note=note)
        count, source = guessed, "model name (size guessed from the name)"
    shape = heuristic_kv_shape(count)
    kv_source = (
        f"heuristic for {count / 1e9:.3g}B parameters "
        f"({shape.layers} layers x {shape.kv_heads} KV heads x {shape.head_dim})"
    )
    return ModelFacts(count, source, shape, kv_source, config_note=note)


def _name_guess_from_source(spec: InferenceDeploymentSpec) -> float | None:
    source = spec.model.source
    if source.hugging_face is not None:
        return parameter_count_from_name(source.hugging_face.repo)
    if source.uri is not None:
        return parameter_count_from_name(source.uri)
    return None
