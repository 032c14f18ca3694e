"""Behind a cluster's Gateway (spec.gateway, Gateway API Inference Extension): the InferencePool of the
pods that serve, its endpoint picker (EPP) with Service and RBAC, the decode pods' pd-sidecar and its
RBAC in disaggregated mode, and an optional HTTPRoute to the pool.

The picker is `splitserve epp`: the router's pools, pod discovery, policies and generation pairing
behind Envoy's ext_proc protocol, so it gets the router's own flags (router.router_args). The Gateway
sends each request straight to the pod it names: in disaggregated mode a decode pod's pd-sidecar
(which runs the prefill leg on the prefill pod the picker names in `x-prefiller-host-port`, then
decodes on its local vLLM), in aggregated mode the worker's vLLM.
"""

from __future__ import annotations

from typing import Any

from splitserve.api.spec import PD_SIDECAR_PORT, GatewaySpec, Mode, Role
from splitserve.api.topology import (
    EPP_ROLE,
    HTTP_ROUTE_API_VERSION,
    INFERENCE_POOL_API_VERSION,
    LABEL_GENERATION,
    PD_SIDECAR_PORT_NAME,
    decode_sidecar_account,
    epp_name,
    pod_labels,
    selector_labels,
)
from splitserve.builders.router import (
    front_pod_spec,
    image_security_context,
    leg_timeout_args,
    lora_flag,
    pod_discovery_args,
    pod_reader_rbac,
    router_args,
    tokenizer_volume,
)
from splitserve.builders.target import Target, metadata

PD_SIDECAR_CONTAINER = "pd-sidecar"
EPP_GRPC_PORT_NAME = "grpc"
EPP_METRICS_PORT_NAME = "http-metrics"
INFERENCE_POOL_COMPONENT = "inference-pool"
# A native sidecar is signalled only once the engine has exited, which the pool's grace period is
# measured for (workers._drain_seconds): the pod gets this much more, the sidecar's --drain-seconds,
# to finish writing its last responses.
PD_SIDECAR_EXIT_SECONDS = 30


def has_pd_sidecar(target: Target, role: Role) -> bool:
    """Whether pods of `role` carry the pd-sidecar: decode pods, with spec.gateway, in disaggregated mode."""
    return target.spec.gateway is not None and target.spec.mode == Mode.DISAGGREGATED and role == Role.DECODE


def pool_target_port(target: Target) -> int:
    """The port of a pool pod the Gateway sends requests to: the decode pods' pd-sidecar in disaggregated
    mode, the aggregated worker's vLLM otherwise."""
    return PD_SIDECAR_PORT if target.spec.mode == Mode.DISAGGREGATED else target.spec.engine.port


def pool_role(target: Target) -> Role:
    """The worker role whose pods the InferencePool selects (the pods that answer decode requests)."""
    return Role.DECODE if target.spec.mode == Mode.DISAGGREGATED else Role.AGGREGATED


# --------------------------------------------------------------------------- the decode pods' pd-sidecar


def pd_sidecar_container(target: Target) -> dict[str, Any]:
    """The pd-sidecar as a native sidecar (an init container that keeps running): it is up before the
    engine takes requests and stops after it, so no request reaches the pod without it."""
    spec = target.spec
    if spec.gateway is None:
        raise ValueError("the pd-sidecar needs spec.gateway")
    sidecar = spec.gateway.sidecar
    return {
        "name": PD_SIDECAR_CONTAINER,
        "image": spec.router.image or target.images.router,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "restartPolicy": "Always",
        "command": ["splitserve"],
        "args": [
            "sidecar",
            f"--port={PD_SIDECAR_PORT}",
            f"--local=http://127.0.0.1:{spec.engine.port}",
            # The prefill pods and their KV generations: the sidecar runs a prefill leg only on a pod
            # of its own generation (a label, read from the pod itself through the downward API).
            *pod_discovery_args(target),
            "--generation=$(SPLITSERVE_GENERATION)",
            *lora_flag(spec),
            *leg_timeout_args(spec),
            f"--drain-seconds={PD_SIDECAR_EXIT_SECONDS}",
        ],
        "env": [
            {
                "name": "SPLITSERVE_GENERATION",
                "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{LABEL_GENERATION}']"}},
            }
        ],
        "ports": [{"name": PD_SIDECAR_PORT_NAME, "containerPort": PD_SIDECAR_PORT, "protocol": "TCP"}],
        "resources": {
            "requests": {"cpu": str(sidecar.cpu), "memory": str(sidecar.memory)},
            "limits": {"memory": str(sidecar.memory)},
        },
        "readinessProbe": {
            "httpGet": {"path": "/ready", "port": PD_SIDECAR_PORT_NAME},
            "periodSeconds": 5,
            "timeoutSeconds": 3,
        },
        "securityContext": image_security_context(),
    }


# --------------------------------------------------------------------------- the endpoint picker


def epp_container_args(target: Target, gateway: GatewaySpec) -> list[str]:
    """`splitserve epp`'s args: the router's flags (its pools, policies, threshold and timeouts), its
    HTTP port serving /metrics, then the gRPC port and the pod port it names to the Gateway."""
    spec = target.spec
    picker = gateway.endpoint_picker
    workers = pod_discovery_args(target)
    args = ["epp", *router_args(spec, host="0.0.0.0", port=picker.metrics_port, workers=workers)]
    args += [
        f"--grpc-port={picker.port}",
        f"--target-port={pool_target_port(target)}",
    ]
    tokenizer = tokenizer_volume(spec)
    return [*args, f"--tokenizer={tokenizer.path}"] if tokenizer is not None else args


def build_epp_deployment(target: Target, gateway: GatewaySpec) -> dict[str, Any]:
    spec = target.spec
    name = target.owner.name
    picker = gateway.endpoint_picker
    probe: dict[str, Any] = {"periodSeconds": 5, "timeoutSeconds": 3}
    container: dict[str, Any] = {
        "name": "epp",
        "image": spec.router.image or target.images.router,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": ["splitserve"],
        "args": epp_container_args(target, gateway),
        "ports": [
            {"name": EPP_GRPC_PORT_NAME, "containerPort": picker.port, "protocol": "TCP"},
            {"name": EPP_METRICS_PORT_NAME, "containerPort": picker.metrics_port, "protocol": "TCP"},
        ],
        "resources": {
            "requests": {"cpu": str(picker.cpu), "memory": str(picker.memory)},
            "limits": {"memory": str(picker.memory)},
        },
        # The gRPC health services GAIE's pickers serve: ready once it has its view of the pods.
        "readinessProbe": probe | {"grpc": {"port": picker.port, "service": "readiness"}},
        "livenessProbe": probe | {"grpc": {"port": picker.port, "service": "liveness"}, "failureThreshold": 6},
        "securityContext": image_security_context(),
    }
    pod_spec = front_pod_spec(spec, epp_name(name), container)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(target, epp_name(name), EPP_ROLE, **selector_labels(name, EPP_ROLE)),
        "spec": {
            "replicas": picker.replicas,
            "selector": {"matchLabels": selector_labels(name, EPP_ROLE)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {"metadata": {"labels": pod_labels(name, EPP_ROLE)}, "spec": pod_spec},
        },
    }


def build_epp_service(target: Target, gateway: GatewaySpec) -> dict[str, Any]:
    """The InferencePool's endpointPickerRef: gRPC (h2c) for the Gateway, HTTP for Prometheus."""
    name = target.owner.name
    picker = gateway.endpoint_picker
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(target, epp_name(name), EPP_ROLE),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(name, EPP_ROLE),
            "ports": [
                {
                    "name": EPP_GRPC_PORT_NAME,
                    "port": picker.port,
                    "targetPort": EPP_GRPC_PORT_NAME,
                    "protocol": "TCP",
                    "appProtocol": "kubernetes.io/h2c",
                },
                {
                    "name": EPP_METRICS_PORT_NAME,
                    "port": picker.metrics_port,
                    "targetPort": EPP_METRICS_PORT_NAME,
                    "protocol": "TCP",
                },
            ],
        },
    }


# --------------------------------------------------------------------------- Gateway API objects


def build_inference_pool(target: Target, gateway: GatewaySpec) -> dict[str, Any]:
    """The pods the Gateway may send a request to, and the picker that chooses among them. Selected by
    role alone, so the pods of every KV generation are in it; the picker pairs within a generation."""
    name = target.owner.name
    return {
        "apiVersion": INFERENCE_POOL_API_VERSION,
        "kind": "InferencePool",
        "metadata": metadata(target, name, INFERENCE_POOL_COMPONENT),
        "spec": {
            "selector": {"matchLabels": selector_labels(name, pool_role(target))},
            "targetPorts": [{"number": pool_target_port(target)}],
            "appProtocol": "http",
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": epp_name(name),
                "port": {"number": gateway.endpoint_picker.port},
                "failureMode": gateway.failure_mode,
            },
        },
    }


def build_http_route(target: Target, gateway: GatewaySpec) -> dict[str, Any] | None:
    """Every path of the given hostnames, from the given Gateways, to the InferencePool."""
    route = gateway.http_route
    if route is None:
        return None
    spec: dict[str, Any] = {"parentRefs": [ref.to_wire() for ref in route.parent_refs]}
    if route.hostnames:
        spec["hostnames"] = list(route.hostnames)
    spec["rules"] = [
        {
            "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
            "backendRefs": [
                {
                    "group": INFERENCE_POOL_API_VERSION.split("/")[0],
                    "kind": "InferencePool",
                    "name": target.owner.name,
                }
            ],
        }
    ]
    return {
        "apiVersion": HTTP_ROUTE_API_VERSION,
        "kind": "HTTPRoute",
        "metadata": metadata(target, target.owner.name, INFERENCE_POOL_COMPONENT),
        "spec": spec,
    }


# --------------------------------------------------------------------------- all of it


def build_gateway_rbac(target: Target) -> list[dict[str, Any]]:
    """The picker's and (disaggregated mode) the decode pods' ServiceAccounts: both read the Pods."""
    if target.spec.gateway is None:
        return []
    name = target.owner.name
    accounts = pod_reader_rbac(target, epp_name(name), EPP_ROLE)
    if target.spec.mode == Mode.DISAGGREGATED:
        accounts += pod_reader_rbac(target, decode_sidecar_account(name), str(Role.DECODE))
    return accounts


def build_gateway_services(target: Target) -> list[dict[str, Any]]:
    gateway = target.spec.gateway
    return [] if gateway is None else [build_epp_service(target, gateway)]


def build_gateway_deployments(target: Target) -> list[dict[str, Any]]:
    gateway = target.spec.gateway
    return [] if gateway is None else [build_epp_deployment(target, gateway)]


def build_gateway_routing(target: Target) -> list[dict[str, Any]]:
    """The InferencePool and, when asked for, the HTTPRoute to it."""
    gateway = target.spec.gateway
    if gateway is None:
        return []
    route = build_http_route(target, gateway)
    return [build_inference_pool(target, gateway), *([route] if route is not None else [])]
