"""Names, labels, selectors and roles of an InferenceDeployment's parts: one place, so the builders,
the reconciler, the autoscaler and the router's discovery agree."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from splitserve.api.base import API_GROUP, API_VERSION, KIND
from splitserve.api.spec import InferenceDeploymentSpec, Mode, PoolSpec, Role, RoutingPolicy

FIELD_MANAGER = "splitserve-operator"
LABEL_DEPLOYMENT = f"{API_GROUP}/deployment"
LABEL_ROLE = f"{API_GROUP}/role"
# Decode and aggregated workers both answer decode requests; the decode Service selects this
# label so a mode switch can run old and new pools side by side behind one Service.
LABEL_SERVES_DECODE = f"{API_GROUP}/serves-decode"
# The KV generation of a worker pod (api/generation.py): the router pairs prefill and decode only
# within one, and a new one rolls out as new pools beside the old.
LABEL_GENERATION = f"{API_GROUP}/generation"
ROUTER_ROLE = "router"
# The Gateway API Inference Extension's endpoint picker (spec.gateway): its pods' role label.
EPP_ROLE = "epp"
WORKER_HTTP_PORT_NAME = "http"
KV_SIDE_CHANNEL_PORT_NAME = "kv-side"
# vLLM's KV-cache event publisher (ZMQ), in the workers of pools routed precise-prefix.
KV_EVENTS_PORT_NAME = "kv-events"
# The pool size the spec declared when the operator last wrote it (see builders.workers).
ANNOTATION_DECLARED_REPLICAS = f"{API_GROUP}/declared-replicas"
# On each worker Deployment: the generation's inputs (api/generation.generation_inputs, JSON), so a
# rollout can say which fields changed without the old spec.
ANNOTATION_GENERATION_INPUTS = f"{API_GROUP}/generation-inputs"
# On a new generation's worker Deployment: the size it must reach, fixed when its rollout started.
ANNOTATION_ROLLOUT_TARGET = f"{API_GROUP}/rollout-target-replicas"
# Replica counts are written through /scale under this manager, never in the operator's apply set.
SCALE_FIELD_MANAGER = "splitserve-scaler"
# The decode pods' pd-sidecar port (spec.gateway, disaggregated mode): the InferencePool's target.
PD_SIDECAR_PORT_NAME = "pd-proxy"
# spec.adapters (LoRA): the adapters file, key of the ConfigMap `<name>-adapters` mounted in every worker
# pod, which `splitserve worker --adapters-file` keeps the engine's adapters in step with at run time.
ADAPTERS_FILE_KEY = "adapters.json"
ADAPTERS_MOUNT_PATH = "/etc/splitserve/adapters"
ADAPTERS_FILE_PATH = f"{ADAPTERS_MOUNT_PATH}/{ADAPTERS_FILE_KEY}"
# The condition each worker sets on its own pod (patching pods/status) with what its adapter sync achieved:
# status True with ADAPTERS_LOADED, else False with ADAPTERS_LOADING or ADAPTER_LOAD_FAILED and a message of
# `<adapter>: <why>` entries joined by "; ". The operator rolls them up into status.adapters.
ADAPTERS_CONDITION = f"{API_GROUP}/AdaptersReady"
ADAPTERS_LOADED = "AdaptersLoaded"
ADAPTERS_LOADING = "AdaptersLoading"
ADAPTER_LOAD_FAILED = "AdapterLoadFailed"
INFERENCE_POOL_API_VERSION = "inference.networking.k8s.io/v1"
HTTP_ROUTE_API_VERSION = "gateway.networking.k8s.io/v1"

# Every kind of child the builders emit, as (group, version, plural): the operator watches and
# indexes each by owner. Kinds whose CRD is absent (KEDA, prometheus-operator) are simply not served.
CHILD_RESOURCES: list[tuple[str, str, str]] = [
    ("apps", "v1", "deployments"),
    ("", "v1", "services"),
    ("", "v1", "serviceaccounts"),
    ("", "v1", "configmaps"),
    ("rbac.authorization.k8s.io", "v1", "roles"),
    ("rbac.authorization.k8s.io", "v1", "rolebindings"),
    ("policy", "v1", "poddisruptionbudgets"),
    ("networking.k8s.io", "v1", "networkpolicies"),
    ("monitoring.coreos.com", "v1", "servicemonitors"),
    ("monitoring.coreos.com", "v1", "podmonitors"),
    ("keda.sh", "v1alpha1", "scaledobjects"),
    ("autoscaling", "v2", "horizontalpodautoscalers"),
    ("inference.networking.k8s.io", "v1", "inferencepools"),
    ("gateway.networking.k8s.io", "v1", "httproutes"),
]


@dataclass(frozen=True)
class Owner:
    """The InferenceDeployment that owns the children (uid is None when rendering offline)."""

    name: str
    namespace: str
    uid: str | None = None

    def reference(self) -> dict[str, Any]:
        return {
            "apiVersion": f"{API_GROUP}/{API_VERSION}",
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def worker_roles(spec: InferenceDeploymentSpec) -> list[Role]:
    if spec.mode == Mode.AGGREGATED:
        return [Role.AGGREGATED]
    return [Role.PREFILL, Role.DECODE]


def pool_name(owner_name: str, role: Role | str) -> str:
    """`<name>-prefill`, `<name>-decode`, `<name>-aggregated`, `<name>-router`."""
    return f"{owner_name}-{role}"


def generation_pool_name(owner_name: str, role: Role | str, generation: str) -> str:
    """A worker pool Deployment of one KV generation: `<name>-<role>-<generation>`."""
    return f"{owner_name}-{role}-{generation}"


def router_name(owner_name: str) -> str:
    return f"{owner_name}-{ROUTER_ROLE}"


def epp_name(owner_name: str) -> str:
    """The endpoint picker's Deployment, Service (the InferencePool's endpointPickerRef) and RBAC."""
    return f"{owner_name}-{EPP_ROLE}"


DECODE_SIDECAR_ACCOUNT_SUFFIX = "-decode-sidecar"


def decode_sidecar_account(owner_name: str) -> str:
    """The decode pods' ServiceAccount when they carry the pd-sidecar, which reads the pods' generations."""
    return owner_name + DECODE_SIDECAR_ACCOUNT_SUFFIX


# The worker pods of every InferenceDeployment (the operator watches these pods only: status.adapters).
WORKER_POD_SELECTOR = f"{LABEL_DEPLOYMENT},{LABEL_ROLE} in ({','.join(sorted(role.value for role in Role))})"
WORKERS_ACCOUNT_SUFFIX = "-workers"


def workers_account(owner_name: str) -> str:
    """The worker pods' ServiceAccount when adapters are declared: it may patch the pods' status, where each
    worker reports its adapters (ADAPTERS_CONDITION). Decode pods with the pd-sidecar keep theirs, bound too."""
    return owner_name + WORKERS_ACCOUNT_SUFFIX


def adapters_config_map_name(owner_name: str) -> str:
    """The ConfigMap holding the adapters file (ADAPTERS_FILE_KEY)."""
    return f"{owner_name}-adapters"


def serves_adapters(spec: InferenceDeploymentSpec) -> bool:
    """Whether LoRA is on: the engines, the router and the picker serve adapters exactly when some are declared."""
    return bool(spec.adapters)


def prefill_service_name(owner_name: str) -> str:
    return f"{owner_name}-prefill"


def decode_service_name(owner_name: str) -> str:
    return f"{owner_name}-decode"


def common_labels(owner_name: str, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "splitserve",
        "app.kubernetes.io/instance": owner_name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": "splitserve",
        "app.kubernetes.io/managed-by": FIELD_MANAGER,
        LABEL_DEPLOYMENT: owner_name,
    }


def selector_labels(owner_name: str, role: Role | str) -> dict[str, str]:
    """Deployment selectors are immutable: only the two labels that never change."""
    return {LABEL_DEPLOYMENT: owner_name, LABEL_ROLE: str(role)}


def pod_labels(owner_name: str, role: Role | str) -> dict[str, str]:
    labels = common_labels(owner_name, str(role)) | selector_labels(owner_name, role)
    if role in (Role.DECODE, Role.AGGREGATED):
        labels[LABEL_SERVES_DECODE] = "true"
    return labels


def worker_selector_labels(owner_name: str, role: Role | str, generation: str) -> dict[str, str]:
    """A worker Deployment's selector: its role and its generation (each generation is its own Deployment)."""
    return selector_labels(owner_name, role) | {LABEL_GENERATION: generation}


def worker_pod_labels(owner_name: str, role: Role | str, generation: str) -> dict[str, str]:
    return pod_labels(owner_name, role) | {LABEL_GENERATION: generation}


def router_endpoint(owner: Owner, port: int) -> str:
    return f"http://{router_name(owner.name)}.{owner.namespace}.svc:{port}/v1"


def role_pool(spec: InferenceDeploymentSpec, role: Role | str) -> PoolSpec:
    """The pool whose settings a role runs with; an aggregated engine uses the decode pool."""
    return spec.prefill if role == Role.PREFILL else spec.decode


def role_routing_policy(spec: InferenceDeploymentSpec, role: Role | str) -> RoutingPolicy:
    """The policy the router picks a worker of `role` with: prefill's for prefill, decode's for decode
    and aggregated workers (the router sends an aggregated pool the decode leg)."""
    policies = spec.router.routing_policy
    return policies.prefill if role == Role.PREFILL else policies.decode


def publishes_kv_events(spec: InferenceDeploymentSpec, role: Role | str) -> bool:
    """Whether workers of `role` publish KV-cache events: their pool is routed precise-prefix."""
    return role_routing_policy(spec, role) == RoutingPolicy.PRECISE_PREFIX


def kv_event_roles(spec: InferenceDeploymentSpec) -> list[Role]:
    """The worker roles in use whose engines publish KV-cache events (none unless precise-prefix is chosen)."""
    return [role for role in worker_roles(spec) if publishes_kv_events(spec, role)]
