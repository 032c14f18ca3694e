"""Worker pool Deployments (prefill, decode, or one aggregated pool), one per KV generation.

A Deployment is named `<name>-<role>-<generation>` (api/generation.py): a change of a generation
field names new Deployments, which the controller brings up beside the old ones (make-before-break).
Within a generation, each pool's pod template depends only on the spec fields that affect that
pool, so a change to, say, the decode pool's max batch size rolls decode pods and nothing else.
With spec.adapters the pods also read the adapters file and report what they loaded (builders.adapters);
which adapters are declared is not in the template, so changing the list rolls nothing.
"""

from __future__ import annotations

import json
from typing import Any

from splitserve.api.generation import generation_inputs
from splitserve.api.spec import Connector, InferenceDeploymentSpec, PoolSpec, Role
from splitserve.api.topology import (
    ADAPTERS_FILE_PATH,
    ANNOTATION_DECLARED_REPLICAS,
    ANNOTATION_GENERATION_INPUTS,
    KV_EVENTS_PORT_NAME,
    KV_SIDE_CHANNEL_PORT_NAME,
    WORKER_HTTP_PORT_NAME,
    decode_sidecar_account,
    generation_pool_name,
    publishes_kv_events,
    role_pool,
    serves_adapters,
    worker_pod_labels,
    worker_selector_labels,
    workers_account,
)
from splitserve.builders.adapters import adapter_volumes, adapters_token_ref
from splitserve.builders.gateway import PD_SIDECAR_EXIT_SECONDS, has_pd_sidecar, pd_sidecar_container
from splitserve.builders.target import Target, metadata
from splitserve.builders.vllm_args import build_engine_launch, model_volume

HF_CACHE_PATH = "/var/cache/huggingface"
# Time for the router's pod watch to see a terminating pod before the engine stops taking
# requests: the router stops routing to it first, then in-flight requests finish.
PRESTOP_SLEEP_SECONDS = 10
PROGRESS_DEADLINE_SECONDS = 1800


def _uses_kv_transfer(spec: InferenceDeploymentSpec, role: Role) -> bool:
    return role != Role.AGGREGATED and spec.kv_transfer.connector != Connector.NONE


def _env(spec: InferenceDeploymentSpec, engine_env: dict[str, str], generation: str) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "HF_HOME", "value": HF_CACHE_PATH},
        # The pod's KV generation, also its label: lets the worker's logs and answers say which it is.
        {"name": "SPLITSERVE_GENERATION", "value": generation},
    ]
    if serves_adapters(spec):
        # The adapter sync patches its own pod's status: which pod, in which namespace.
        env.append({"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}})
    env += [{"name": name, "value": value} for name, value in sorted(engine_env.items())]
    # The model's token, else the adapters' (one Secret for both: a CEL rule).
    ref = adapters_token_ref(spec)
    if ref is not None:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    for var in spec.engine.env:
        if var.value_from is not None:
            env.append({"name": var.name, "valueFrom": var.value_from})
    return env


def _resources(pool: PoolSpec) -> dict[str, Any]:
    res = pool.resources
    requests: dict[str, Any] = {"cpu": str(res.cpu), "memory": str(res.memory)}
    limits: dict[str, Any] = {"memory": str(res.memory)}
    if res.gpus > 0:
        requests[res.gpu_resource_name] = str(res.gpus)
        limits[res.gpu_resource_name] = str(res.gpus)
    return {"requests": requests, "limits": limits}


def _volumes(target: Target, pool: PoolSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    spec = target.spec
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": str(pool.resources.shared_memory)}},
        {"name": "hf-cache", "emptyDir": {}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "hf-cache", "mountPath": HF_CACHE_PATH},
    ]
    model = model_volume(spec)
    if model is not None:
        volumes.append(model[0])
        mounts.append(model[1])
    adapters = adapter_volumes(target)
    return volumes + adapters[0], mounts + adapters[1]


def _probe(path: str, port_name: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": port_name},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def _drain_seconds(pool: PoolSpec) -> int:
    """What is left of the grace period after the preStop pause, less a margin for vLLM's exit."""
    return max(0, pool.termination_grace_period_seconds - PRESTOP_SLEEP_SECONDS - 5)


def _ports(spec: InferenceDeploymentSpec, role: Role) -> list[dict[str, Any]]:
    """The container's named ports: HTTP, the NIXL side channel, and the KV-event publisher.

    Named, so the NetworkPolicy can admit the router to exactly the pods that publish events."""
    ports = [{"name": WORKER_HTTP_PORT_NAME, "containerPort": spec.engine.port, "protocol": "TCP"}]
    if _uses_kv_transfer(spec, role) and spec.kv_transfer.connector == Connector.NIXL:
        ports.append(
            {"name": KV_SIDE_CHANNEL_PORT_NAME, "containerPort": spec.kv_transfer.side_channel_port, "protocol": "TCP"}
        )
    if publishes_kv_events(spec, role):
        ports.append({"name": KV_EVENTS_PORT_NAME, "containerPort": spec.engine.kv_events_port, "protocol": "TCP"})
    return ports


def _worker_args(spec: InferenceDeploymentSpec, role: Role, pool: PoolSpec) -> list[str]:
    """`splitserve worker`'s own flags (before `--` and vLLM's)."""
    args = ["--role", str(role), f"--drain-timeout={_drain_seconds(pool)}"]
    if serves_adapters(spec):
        args.append(f"--adapters-file={ADAPTERS_FILE_PATH}")
    return args


def _container(target: Target, role: Role, image: str, generation: str) -> dict[str, Any]:
    spec = target.spec
    pool = role_pool(spec, role)
    launch = build_engine_launch(spec, role)
    volumes_mounts = _volumes(target, pool)[1]
    return {
        "name": "engine",
        "image": image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": ["splitserve", "worker"],
        "args": [*_worker_args(spec, role, pool), "--", *launch.args],
        "env": _env(spec, launch.env, generation),
        "ports": _ports(spec, role),
        "resources": _resources(pool),
        "volumeMounts": volumes_mounts,
        # Loading weights can take many minutes: the startup probe allows 30 min before liveness applies.
        "startupProbe": _probe("/health", WORKER_HTTP_PORT_NAME, 10, 180),
        "readinessProbe": _probe("/health", WORKER_HTTP_PORT_NAME, 5, 3),
        "livenessProbe": _probe("/health", WORKER_HTTP_PORT_NAME, 10, 6),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_SECONDS}}},
        "securityContext": {"allowPrivilegeEscalation": False},
    }


def build_worker_deployment(target: Target, role: Role) -> dict[str, Any]:
    spec = target.spec
    name = target.owner.name
    generation = target.generation
    pool = role_pool(spec, role)
    volumes = _volumes(target, pool)[0]
    pod_spec: dict[str, Any] = {
        "containers": [_container(target, role, spec.engine.image or target.images.worker, generation)],
        "volumes": volumes,
        "terminationGracePeriodSeconds": pool.termination_grace_period_seconds,
        "enableServiceLinks": False,
    }
    if serves_adapters(spec):
        # It may patch the pods' status, where the adapter sync reports (decode pods with the pd-sidecar keep
        # the sidecar's account, bound to the same Role).
        pod_spec["serviceAccountName"] = workers_account(name)
    if has_pd_sidecar(target, role):
        # spec.gateway: the Gateway's requests come in through the pd-sidecar, which reads the Pods
        # (the prefill pods' generations) with its own ServiceAccount.
        pod_spec["initContainers"] = [pd_sidecar_container(target)]
        pod_spec["serviceAccountName"] = decode_sidecar_account(name)
        pod_spec["terminationGracePeriodSeconds"] += PD_SIDECAR_EXIT_SECONDS
    if pool.node_selector:
        pod_spec["nodeSelector"] = dict(pool.node_selector)
    if pool.tolerations:
        pod_spec["tolerations"] = list(pool.tolerations)
    if pool.affinity:
        pod_spec["affinity"] = dict(pool.affinity)
    deployment_spec: dict[str, Any] = {
        "selector": {"matchLabels": worker_selector_labels(name, role, generation)},
        # Pulling an engine image and loading weights can take long; past this the Deployment
        # reports ProgressDeadlineExceeded and the pool's condition turns False instead of Unknown.
        "progressDeadlineSeconds": PROGRESS_DEADLINE_SECONDS,
        # Surge, never remove first: an engine takes minutes to load, capacity must not dip.
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
        "template": {"metadata": {"labels": worker_pod_labels(name, role, generation)}, "spec": pod_spec},
    }
    meta = metadata(
        target,
        generation_pool_name(name, role, generation),
        str(role),
        **worker_selector_labels(name, role, generation),
    )
    meta["annotations"] = {
        ANNOTATION_DECLARED_REPLICAS: str(pool.replicas),
        # What the generation hashes, on the Deployment only (never the pod template, which it would
        # roll for nothing): a later rollout reads it to say which fields changed, without the old spec.
        ANNOTATION_GENERATION_INPUTS: json.dumps(generation_inputs(spec, target.images.worker), sort_keys=True),
    }
    # No spec.replicas: the pool's size is owned by whoever scales it (the spec when it changes,
    # the built-in autoscaler, KEDA/HPA, or `kubectl scale`), always through the /scale
    # subresource, so the operator's server-side apply never owns the field and never fights.
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": deployment_spec}
