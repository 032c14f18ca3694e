"""The KV-transfer router: Deployment, its Service (the OpenAI endpoint) and least-privilege RBAC."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from splitserve.api.spec import InferenceDeploymentSpec, Mode
from splitserve.api.topology import (
    ROUTER_ROLE,
    kv_event_roles,
    pod_labels,
    router_name,
    selector_labels,
    serves_adapters,
)
from splitserve.builders.target import Target, metadata
from splitserve.builders.vllm_args import model_location, model_volume

ROUTER_CONTAINER_PORT = 8000
# The router runs the operator image, whose non-root user has these ids (deploy/images/Dockerfile.operator;
# a packaging test keeps the Dockerfile, the chart's securityContext and this one equal).
IMAGE_USER_ID = 10001


def router_args(spec: InferenceDeploymentSpec, *, host: str, port: int, workers: Sequence[str]) -> list[str]:
    """The flags of `splitserve router` for a deployment: where it listens, the model it serves, then
    `workers` (where the workers are: discovery in a cluster, static URLs locally), then the routing
    policies, admission and timeouts of `spec.router`; `--lora` with spec.adapters. The Deployment's container
    and `splitserve up` both start the router with these (and the endpoint picker, spec.gateway)."""
    router = spec.router
    return [
        f"--host={host}",
        f"--port={port}",
        f"--model={spec.model.name}",
        *lora_flag(spec),
        *workers,
        f"--prefill-policy={router.routing_policy.prefill}",
        f"--decode-policy={router.routing_policy.decode}",
        f"--queue-limit={router.admission_queue_limit}",
        f"--queue-timeout={router.timeouts.queue_seconds:g}",
        *leg_timeout_args(spec),
        f"--disagg-threshold-tokens={router.disaggregation_threshold_tokens}",
    ]


def lora_flag(spec: InferenceDeploymentSpec) -> list[str]:
    """`--lora` when adapters are declared: the router (picker, pd-sidecar) learns each worker's adapters from
    its /v1/models and sends a request for an adapter only to workers that serve it."""
    return ["--lora"] if serves_adapters(spec) else []


def leg_timeout_args(spec: InferenceDeploymentSpec) -> list[str]:
    """The timeouts of a request's legs (spec.router.timeouts), for whatever runs them: the router, or
    the decode pods' pd-sidecar behind a Gateway."""
    timeouts = spec.router.timeouts
    return [
        f"--connect-timeout={timeouts.connect_seconds:g}",
        f"--prefill-timeout={timeouts.prefill_seconds:g}",
        f"--decode-timeout={timeouts.first_token_seconds:g}",
        f"--request-timeout={timeouts.request_seconds:g}",
    ]


def pod_discovery_args(target: Target) -> list[str]:
    """Where the router in a cluster finds the workers: the deployment's worker Pods, watched live.

    Pods, not the pools' EndpointSlices: only a Pod carries its KV generation label, and the router
    must pair prefill and decode within one generation. Without a prefill pool (aggregated mode) the
    router is told so, and counts requests as aggregated rather than as prefill fallbacks."""
    spec = target.spec
    return [
        "--discovery=pods",
        f"--deployment={target.owner.name}",
        f"--namespace={target.owner.namespace}",
        f"--worker-port={spec.engine.port}",
        *(["--no-prefill-pool"] if spec.mode == Mode.AGGREGATED else []),
    ]


def router_tokenizer(spec: InferenceDeploymentSpec) -> str | None:
    """Where the router pod reads the model's tokenizer (--tokenizer), or None when it gets none.

    Only precise-prefix needs it: its block keys are the engine's token ids, which an estimate cannot
    give. Only a pvc source can be read: the router pod mounts the workers' volume read-only at the
    same path. A huggingFace source is downloaded inside each worker and a uri is read by vLLM (or
    lies in the worker image), so neither reaches the router; it then runs without --tokenizer and
    precise-prefix routes those prompts by load (`splitserve validate` warns, validation.advice).
    """
    if not kv_event_roles(spec) or spec.model.source.pvc is None:
        return None
    return model_location(spec)


@dataclass(frozen=True)
class TokenizerVolume:
    """The model claim mounted read-only, and the tokenizer directory in it (--tokenizer)."""

    path: str
    volume: dict[str, Any]
    mount: dict[str, Any]


def tokenizer_volume(spec: InferenceDeploymentSpec) -> TokenizerVolume | None:
    """What a router or endpoint picker pod mounts to tokenize as the engine does; None when it gets no
    tokenizer (router_tokenizer), so its pods never depend on the claim (a ReadWriteOnce claim would pin
    them to its node)."""
    path = router_tokenizer(spec)
    model = model_volume(spec)
    if path is None or model is None:
        return None
    return TokenizerVolume(path, *model)


def image_security_context() -> dict[str, Any]:
    """The operator image's containers (router, endpoint picker, pd-sidecar): its non-root user, nothing more."""
    return {
        "runAsNonRoot": True,
        "runAsUser": IMAGE_USER_ID,
        "runAsGroup": IMAGE_USER_ID,
        "readOnlyRootFilesystem": True,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def router_processes(cpu: int | str) -> int:
    """Router processes for a CPU request (`--workers`): one per requested core, rounded up.

    Said explicitly because the router container has no CPU limit: without a cgroup quota its default
    (the cores it may use) would be every core of the node.
    """
    text = str(cpu).strip()
    try:
        cores = float(text[:-1]) / 1000 if text.endswith("m") else float(text)
    except ValueError:
        return 1
    return max(1, math.ceil(cores))


def router_container_args(target: Target) -> list[str]:
    """The router container's args (after its `splitserve` command)."""
    spec = target.spec
    workers = pod_discovery_args(target)
    args = ["router", *router_args(spec, host="0.0.0.0", port=ROUTER_CONTAINER_PORT, workers=workers)]
    args.append(f"--workers={router_processes(spec.router.cpu)}")
    tokenizer = tokenizer_volume(spec)
    return [*args, f"--tokenizer={tokenizer.path}"] if tokenizer is not None else args


def front_pod_spec(spec: InferenceDeploymentSpec, account: str, container: dict[str, Any]) -> dict[str, Any]:
    """The pod of a front that picks workers (the router, the endpoint picker): its account, and the
    workers' model volume read-only when it tokenizes (mounted into `container`)."""
    pod_spec: dict[str, Any] = {
        "serviceAccountName": account,
        "containers": [container],
        # Long enough for in-flight streams to finish after SIGTERM (the router drains; a Gateway keeps
        # a request's ext_proc stream with the picker open until its response ends).
        "terminationGracePeriodSeconds": int(spec.router.timeouts.request_seconds) + 10,
        "enableServiceLinks": False,
    }
    tokenizer = tokenizer_volume(spec)
    if tokenizer is not None:
        pod_spec["volumes"] = [tokenizer.volume]
        container["volumeMounts"] = [tokenizer.mount]
    return pod_spec


def build_router_deployment(target: Target) -> dict[str, Any]:
    spec = target.spec
    name = target.owner.name
    probe = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5, "timeoutSeconds": 3}
    container: dict[str, Any] = {
        "name": "router",
        "image": spec.router.image or target.images.router,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": ["splitserve"],
        "args": router_container_args(target),
        "ports": [{"name": "http", "containerPort": ROUTER_CONTAINER_PORT, "protocol": "TCP"}],
        "resources": {
            "requests": {"cpu": str(spec.router.cpu), "memory": str(spec.router.memory)},
            "limits": {"memory": str(spec.router.memory)},
        },
        # Readiness is /health, not /ready: with decode scaled to zero the router must still take
        # requests into its queue (that queue is what scales decode back up).
        "readinessProbe": probe,
        "livenessProbe": probe | {"failureThreshold": 6},
        "securityContext": image_security_context(),
    }
    pod_spec = front_pod_spec(spec, router_name(name), container)
    deployment_spec: dict[str, Any] = {
        "selector": {"matchLabels": selector_labels(name, ROUTER_ROLE)},
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
        "template": {"metadata": {"labels": pod_labels(name, ROUTER_ROLE)}, "spec": pod_spec},
    }
    deployment_spec["replicas"] = spec.router.replicas
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(target, router_name(name), ROUTER_ROLE, **selector_labels(name, ROUTER_ROLE)),
        "spec": deployment_spec,
    }


def build_router_service(target: Target) -> dict[str, Any]:
    name = target.owner.name
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(target, router_name(name), ROUTER_ROLE),
        "spec": {
            "type": target.spec.router.service_type,
            "selector": selector_labels(name, ROUTER_ROLE),
            "ports": [
                {"name": "http", "port": target.spec.router.port, "targetPort": "http", "protocol": "TCP"},
            ],
        },
    }


def build_router_rbac(target: Target) -> list[dict[str, Any]]:
    """ServiceAccount, Role and RoleBinding: the router only reads the Pods of its namespace."""
    return pod_reader_rbac(target, router_name(target.owner.name), ROUTER_ROLE)


def pod_reader_rbac(target: Target, name: str, component: str) -> list[dict[str, Any]]:
    """A ServiceAccount `name` that may only read the Pods of the namespace, as pods discovery does
    (the router, the endpoint picker, the decode pods' pd-sidecar)."""
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": metadata(target, name, component),
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": metadata(target, name, component),
            # Pods discovery lists and watches Pods by the deployment label (a Role cannot narrow it
            # to a label: it is every Pod of the namespace, read-only).
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": metadata(target, name, component),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": target.owner.namespace}],
        },
    ]
