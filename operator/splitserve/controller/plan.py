"""The reconcile's decisions, pure: what the cluster holds and what the spec wants in, the writes out.

`plan_writes` (create, apply or resize each desired child), `plan_mode_switch` (make-before-break
between modes), `plan_prune` (owned children nobody wants) and `plan_status` (the status to write).
A new KV generation's make-before-break rollout is planned in rollout.py (its pool sizes go through
plan_writes, its status parts through plan_status). reconcile.py reads the cache, calls these and
performs what they return.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from splitserve.api.spec import InferenceDeploymentSpec, Mode, Role
from splitserve.api.status import (
    AutopilotStatus,
    ConditionType,
    InferenceDeploymentStatus,
    Problem,
)
from splitserve.api.topology import (
    ANNOTATION_DECLARED_REPLICAS,
    DECODE_SIDECAR_ACCOUNT_SUFFIX,
    ROUTER_ROLE,
    WORKERS_ACCOUNT_SUFFIX,
    Owner,
    prefill_service_name,
    role_pool,
    router_endpoint,
    router_name,
    worker_roles,
)
from splitserve.builders.adapters import ADAPTER_CLAIM_VOLUME_PREFIX, ADAPTERS_VOLUME
from splitserve.builders.bundle import child_key
from splitserve.builders.gateway import PD_SIDECAR_CONTAINER
from splitserve.controller.adapters import with_adapters
from splitserve.controller.children import ChildKey, Children, Write, owned_by, worker_pools, worker_role
from splitserve.controller.drift import contains
from splitserve.controller.rollout import RolloutPlan, with_generations
from splitserve.controller.rollup import PoolObservation, roll_up
from splitserve.optimization.overrides import active_overrides

__all__ = [
    "PRUNABLE_KINDS",
    "ChildKey",
    "Children",
    "ModeSwitch",
    "StatusInput",
    "Write",
    "owned_by",
    "plan_mode_switch",
    "plan_prune",
    "plan_status",
    "plan_writes",
    "worker_role",
]

# Kinds whose set of children can change with the spec (mode, monitoring, autoscaling backend, KV
# generation, gateway, adapters): these are pruned. Every kind the builders emit is: with spec.gateway
# removed, even its ServiceAccounts, Roles and NetworkPolicy go; with spec.adapters emptied, the adapters
# file's ConfigMap and the workers' account.
PRUNABLE_KINDS: list[tuple[str, str]] = [
    ("apps/v1", "Deployment"),
    ("v1", "Service"),
    ("v1", "ServiceAccount"),
    ("v1", "ConfigMap"),
    ("rbac.authorization.k8s.io/v1", "Role"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"),
    ("policy/v1", "PodDisruptionBudget"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("keda.sh/v1alpha1", "ScaledObject"),
    ("autoscaling/v2", "HorizontalPodAutoscaler"),
    ("inference.networking.k8s.io/v1", "InferencePool"),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),
]


def plan_writes(
    spec: InferenceDeploymentSpec,
    desired: list[dict[str, Any]],
    children: Children,
    sizes: Mapping[str, int] | None = None,
) -> list[Write]:
    """The writes that make the children match `desired`: none for a child that already carries it.
    `sizes` (worker Deployment name -> replicas): a rollout sizes those pools, not the spec's count."""
    writes: list[Write] = []
    sizes = sizes or {}
    for child in desired:
        name = child["metadata"]["name"]
        observed = children.get(child_key(child))
        role = worker_role(child)
        if observed is None and role is not None:
            declared = int(child["metadata"]["annotations"][ANNOTATION_DECLARED_REPLICAS])
            size = sizes.get(name, declared)
            sized = {**child, "spec": {**child["spec"], "replicas": size}}
            writes.append(Write("create", sized, size, "Created", f"{child['kind']} {name} ({size} replicas)"))
            continue
        if observed is None:
            writes.append(Write("apply", child, None, "Created", f"{child['kind']} {name}"))
        elif not contains(observed, child):
            if role is not None:
                # Before the apply: the ops address list items of the template as observed.
                ops = stale_adapter_volume_ops(observed, child)
                if ops:
                    message = f"removed adapter volumes no longer wanted from {child['kind']} {name}"
                    writes.append(Write("patch", child, None, "Updated", message, ops=tuple(ops)))
            writes.append(Write("apply", child, None, *change_event(observed, child)))
        if observed is not None and role is not None:
            resize = rollout_size(observed, sizes[name]) if name in sizes else plan_size(spec, role, child, observed)
            if resize is not None:
                writes.append(resize)
            ops = stale_pd_sidecar_ops(observed, child)
            if ops:
                message = f"removed the {PD_SIDECAR_CONTAINER} from {child['kind']} {name}"
                writes.append(Write("patch", child, None, "Updated", message, ops=tuple(ops)))
    return writes


def stale_pd_sidecar_ops(observed: Mapping[str, Any], desired: Mapping[str, Any]) -> list[dict[str, Any]]:
    """JSON patch ops removing the pd-sidecar (spec.gateway) and the operator's ServiceAccount (the sidecar's,
    or the workers' of spec.adapters) from a worker pool's pod template that no longer wants them; [] when
    there is nothing of it to remove. Only what the operator put there, each guarded by a `test` op, so
    nobody else's init container is touched. A pod naming a pruned account could not be created."""
    have = observed.get("spec", {}).get("template", {}).get("spec", {})
    want = desired["spec"]["template"]["spec"]
    base = "/spec/template/spec"
    ops: list[dict[str, Any]] = []
    present = [container.get("name") for container in have.get("initContainers", [])]
    if PD_SIDECAR_CONTAINER in present and PD_SIDECAR_CONTAINER not in {
        c["name"] for c in want.get("initContainers", [])
    }:
        index = present.index(PD_SIDECAR_CONTAINER)
        path = f"{base}/initContainers/{index}"
        ops.append({"op": "test", "path": f"{path}/name", "value": PD_SIDECAR_CONTAINER})
        # The whole list when it was the only one: a pod spec holds no empty initContainers.
        ops.append({"op": "remove", "path": path if len(present) > 1 else f"{base}/initContainers"})
    account = have.get("serviceAccountName")
    ours = (DECODE_SIDECAR_ACCOUNT_SUFFIX, WORKERS_ACCOUNT_SUFFIX)
    if account is not None and account.endswith(ours) and "serviceAccountName" not in want:
        path = f"{base}/serviceAccountName"
        ops += [{"op": "test", "path": path, "value": account}, {"op": "remove", "path": path}]
    return ops


def _is_adapter_volume(name: Any) -> bool:
    return isinstance(name, str) and (name == ADAPTERS_VOLUME or name.startswith(ADAPTER_CLAIM_VOLUME_PREFIX))


def _remove_named(path: str, items: list[Any], unwanted: set[str]) -> list[dict[str, Any]]:
    """Ops removing the items of the list at `path` whose name is in `unwanted`, last first (each removal
    leaves the earlier indexes in place), each after a `test` of its name."""
    ops: list[dict[str, Any]] = []
    for index in reversed(range(len(items))):
        name = items[index].get("name") if isinstance(items[index], Mapping) else None
        if name in unwanted:
            ops.append({"op": "test", "path": f"{path}/{index}/name", "value": name})
            ops.append({"op": "remove", "path": f"{path}/{index}"})
    return ops


def stale_adapter_volume_ops(observed: Mapping[str, Any], desired: Mapping[str, Any]) -> list[dict[str, Any]]:
    """JSON patch ops removing from a worker pool's pod template the adapter volumes (spec.adapters: the adapters
    file's ConfigMap, adapter claims) and their engine mounts that the desired template lacks; [] when none.
    Like the pd-sidecar, they stay after an apply that leaves them out when the pool was created with them,
    and a pod that mounts a claim since deleted never starts."""
    have = observed.get("spec", {}).get("template", {}).get("spec", {})
    want = desired["spec"]["template"]["spec"]
    wanted = {volume["name"] for volume in want.get("volumes", [])}
    volumes = have.get("volumes") or []
    unwanted = {v.get("name") for v in volumes if _is_adapter_volume(v.get("name")) and v.get("name") not in wanted}
    if not unwanted:
        return []
    base = "/spec/template/spec"
    ops: list[dict[str, Any]] = []
    for index, container in enumerate(have.get("containers") or []):
        mounts = container.get("volumeMounts") or []
        ops += _remove_named(f"{base}/containers/{index}/volumeMounts", mounts, unwanted)
    return ops + _remove_named(f"{base}/volumes", volumes, unwanted)


def rollout_size(observed: Mapping[str, Any], wanted: int) -> Write | None:
    current = int(observed.get("spec", {}).get("replicas", 1))
    if wanted == current:
        return None
    name = observed["metadata"]["name"]
    return Write("scale", observed, wanted, "Scaled", f"rollout: scaled {name} from {current} to {wanted}")


def plan_size(
    spec: InferenceDeploymentSpec, role: Role, child: Mapping[str, Any], observed: Mapping[str, Any]
) -> Write | None:
    """Write the spec's pool size only when the spec's declared count changed.

    With autoscaling off, a changed `replicas` in the spec is applied; a `kubectl scale` of the
    Deployment stays until the spec's count changes again. With autoscaling on, the autoscaler
    (built-in, KEDA or HPA) owns the size; the operator only pulls it back inside min/max.
    """
    declared = int(child["metadata"]["annotations"][ANNOTATION_DECLARED_REPLICAS])
    previously = (observed["metadata"].get("annotations") or {}).get(ANNOTATION_DECLARED_REPLICAS)
    current = int(observed.get("spec", {}).get("replicas", 1))
    pool = role_pool(spec, role)
    if not spec.autoscaling.enabled:
        wanted, why = (declared, "the spec's replicas changed") if previously != str(declared) else (current, "")
    else:
        wanted = min(max(current, pool.min_replicas), pool.max_replicas)
        why = f"kept within minReplicas {pool.min_replicas} and maxReplicas {pool.max_replicas}"
    if wanted == current:
        return None
    name = child["metadata"]["name"]
    return Write("scale", observed, wanted, "Scaled", f"scaled {name} from {current} to {wanted}: {why}")


def change_event(observed: Mapping[str, Any], desired: Mapping[str, Any]) -> tuple[str, str]:
    """(reason, message) for a child we changed: Scaled when only its replica count moved."""
    label = f"{desired['kind']} {desired['metadata']['name']}"
    before = observed.get("spec", {}).get("replicas")
    after = desired.get("spec", {}).get("replicas")
    if after is not None and before != after:
        rest_observed = {**observed, "spec": {**observed.get("spec", {}), "replicas": after}}
        if contains(rest_observed, desired):
            return "Scaled", f"scaled {label} from {before} to {after} replicas"
    return "Updated", f"updated {label} to match the spec"


def serving(deployment: Mapping[str, Any]) -> bool:
    """A pool is serving once it has a ready replica, or when it is sized to zero on purpose."""
    wanted = int(deployment.get("spec", {}).get("replicas", 1))
    return wanted == 0 or int((deployment.get("status") or {}).get("readyReplicas", 0)) >= 1


@dataclass(frozen=True)
class ModeSwitch:
    """The previous mode's children during a switch: kept until every new pool serves, then removed."""

    keep: frozenset[ChildKey] = frozenset()
    remove: tuple[Mapping[str, Any], ...] = ()
    waiting_for: Role | None = None  # the first new pool that does not serve yet

    @property
    def switching(self) -> bool:
        return bool(self.keep)


def plan_mode_switch(spec: InferenceDeploymentSpec, owner: Owner, children: Children, generation: str) -> ModeSwitch:
    """Make-before-break after a mode change within KV generation `generation`.

    Worker Deployments of that generation whose role the mode no longer has (and the prefill
    Service when going aggregated) stay until each new pool has a ready replica (or is sized to
    zero). The router keeps serving meanwhile: decode and aggregated workers share the decode
    Service, and a router without prefill workers sends requests whole to decode. Deleting the old
    pool then lets its pods leave the EndpointSlices as terminating and drain (preStop pause, then
    the worker's drain). Pools of other generations are the rollout's (controller.rollout).
    """
    wanted = worker_roles(spec)
    ours = {role: obj for found, role, obj in worker_pools(children, owner) if found == generation}
    leftovers = [obj for role, obj in ours.items() if role not in wanted]
    if not leftovers:
        return ModeSwitch()
    if spec.mode == Mode.AGGREGATED:
        service = children.get(("v1", "Service", prefill_service_name(owner.name)))
        if service is not None and owned_by(service, owner):
            leftovers.append(service)
    for role in wanted:
        pool = ours.get(role)
        if pool is None or not serving(pool):
            return ModeSwitch(keep=frozenset(child_key(dict(obj)) for obj in leftovers), waiting_for=role)
    return ModeSwitch(remove=tuple(leftovers))


def plan_prune(children: Children, wanted: set[ChildKey], owner: Owner) -> list[Mapping[str, Any]]:
    """Owned children of a prunable kind that nothing wants any more."""
    prunable = set(PRUNABLE_KINDS)
    return [
        obj
        for key, obj in sorted(children.items())
        if (key[0], key[1]) in prunable and key not in wanted and owned_by(obj, owner)
    ]


def is_ours(obj: Mapping[str, Any], uid: str | None) -> bool:
    """Owned by the InferenceDeployment with `uid`; any labelled one when the uid is not known."""
    references = obj["metadata"].get("ownerReferences")
    return uid is None or not references or any(ref.get("uid") == uid for ref in references)


def declared_mode(body: Mapping[str, Any]) -> Mode:
    """The mode an invalid spec asks for, so its status still reports the right pools."""
    declared = (body.get("spec") or {}).get("mode")
    return Mode.AGGREGATED if declared == Mode.AGGREGATED.value else Mode.DISAGGREGATED


@dataclass(frozen=True)
class StatusPlan:
    status: InferenceDeploymentStatus
    # An Event to post (reason, message) when overrides were dropped; None otherwise.
    event: tuple[str, str] | None = None


@dataclass(frozen=True)
class StatusInput:
    body: Mapping[str, Any]
    children: Children
    spec: InferenceDeploymentSpec | None  # the served (effective) spec; None when invalid
    problem: Problem | None
    now: str
    written: InferenceDeploymentSpec | None = None  # the CR's own spec
    invalid_overrides: bool = False
    serving_mode: Mode | None = None  # set during a mode switch: the previous mode's pools still serve
    rollout: RolloutPlan | None = None  # the generations' plan: status.kvGeneration, generations, rollout
    pods: Sequence[Mapping[str, Any]] = ()  # the worker pods (slim), for status.adapters
    missing_claims: frozenset[str] = frozenset()  # adapter claims the cluster lacks


def plan_status(inp: StatusInput) -> StatusPlan:
    """Roll up status for the served spec from the cached children."""
    meta = inp.body["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    previous = InferenceDeploymentStatus.model_validate(inp.body.get("status") or {})
    generation = int(meta.get("generation", 0))

    def pool(component: str) -> PoolObservation | None:
        if component == ROUTER_ROLE:
            return PoolObservation.from_deployment(inp.children.get(("apps/v1", "Deployment", router_name(name))))
        # A role's pools of every KV generation together: during a rollout both serve.
        return PoolObservation.combined(
            obj for _, role, obj in worker_pools(inp.children) if role == component and is_ours(obj, meta.get("uid"))
        )

    mode = inp.serving_mode or (inp.spec.mode if inp.spec is not None else declared_mode(inp.body))
    status = roll_up(
        mode=mode,
        generation=generation,
        previous=previous,
        prefill=pool("prefill"),
        decode=pool("aggregated") if mode == Mode.AGGREGATED else pool("decode"),
        router=pool(ROUTER_ROLE),
        endpoint=router_endpoint(Owner(name, namespace), inp.spec.router.port) if inp.spec else previous.endpoint,
        problem=inp.problem,
        now=inp.now,
    )
    if inp.serving_mode is not None and inp.spec is not None:
        status = status.with_condition(
            ConditionType.PROGRESSING,
            "True",
            "SwitchingMode",
            f"serving {inp.serving_mode} until every {inp.spec.mode} pool has a ready replica",
            now=inp.now,
            generation=generation,
        )
    if inp.rollout is not None:
        status = with_generations(
            status,
            inp.rollout,
            inp.children,
            Owner(name, namespace, meta.get("uid")),
            previous,
            now=inp.now,
            observed_generation=generation,
        )
    if inp.spec is not None:
        status = with_adapters(status, inp.spec, inp.pods, inp.missing_claims, now=inp.now, generation=generation)
    event = None
    if inp.written is not None and previous.autopilot is not None:
        autopilot, event = drop_inactive(inp.written, previous.autopilot, invalid=inp.invalid_overrides)
        status = status.model_copy(update={"autopilot": autopilot})
    return StatusPlan(status, event)


def drop_inactive(
    written: InferenceDeploymentSpec, autopilot: AutopilotStatus, *, invalid: bool
) -> tuple[AutopilotStatus, tuple[str, str] | None]:
    """Overrides that no longer apply (dynamic turned off, a kind vetoed, invalid) leave status at once."""
    kept = {} if invalid else active_overrides(written, autopilot.overrides)
    if kept == autopilot.overrides:
        return autopilot, None
    if invalid:
        why = "the spec with them would be invalid"
    elif not written.optimization.dynamic:
        why = "dynamic optimization is off"
    else:
        why = "vetoed or equal to the spec"
    dropped = sorted(set(autopilot.overrides) - set(kept)) or sorted(autopilot.overrides)
    event = (
        ("OptimizationDropped", f"serving the spec as written for {dropped}: {why}") if autopilot.overrides else None
    )
    return autopilot.model_copy(update={"overrides": kept, "note": f"overrides dropped: {why}"}), event
