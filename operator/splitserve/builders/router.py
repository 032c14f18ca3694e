"""The KV-transfer router: Deployment, its Service (the OpenAI endpoint) and least-privilege RBAC."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from splitserve.api.spec import InferenceDeploymentSpec, Mode
from splitserve.api.topology import (
    ROUTER_ROLE,
    kv_event_roles,
    pod_labels,
    router_name,
    selector_labels,
)
from splitserve.builders.target import Target, metadata
from splitserve.builders.vllm_args import model_location
from splitserve.builders.workers import model_volume

ROUTER_CONTAINER_PORT = 8000
# The router runs the operator image, whose non-root user has these ids (deploy/images/Dockerfile.operator;
# a packaging test keeps the Dockerfile, the chart's securityContext and this one equal).
IMAGE_USER_ID = 10001


def router_args(spec: InferenceDeploymentSpec, *, host: str, port: int, workers: Sequence[str]) -> list[str]:
    """The flags of `splitserve router` for a deployment: where it listens, the model it serves, then
    `workers` (where the workers are: discovery in a cluster, static URLs locally), then the routing
    policies, admission and timeouts of `spec.router`. The Deployment's container and `splitserve up`
    both start the router with these."""
    router = spec.router
    timeouts = router.timeouts
    return [
        f"--host={host}",
        f"--port={port}",
        f"--model={spec.model.name}",
        *workers,
        f"--prefill-policy={router.routing_policy.prefill}",
        f"--decode-policy={router.routing_policy.decode}",
        f"--queue-limit={router.admission_queue_limit}",
        f"--queue-timeout={timeouts.queue_seconds:g}",
        f"--connect-timeout={timeouts.connect_seconds:g}",
        f"--prefill-timeout={timeouts.prefill_seconds:g}",
        f"--decode-timeout={timeouts.first_token_seconds:g}",
        f"--request-timeout={timeouts.request_seconds:g}",
        f"--disagg-threshold-tokens={router.disaggregation_threshold_tokens}",
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
    tokenizer = router_tokenizer(spec)
    return [*args, f"--tokenizer={tokenizer}"] if tokenizer is not None else args


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
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": IMAGE_USER_ID,
            "runAsGroup": IMAGE_USER_ID,
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": router_name(name),
        "containers": [container],
        # Long enough for in-flight streams to finish after SIGTERM (the router drains).
        "terminationGracePeriodSeconds": int(spec.router.timeouts.request_seconds) + 10,
        "enableServiceLinks": False,
    }
    model = model_volume(spec)
    if model is not None and router_tokenizer(spec) is not None:
        # The workers' model volume, read-only, for the tokenizer; absent otherwise, so routers of
        # other specs never depend on the claim (a ReadWriteOnce claim would pin them to its node).
        pod_spec["volumes"] = [model[0]]
        container["volumeMounts"] = [model[1]]
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
    name = router_name(target.owner.name)
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": metadata(target, name, ROUTER_ROLE),
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": metadata(target, name, ROUTER_ROLE),
            # Pods discovery lists and watches Pods by the deployment label (a Role cannot narrow it
            # to a label: it is every Pod of the namespace, read-only).
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": metadata(target, name, ROUTER_ROLE),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": target.owner.namespace}],
        },
    ]
