"""The KV generation: which spec fields make one worker's KV cache unusable by another.

A prefill worker's KV blocks are only meaningful to a decode worker that runs the same weights,
with the same numerics and the same cache layout. vLLM's NIXL handshake compares a compatibility
hash of the model *name*, dtype, layer shapes, KV dtype and vLLM version, but not the model
revision: two revisions of one model id hand KV to each other and decode continues from KV of
other weights, answering fluent garbage with HTTP 200. So the operator hashes every field below
into a *generation*; pods carry it as a label, the router pairs only within one, and a change of it
rolls out as new pools beside the old ones (see controller/rollout.py). A change to any other field
rolls pods within the generation, as a Deployment does.

This table is the one list of those fields: the docs (docs/rollouts.md) are generated from it.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from splitserve.api.spec import InferenceDeploymentSpec

# Length of the generation id: 40 bits, enough that two specs of one deployment never collide.
GENERATION_LENGTH = 10


@dataclass(frozen=True)
class KvField:
    """One input of the generation: its place in the spec and why KV depends on it."""

    path: str
    why: str


# vLLM flags in extraArgs that change weights, numerics or KV layout; any other extra flag (batch
# sizes, logging, scheduling) rolls within the generation.
KV_FLAGS: frozenset[str] = frozenset(
    {
        "--model",
        "--revision",
        "--code-revision",
        "--tokenizer",
        "--tokenizer-revision",
        "--dtype",
        "--quantization",
        "-q",
        "--kv-cache-dtype",
        "--calculate-kv-scales",
        "--block-size",
        "--max-model-len",
        "--tensor-parallel-size",
        "-tp",
        "--pipeline-parallel-size",
        "-pp",
        "--hf-overrides",
        "--rope-scaling",
        "--rope-theta",
        "--model-impl",
        "--load-format",
        "--kv-transfer-config",
        "--attention-backend",
        "--sliding-window",
        "--disable-sliding-window",
    }
)


KV_GENERATION_FIELDS: tuple[KvField, ...] = (
    KvField("model.source", "which weights (Hugging Face repo and revision, PVC claim and path, or URI)"),
    KvField("model.dtype", "the numbers KV is computed in"),
    KvField("model.quantization", "quantized weights compute different activations, hence different KV"),
    KvField("model.maxModelLen", "bounds the cache layout and the positions a block may hold"),
    KvField("engine.kvCacheDtype", "the bytes a KV block is stored in (fp8 vs the model dtype)"),
    KvField("engine.blockSize", "the number of tokens per KV block, so block ids mean different spans"),
    KvField("engine.image", "the vLLM version and kernels that compute and lay out KV (resolved default included)"),
    KvField("prefill.tensorParallelSize", "how a prefill worker's KV is sharded across GPUs"),
    KvField("decode.tensorParallelSize", "how a decode worker's KV is sharded across GPUs"),
    KvField("kvTransfer.connector", "the protocol KV moves with; workers of two connectors cannot talk"),
    KvField("kvTransfer.bufferDevice", "where the connector stages blocks, part of its handshake"),
    KvField("kvTransfer.sharedStoragePath", "ExampleConnector: where KV files are read from"),
    KvField(
        "engine.extraArgs / prefill.extraArgs / decode.extraArgs",
        "only the KV-shaping vLLM flags among them: " + ", ".join(sorted(KV_FLAGS)),
    ),
)


def _flag_name(arg: str) -> str:
    """An argument's flag name as vLLM reads it: its parser takes `--kv_cache_dtype` for `--kv-cache-dtype`."""
    name = arg.split("=", 1)[0]
    return name.replace("_", "-") if name.startswith("--") else name


def _is_value(arg: str) -> bool:
    """Whether an argument is a value rather than a flag (`-1` is a value: argparse reads it as one)."""
    return not arg.startswith("-") or _NEGATIVE_NUMBER.fullmatch(arg) is not None


_NEGATIVE_NUMBER = re.compile(r"-\d+(\.\d+)?")


def kv_flags(args: list[str]) -> list[str]:
    """The KV-shaping flags of an argument list, with their values, in order (`--x=v` and `--x v`),
    each exactly as written (callers may remove them from the list)."""
    picked: list[str] = []
    index = 0
    while index < len(args):
        arg = args[index]
        name = _flag_name(arg)
        takes_value = "=" not in arg and index + 1 < len(args) and _is_value(args[index + 1])
        if name in KV_FLAGS:
            picked.append(arg)
            if takes_value:
                picked.append(args[index + 1])
        index += 2 if takes_value else 1
    return picked


def generation_inputs(spec: InferenceDeploymentSpec, worker_image: str) -> dict[str, Any]:
    """Every value the generation hashes, keyed by its spec path (`worker_image`: the operator's
    default worker image, used when the spec leaves engine.image unset)."""
    source = spec.model.source.model_dump(by_alias=True, mode="json", exclude_none=True)
    # The HF token Secret changes who may download, not what is downloaded.
    if "huggingFace" in source:
        source["huggingFace"].pop("tokenSecretRef", None)
    return {
        "model.source": source,
        "model.dtype": spec.model.dtype,
        "model.quantization": spec.model.quantization,
        "model.maxModelLen": spec.model.max_model_len,
        "engine.kvCacheDtype": spec.engine.kv_cache_dtype,
        "engine.blockSize": spec.engine.block_size,
        "engine.image": spec.engine.image or worker_image,
        "prefill.tensorParallelSize": spec.prefill.tensor_parallel_size,
        "decode.tensorParallelSize": spec.decode.tensor_parallel_size,
        "kvTransfer.connector": str(spec.kv_transfer.connector),
        "kvTransfer.bufferDevice": spec.kv_transfer.buffer_device,
        "kvTransfer.sharedStoragePath": spec.kv_transfer.shared_storage_path,
        "engine.extraArgs": kv_flags(spec.engine.extra_args),
        "prefill.extraArgs": kv_flags(spec.prefill.extra_args),
        "decode.extraArgs": kv_flags(spec.decode.extra_args),
    }


def kv_generation(spec: InferenceDeploymentSpec, worker_image: str) -> str:
    """The generation id: a stable hash of generation_inputs (canonical JSON, sha256, 10 hex chars)."""
    canonical = json.dumps(generation_inputs(spec, worker_image), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:GENERATION_LENGTH]


def generation_changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The spec paths whose values differ between two generation_inputs, as `path: old -> new`
    (a path only one side has, e.g. inputs an older operator recorded, counts as changed)."""
    changes = []
    for path in [*after, *(path for path in before if path not in after)]:
        if before.get(path) != after.get(path):
            changes.append(f"{path}: {_short(before.get(path))} -> {_short(after.get(path))}")
    return changes


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":")) if not isinstance(value, str) else value
    return text if len(text) <= 80 else text[:77] + "..."


def fields_markdown() -> str:
    """KV_GENERATION_FIELDS as the Markdown table of docs/rollouts.md (a test keeps the two equal)."""
    lines = ["| Field | Why KV depends on it |", "|---|---|"]
    for kv_field in KV_GENERATION_FIELDS:
        paths = " / ".join(f"`spec.{path.strip()}`" for path in kv_field.path.split("/"))
        lines.append(f"| {paths} | {kv_field.why.replace('|', '&#124;')} |")
    return "\n".join(lines) + "\n"
