"""The one place that turns an InferenceDeployment spec into vLLM's command line.

The operator puts the result into worker pods' container args, and `splitserve worker -f` runs it
directly, so both paths start exactly the same engine. Pure: no I/O, deterministic order.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from splitserve.api.spec import Connector, InferenceDeploymentSpec, Role
from splitserve.api.topology import publishes_kv_events, role_pool, serves_adapters
from splitserve.engine.wait_settings import WaitSettings

# Where the operator mounts a model PVC inside worker pods.
MODEL_MOUNT_PATH = "/models"
# Without an explicit KV cache size, vLLM-CPU sizes the cache from the NUMA node it pins to and
# start-up fails when several instances share the machine; 256 MiB holds ~2k tokens of the tiny model.
CPU_DEFAULT_KV_CACHE_BYTES = "256M"

# vLLM's KV connector roles.
KV_PRODUCER = "kv_producer"
KV_CONSUMER = "kv_consumer"
KV_BOTH = "kv_both"

# The router subscribes to this topic of each engine's KV-event publisher (precise-prefix routing).
KV_EVENTS_TOPIC = "kv"
# The block hashes an engine's events name blocks by, made reproducible outside its Python process
# (canonical CBOR then SHA-256; vLLM's default sha256 hashes pickled objects) for consumers that key on
# them. splitserve's router recomputes its own keys from the events' token ids and does not need it.
KV_EVENTS_HASH_ALGO = "sha256_cbor"
# Lets an engine load and unload LoRA adapters at run time (POST /v1/load_lora_adapter, /v1/unload_lora_adapter).
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


@dataclass(frozen=True)
class EngineLaunch:
    """What starts one engine: vLLM server arguments and the environment it needs."""

    args: list[str]  # after `vllm serve` / `python -m vllm.entrypoints.openai.api_server`; starts with --model
    env: dict[str, str] = field(default_factory=dict)  # role-specific, never host-specific


def model_location(spec: InferenceDeploymentSpec) -> str:
    """What vLLM's --model gets: an HF repo id, the PVC mount path plus the model's directory, or the uri."""
    source = spec.model.source
    if source.hugging_face is not None:
        return source.hugging_face.repo
    if source.pvc is not None:
        # Normalised as an absolute path first, so ".." cannot climb out of the mount.
        inside = posixpath.normpath("/" + source.pvc.path).lstrip("/")
        return posixpath.join(MODEL_MOUNT_PATH, inside) if inside else MODEL_MOUNT_PATH
    if source.uri is not None:
        return source.uri
    raise ValueError("model.source needs exactly one of huggingFace, pvc or uri")


def model_volume(spec: InferenceDeploymentSpec) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The model PVC as a pod volume and its read-only mount at MODEL_MOUNT_PATH; None for other sources.

    Workers mount it to load the weights; the router and the endpoint picker mount the same volume to read the
    tokenizer."""
    pvc = spec.model.source.pvc
    if pvc is None:
        return None
    volume = {"name": "model", "persistentVolumeClaim": {"claimName": pvc.claim_name, "readOnly": True}}
    return volume, {"name": "model", "mountPath": MODEL_MOUNT_PATH, "readOnly": True}


def _json(value: dict[str, Any]) -> str:
    # Compact and key-ordered by construction, so rendered manifests do not churn.
    return json.dumps(value, separators=(",", ":"))


def speculative_config(spec: InferenceDeploymentSpec) -> dict[str, Any] | None:
    speculative = spec.engine.speculative_decoding
    if speculative.method == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": speculative.num_speculative_tokens,
            "prompt_lookup_max": speculative.ngram_prompt_lookup_max,
        }
    if speculative.method == "draft":
        if not speculative.draft_model:
            raise ValueError("speculativeDecoding.method 'draft' needs speculativeDecoding.draftModel")
        return {"model": speculative.draft_model, "num_speculative_tokens": speculative.num_speculative_tokens}
    return None


def kv_transfer_config(spec: InferenceDeploymentSpec, role: Role, *, cpu: bool = False) -> dict[str, Any] | None:
    """vLLM's --kv-transfer-config for a role, or None when the role moves no KV.

    An aggregated engine computes its own prefill, so it gets no connector even when the spec names one.
    """
    connector = spec.kv_transfer.connector
    if role == Role.AGGREGATED or connector == Connector.NONE:
        return None
    producer = role == Role.PREFILL
    directed_role = KV_PRODUCER if producer else KV_CONSUMER
    if connector == Connector.NIXL:
        # A CPU engine has no CUDA memory to stage blocks in, whatever the spec says.
        device = "cpu" if cpu else spec.kv_transfer.buffer_device
        return {"kv_connector": connector.value, "kv_role": directed_role, "kv_buffer_device": device}
    if connector == Connector.EXAMPLE:
        # Both sides read and write the shared directory, keyed by prompt hash.
        return {
            "kv_connector": connector.value,
            "kv_role": KV_BOTH,
            "kv_connector_extra_config": {"shared_storage_path": spec.kv_transfer.shared_storage_path},
        }
    if connector == Connector.LMCACHE:
        # As in vLLM's disagg_prefill_lmcache_v1 example: one LMCache RPC endpoint name per side.
        return {
            "kv_connector": connector.value,
            "kv_role": directed_role,
            "kv_connector_extra_config": {
                "discard_partial_chunks": False,
                "lmcache_rpc_port": "producer1" if producer else "consumer1",
            },
        }
    if connector == Connector.MOONCAKE:
        return {"kv_connector": connector.value, "kv_role": directed_role}
    raise ValueError(f"unknown KV connector {connector!r}")


def kv_events_config(spec: InferenceDeploymentSpec, role: Role, *, port: int | None = None) -> dict[str, Any] | None:
    """vLLM's --kv-events-config for a role, or None when its pool is not routed precise-prefix.

    The endpoint binds every interface (`*`: vLLM binds only an endpoint with a wildcard, else it
    connects); the router reads it from the worker's GET /kv_event_sources and puts the worker's own
    address in place of the `*`. `port` replaces engine.kvEventsPort (local workers share one host).
    """
    if not publishes_kv_events(spec, role):
        return None
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port if port is not None else spec.engine.kv_events_port}",
        "topic": KV_EVENTS_TOPIC,
    }


def kv_events_args(spec: InferenceDeploymentSpec, role: Role, *, port: int | None = None) -> list[str]:
    """`--kv-events-config JSON` for a role whose pool is routed precise-prefix, else nothing. vLLM and
    the engine simulator take the same flag."""
    events = kv_events_config(spec, role, port=port)
    return ["--kv-events-config", _json(events)] if events is not None else []


def lora_args(spec: InferenceDeploymentSpec) -> list[str]:
    """vLLM's LoRA flags with spec.engine.lora's limits when adapters are declared, else nothing.

    No --lora-modules: the adapters are loaded at run time from the adapters file (builders.adapters), so
    that a change of the list changes no argument and rolls no pod."""
    if not serves_adapters(spec):
        return []
    lora = spec.engine.lora
    return [
        "--enable-lora",
        "--max-loras",
        str(lora.max_loras),
        "--max-lora-rank",
        str(lora.max_rank),
        "--max-cpu-loras",
        str(lora.max_cpu_loras),
    ]


# --------------------------------------------------------------------------- argument lists


def option_value(args: Sequence[str], name: str) -> str | None:
    """The value of `name` (`--x v` or `--x=v`); the last one wins, as in argparse."""
    value = None
    for index, arg in enumerate(args):
        if arg == name and index + 1 < len(args):
            value = args[index + 1]
        elif arg.startswith(name + "="):
            value = arg[len(name) + 1 :]
    return value


def with_option(args: Sequence[str], name: str, value: str) -> list[str]:
    """`args` with every `name` set to `value`, or `name value` appended when absent."""
    result: list[str] = []
    found = False
    skip = False
    for index, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if arg == name and index + 1 < len(args):
            result += [name, value]
            found = skip = True
        elif arg.startswith(name + "="):
            result.append(f"{name}={value}")
            found = True
        else:
            result.append(arg)
    return result if found else [*result, name, value]


def has_flag(args: Sequence[str], name: str) -> bool:
    return any(arg == name or arg.startswith(name + "=") for arg in args)


def cpu_engine_args(args: Sequence[str], kv_cache_memory_bytes: str | None = None) -> list[str]:
    """vLLM arguments made runnable on vLLM-CPU: eager mode and an explicit KV cache size.

    Adds only what is missing: `--enforce-eager`, and `--kv-cache-memory-bytes` (set to
    `kv_cache_memory_bytes` when given, else kept when present, else CPU_DEFAULT_KV_CACHE_BYTES).
    The spec builder (`build_engine_launch(cpu=True)`) and `splitserve worker --cpu -- ARGS` both use it.
    """
    result = list(args)
    if not has_flag(result, "--enforce-eager"):
        result.append("--enforce-eager")
    if kv_cache_memory_bytes:
        result = with_option(result, "--kv-cache-memory-bytes", kv_cache_memory_bytes)
    elif not has_flag(result, "--kv-cache-memory-bytes"):
        result += ["--kv-cache-memory-bytes", CPU_DEFAULT_KV_CACHE_BYTES]
    return result


# --------------------------------------------------------------------------- the spec's command line


def _flag(name: str, enabled: bool) -> str:
    return f"--{name}" if enabled else f"--no-{name}"


def build_engine_launch(
    spec: InferenceDeploymentSpec,
    role: Role,
    *,
    port: int | None = None,
    model: str | None = None,
    cpu: bool = False,
    kv_cache_memory_bytes: str | None = None,
    kv_events_port: int | None = None,
) -> EngineLaunch:
    """vLLM arguments and environment for one engine of `role`.

    `model` replaces the spec's model location (a local copy); `cpu` adapts the engine to vLLM-CPU
    (eager mode, float32 for dtype auto, an explicit KV cache size instead of GPU memory utilization);
    `kv_events_port` replaces engine.kvEventsPort when the role publishes KV-cache events.
    The engine's extraArgs then the pool's come last, so a user can override anything set here.
    """
    engine = spec.engine
    pool = role_pool(spec, role)
    dtype = "float32" if cpu and spec.model.dtype == "auto" else spec.model.dtype
    args = [
        "--model",
        model if model is not None else model_location(spec),
        "--served-model-name",
        spec.model.name,
        "--host",
        "0.0.0.0",
        "--port",
        str(port if port is not None else engine.port),
        "--dtype",
        dtype,
    ]
    hugging_face = spec.model.source.hugging_face
    if hugging_face is not None and model is None:
        args += ["--revision", hugging_face.revision]
    if spec.model.quantization != "none":
        args += ["--quantization", spec.model.quantization]
    if spec.model.max_model_len is not None:
        args += ["--max-model-len", str(spec.model.max_model_len)]
    args += ["--tensor-parallel-size", str(pool.tensor_parallel_size)]
    args.append(_flag("enable-prefix-caching", engine.prefix_caching))
    if publishes_kv_events(spec, role):
        args += ["--prefix-caching-hash-algo", KV_EVENTS_HASH_ALGO]
    args.append(_flag("enable-chunked-prefill", engine.chunked_prefill))
    speculative = speculative_config(spec)
    if speculative is not None:
        args += ["--speculative-config", _json(speculative)]
    if cpu:
        args = cpu_engine_args(args, kv_cache_memory_bytes)
    else:
        args += ["--gpu-memory-utilization", str(engine.gpu_memory_utilization)]
        if kv_cache_memory_bytes is not None:
            args += ["--kv-cache-memory-bytes", kv_cache_memory_bytes]
    if engine.block_size is not None:
        args += ["--block-size", str(engine.block_size)]
    if engine.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", engine.kv_cache_dtype]
    if engine.max_num_seqs is not None:
        args += ["--max-num-seqs", str(engine.max_num_seqs)]
    transfer = kv_transfer_config(spec, role, cpu=cpu)
    if transfer is not None:
        args += ["--kv-transfer-config", _json(transfer)]
    args += kv_events_args(spec, role, port=kv_events_port)
    args += lora_args(spec)
    args += engine.extra_args
    args += pool.extra_args
    return EngineLaunch(args=args, env=engine_env(spec, role))


def engine_waits(spec: InferenceDeploymentSpec, role: Role) -> WaitSettings | None:
    """The waits of `role`'s engines; None for vLLM's own, left unsaid so that a GPU pool's pods stay
    as they were (an operator upgrade must not roll them)."""
    waits = spec.engine.waits
    if waits.mode == "Auto" and role_pool(spec, role).resources.gpus > 0:
        return None
    if waits.mode == "Spin":
        return WaitSettings("spin")
    return WaitSettings("events", spin_us=waits.spin_microseconds, nixl_poll_us=waits.nixl_poll_microseconds)


def engine_env(spec: InferenceDeploymentSpec, role: Role) -> dict[str, str]:
    """Environment an engine of `role` needs. The user's engine.env comes last and wins.

    Entries with valueFrom belong to the pod spec (they need the API server), so they are left out.
    """
    env: dict[str, str] = {}
    transfer = kv_transfer_config(spec, role)
    if transfer is not None and spec.kv_transfer.connector == Connector.NIXL:
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(spec.kv_transfer.side_channel_port)
    waits = engine_waits(spec, role)
    if waits is not None:
        env.update(waits.to_env())
    if serves_adapters(spec):
        env[RUNTIME_LORA_ENV] = "True"
    for var in spec.engine.env:
        if var.value is not None:
            env[var.name] = var.value
    return env
