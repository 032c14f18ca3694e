"""What `splitserve up` starts: one command line per process, decided without touching the system.

Pure functions of the deployment, the engine choice and the ports handed in, so the process
layout (names, roles, ports, arguments, environment) is testable without starting anything.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from splitserve.api.generation import generation_inputs, kv_generation
from splitserve.api.spec import DEFAULT_WORKER_IMAGE, Connector, InferenceDeploymentSpec, ModelSource, Role
from splitserve.api.topology import publishes_kv_events, serves_adapters
from splitserve.builders.router import router_args
from splitserve.builders.vllm_args import kv_events_args, lora_args
from splitserve.local.deployment import TINY_MODEL_URI, LocalDeployment
from splitserve.local.ports import LOOPBACK


class Engine(StrEnum):
    VLLM = "vllm"
    SIM = "sim"


class Gateway(StrEnum):
    """What fronts the stack besides the router: nothing, or an Envoy with the endpoint picker."""

    NONE = "none"
    ENVOY = "envoy"


@dataclass(frozen=True)
class ProcessSpec:
    """One process of the local stack and how to tell it is ready."""

    name: str  # unique, also the log file's name: prefill-0, decode-1, router
    argv: tuple[str, ...]
    port: int
    ready_path: str
    env: Mapping[str, str] = field(default_factory=dict)
    role: str = ""  # workers: prefill, decode or aggregated
    generation: str = ""  # workers: the KV generation they serve
    ready_port: int = 0  # where ready_path is served, when not on `port` (Envoy: its admin port)

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def pool(self) -> str:
        """The router pool a worker belongs to: aggregated workers serve in the decode pool."""
        return "prefill" if self.role == "prefill" else "decode"

    @property
    def ready_url(self) -> str:
        return f"http://{LOOPBACK}:{self.ready_port or self.port}{self.ready_path}"


@dataclass(frozen=True)
class LocalPlan:
    workers: tuple[ProcessSpec, ...]
    router: ProcessSpec
    model_name: str

    @property
    def endpoint(self) -> str:
        return f"{self.router.base_url}/v1"

    @property
    def processes(self) -> tuple[ProcessSpec, ...]:
        return (*self.workers, self.router)


@dataclass(frozen=True)
class PlanInputs:
    """Everything outside the deployment that shapes the command lines."""

    engine: Engine
    router_port: int
    allocate_port: Callable[[], int]
    # How to run the `splitserve` CLI: [python, -m, splitserve] so no PATH lookup is needed.
    splitserve: tuple[str, ...]
    model_path: str | None = None  # engine vllm: what workers load
    spec_path: str | None = None  # engine vllm: the resolved spec file workers read
    sim_profile: str | None = None
    # The router finishes in-flight requests for this long after SIGTERM (less than up's stop grace).
    router_drain_seconds: float = 5.0
    # The file the router discovers the workers from (endpoints.py writes it).
    endpoints_file: str = "endpoints.json"
    # The KV generation of the workers planned (local_generation); the simulators refuse KV of another.
    generation: str = ""
    # The adapters file every worker follows when the deployment declares adapters (adapters.py).
    adapters_file: str | None = None


# Process names: the role's prefix and a number that grows over the stack's life, so the workers of a
# new generation (or added replicas) never reuse the name, hence the log file, of an earlier one.
NAME_PREFIX = {"prefill": "prefill", "decode": "decode", "aggregated": "worker"}


def role_counts(deployment: LocalDeployment) -> dict[str, int]:
    """Workers per role; aggregated mode runs the decode pool only, as aggregated workers."""
    if not deployment.disaggregated:
        return {"aggregated": deployment.decode_replicas}
    return {"prefill": deployment.prefill_replicas, "decode": deployment.decode_replicas}


def worker_roles(deployment: LocalDeployment) -> list[tuple[str, str]]:
    """(process name, worker role) for every worker of a fresh stack."""
    return [
        (f"{NAME_PREFIX[role]}-{index}", role)
        for role, count in role_counts(deployment).items()
        for index in range(count)
    ]


def _sim_worker(name: str, role: str, port: int, deployment: LocalDeployment, inputs: PlanInputs) -> ProcessSpec:
    argv = [*inputs.splitserve, "sim-worker", "--role", role, "--host", LOOPBACK, "--port", str(port)]
    argv += ["--model", deployment.spec.model.name]
    if inputs.generation:
        argv += ["--generation", inputs.generation]
    if inputs.sim_profile:
        argv += ["--profile", inputs.sim_profile]
    if publishes_kv_events(deployment.spec, role):
        # The simulator takes vLLM's own flag; each worker its own port, as all share this host.
        argv += kv_events_args(deployment.spec, Role(role), port=inputs.allocate_port())
    # vLLM's LoRA flags, as a pod's engine gets them, and the adapter sync `splitserve worker` runs.
    argv += lora_args(deployment.spec) + _adapters_file_args(deployment, inputs)
    return ProcessSpec(
        name=name, argv=tuple(argv), port=port, ready_path="/health", role=role, generation=inputs.generation
    )


def _vllm_worker(name: str, role: str, port: int, deployment: LocalDeployment, inputs: PlanInputs) -> ProcessSpec:
    if inputs.model_path is None or inputs.spec_path is None:
        raise ValueError("engine vllm needs model_path and spec_path")
    argv = [*inputs.splitserve, "worker", "--role", role, "-f", inputs.spec_path, "--port", str(port)]
    argv += ["--model", inputs.model_path, "--cpu"]
    env = {
        # Each worker its own NIXL handshake port: they all share the loopback interface.
        "VLLM_NIXL_SIDE_CHANNEL_HOST": LOOPBACK,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(inputs.allocate_port()),
        # Nothing may come from a model hub: the tiny model is built on this machine.
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    if publishes_kv_events(deployment.spec, role):
        # `splitserve worker` builds --kv-events-config (and the hash algorithm) from the spec, as in a
        # pod; only the port differs: engine.kvEventsPort would be the same for every local worker.
        argv += ["--kv-events-port", str(inputs.allocate_port())]
    # `splitserve worker` takes vLLM's LoRA flags from the spec; the adapters come from this file.
    argv += _adapters_file_args(deployment, inputs)
    return ProcessSpec(
        name=name, argv=tuple(argv), port=port, ready_path="/health", env=env, role=role, generation=inputs.generation
    )


def _adapters_file_args(deployment: LocalDeployment, inputs: PlanInputs) -> list[str]:
    if not serves_adapters(deployment.spec):
        return []
    if inputs.adapters_file is None:
        raise ValueError("a deployment with adapters needs PlanInputs.adapters_file")
    return ["--adapters-file", inputs.adapters_file]


def router_discovery_args(deployment: LocalDeployment, endpoints_file: str) -> list[str]:
    """Where the local router finds the workers: the endpoints file `up` rewrites as workers come and
    go (a rollout adds a generation's workers, marks the old ones terminating, then removes them)."""
    no_prefill = [] if deployment.disaggregated else ["--no-prefill-pool"]
    return ["--discovery=file", f"--endpoints-file={endpoints_file}", *no_prefill]


def _router_flags(deployment: LocalDeployment, inputs: PlanInputs, port: int) -> list[str]:
    """The flags of `splitserve router` that the router, the endpoint picker and the sidecars share:
    listen address, model, the endpoints file, policies, admission, timeouts, drain, tokenizer."""
    workers = router_discovery_args(deployment, inputs.endpoints_file)
    flags = router_args(deployment.spec, host=LOOPBACK, port=port, workers=workers)
    flags.append(f"--drain-seconds={inputs.router_drain_seconds:g}")
    if inputs.engine is Engine.VLLM and inputs.model_path and uses_tiny_model(deployment):
        # The real tokenizer makes the router's token counts (threshold, prefix hashing) exact.
        flags.append(f"--tokenizer={inputs.model_path}")
    return flags


def plan_router(deployment: LocalDeployment, inputs: PlanInputs) -> ProcessSpec:
    argv = [*inputs.splitserve, "router", *_router_flags(deployment, inputs, inputs.router_port)]
    # One router process: locally the engines need the other cores, and a second router process
    # contending with them for a core costs latency (benchmarks/router/README.md, shared cores).
    argv.append("--workers=1")
    return ProcessSpec(name="router", argv=tuple(argv), port=inputs.router_port, ready_path="/ready")


# --------------------------------------------------------------------------- --gateway envoy


@dataclass(frozen=True)
class GatewayPorts:
    listen: int  # Envoy's listener: the Gateway endpoint
    admin: int  # Envoy's admin interface (/ready)
    epp_grpc: int  # the endpoint picker's ext_proc and gRPC health
    epp_http: int  # the endpoint picker's /health, /ready, /metrics, /splitserve/workers


def sidecar_name(worker: ProcessSpec) -> str:
    return f"{worker.name}-sidecar"


def plan_sidecar(deployment: LocalDeployment, inputs: PlanInputs, worker: ProcessSpec, port: int) -> ProcessSpec:
    """The P/D sidecar of a decode worker: the Gateway's requests for that worker reach it, and it runs
    the prefill leg on the prefill worker the picker names (of the worker's generation, which it learns
    from the endpoints file), then the decode leg on its worker."""
    argv = [*inputs.splitserve, "sidecar", *_router_flags(deployment, inputs, port)]
    argv += [f"--local={worker.base_url}", f"--generation={worker.generation}"]
    return ProcessSpec(
        name=sidecar_name(worker), argv=tuple(argv), port=port, ready_path="/ready", generation=worker.generation
    )


def plan_epp(
    deployment: LocalDeployment, inputs: PlanInputs, ports: GatewayPorts, targets: Mapping[str, int]
) -> ProcessSpec:
    """The endpoint picker: the router's discovery and policies behind Envoy's ext_proc; `targets` maps a
    decode worker's URL to its sidecar's port (none in aggregated mode: Envoy reaches the workers)."""
    argv = [*inputs.splitserve, "epp", *_router_flags(deployment, inputs, ports.epp_http)]
    argv.append(f"--grpc-port={ports.epp_grpc}")
    argv += [f"--target-endpoint={url}={LOOPBACK}:{port}" for url, port in sorted(targets.items())]
    return ProcessSpec(name="epp", argv=tuple(argv), port=ports.epp_http, ready_path="/ready")


def plan_envoy(binary: str, bootstrap_path: str, ports: GatewayPorts) -> ProcessSpec:
    """Envoy with the bootstrap `up` renders. --base-id names its shared memory and hot-restart socket,
    which must differ between Envoys that run at once: the admin port does, on one host."""
    argv = (binary, "-c", bootstrap_path, "--base-id", str(ports.admin), "--log-level", "warn")
    return ProcessSpec(name="envoy", argv=argv, port=ports.listen, ready_path="/ready", ready_port=ports.admin)


def plan_worker(deployment: LocalDeployment, inputs: PlanInputs, role: str, index: int) -> ProcessSpec:
    """Worker number `index` of a role (its name `prefill-3`, `decode-0`, `worker-1`), on a new port."""
    name = f"{NAME_PREFIX[role]}-{index}"
    port = inputs.allocate_port()
    if inputs.engine is Engine.SIM:
        return _sim_worker(name, role, port, deployment, inputs)
    return _vllm_worker(name, role, port, deployment, inputs)


def plan_processes(deployment: LocalDeployment, inputs: PlanInputs) -> LocalPlan:
    workers = [
        plan_worker(deployment, inputs, role, index)
        for role, count in role_counts(deployment).items()
        for index in range(count)
    ]
    router = plan_router(deployment, inputs)
    return LocalPlan(workers=tuple(workers), router=router, model_name=deployment.spec.model.name)


def local_spec(deployment: LocalDeployment, model_path: str) -> InferenceDeploymentSpec:
    """The spec as the local workers run it: model.source is where they load the model from."""
    source = deployment.spec.model.source
    if source.uri is None or source.uri == model_path:
        return deployment.spec
    model = deployment.spec.model.model_copy(update={"source": ModelSource(uri=model_path)})
    return deployment.spec.model_copy(update={"model": model})


def local_generation(deployment: LocalDeployment, model_path: str) -> tuple[str, dict[str, Any]]:
    """The KV generation of a local deployment and the inputs it hashes, as api/generation.py defines
    them for a cluster (the default worker image standing for an unset engine.image) with one local
    twist: model.source is the model location `up` resolves (the tiny model's folder for
    splitserve://tiny-model), so the same file gives the cluster's generation unless it names the
    tiny model."""
    spec = local_spec(deployment, model_path)
    return kv_generation(spec, DEFAULT_WORKER_IMAGE), generation_inputs(spec, DEFAULT_WORKER_IMAGE)


def model_location(deployment: LocalDeployment, tiny_model_dir: str) -> str:
    """What real workers load: the tiny model for the placeholder, else what the file names."""
    source = deployment.spec.model.source
    if source.uri is not None:
        return tiny_model_dir if source.uri == TINY_MODEL_URI else source.uri
    if source.hugging_face is not None:
        return source.hugging_face.repo
    raise ValueError("model source has neither uri nor huggingFace")  # pvc is refused when loading


def uses_tiny_model(deployment: LocalDeployment) -> bool:
    return deployment.spec.model.source.uri == TINY_MODEL_URI


def resolved_document(deployment: LocalDeployment, model_path: str) -> tuple[dict[str, Any], list[str]]:
    """The object real workers read, adapted to a CPU-only machine, and a note for each change."""
    document = copy.deepcopy(deployment.document)
    spec = document["spec"]
    notes = []
    if uses_tiny_model(deployment):
        spec["model"]["source"] = {"uri": model_path}
        notes.append(f"model.source.uri {TINY_MODEL_URI} -> {model_path}")
    kv_transfer = spec.setdefault("kvTransfer", {})
    connector = deployment.spec.kv_transfer.connector
    if deployment.disaggregated and connector is Connector.NIXL and deployment.spec.kv_transfer.buffer_device != "cpu":
        # Locally there is no GPU: NIXL stages KV in host memory instead.
        kv_transfer["bufferDevice"] = "cpu"
        notes.append("kvTransfer.bufferDevice cuda -> cpu (no GPU locally)")
    return document, notes
