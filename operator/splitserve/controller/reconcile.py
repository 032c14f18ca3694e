"""Level-based reconcile of one InferenceDeployment: desired children applied, strays pruned,
status rolled up. Called by the kopf handlers for create/update/resume, by child events and by
a drift timer; it is idempotent, so it does not matter which of them runs it or how often.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from splitserve.api.spec import InferenceDeploymentSpec, Mode, Role
from splitserve.api.status import AutopilotStatus, Condition, ConditionType, InferenceDeploymentStatus
from splitserve.builders.bundle import build_children, child_key
from splitserve.builders.naming import (
    ANNOTATION_DECLARED_REPLICAS,
    LABEL_DEPLOYMENT,
    LABEL_ROLE,
    ROUTER_ROLE,
    SCALE_FIELD_MANAGER,
    Images,
    Owner,
    Target,
    pool_name,
    prefill_service_name,
    router_endpoint,
    router_name,
    worker_roles,
)
from splitserve.builders.vllm_args import role_pool
from splitserve.controller.drift import contains
from splitserve.controller.effective import active_overrides, declared, effective_spec, merge_patch_between
from splitserve.controller.kube import KubeClient, KubeError
from splitserve.controller.metrics import OperatorMetrics
from splitserve.controller.rollup import PoolObservation, Problem, merge_condition, roll_up
from splitserve.diagnosis.findings import DiagnosisInput
from splitserve.diagnosis.model_facts import model_facts
from splitserve.diagnosis.questions import hardware_fit
from splitserve.diagnosis.service import gpu_choices
from splitserve.validation import validate_object

log = logging.getLogger("splitserve.reconcile")

IDEP = ("splitserve.io/v1alpha1", "InferenceDeployment")
# Kinds whose set of children can change with the spec (mode, monitoring, autoscaling backend):
# these are listed and pruned; the others always exist with a fixed name.
PRUNABLE_KINDS: list[tuple[str, str]] = [
    ("apps/v1", "Deployment"),
    ("v1", "Service"),
    ("policy/v1", "PodDisruptionBudget"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("keda.sh/v1alpha1", "ScaledObject"),
    ("autoscaling/v2", "HorizontalPodAutoscaler"),
]

# Event poster: (owner body, type Normal|Warning, CamelCase reason, message).
EventSink = Callable[[Mapping[str, Any], str, str, str], Awaitable[None] | None]


Key = tuple[str, str, str]


class RetryLater(Exception):
    """The spec cannot be realised yet (missing Secret/PVC, API error): retry after `delay`."""

    def __init__(self, message: str, delay: float) -> None:
        super().__init__(message)
        self.delay = delay


async def read_live(
    kube: KubeClient, namespace: str, name: str
) -> tuple[dict[str, Any], InferenceDeploymentSpec] | None:
    """The object and its spec as written; None when it is gone, being deleted or invalid (the
    reconciler reports InvalidSpec, so the periodic loops just skip it)."""
    body = await kube.get(*IDEP, namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return None
    try:
        return body, InferenceDeploymentSpec.model_validate(body["spec"])
    except ValidationError:
        return None


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Reconciler:
    kube: KubeClient
    post_event: EventSink
    images: Images = field(default_factory=Images)
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    # One lock per InferenceDeployment: handlers, child events and timers never interleave on one object.
    _locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)

    def _lock(self, namespace: str, name: str) -> asyncio.Lock:
        return self._locks.setdefault((namespace, name), asyncio.Lock())

    async def post(self, body: Mapping[str, Any], kind: str, reason: str, message: str) -> None:
        result = self.post_event(body, kind, reason, message)
        if result is not None:
            await result

    # ------------------------------------------------------------------ entry points

    async def reconcile(self, body: Mapping[str, Any], *, prune: bool = True) -> None:
        meta = body["metadata"]
        async with self._lock(meta["namespace"], meta["name"]):
            await self._reconcile_locked(body, prune=prune)

    async def reconcile_by_name(self, namespace: str, name: str, *, prune: bool = False) -> None:
        """For child events and timers: read the owner fresh, then reconcile it."""
        body = await self.kube.get(*IDEP, namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return  # deleted: garbage collection removes the children
        await self.reconcile(body, prune=prune)

    # ------------------------------------------------------------------ the reconcile

    async def _reconcile_locked(self, body: Mapping[str, Any], *, prune: bool) -> None:
        meta = body["metadata"]
        owner = Owner(meta["name"], meta["namespace"], meta["uid"])
        problems = validate_object(dict(body))
        if problems:
            message = "; ".join(f"{p.path}: {p.message}" for p in problems)
            await self._write_status(body, None, Problem("InvalidSpec", message))
            await self.post(body, "Warning", "InvalidSpec", message)
            self.metrics.reconciles.labels("invalid").inc()
            return  # nothing to retry: the next spec change triggers a new reconcile
        try:
            spec = InferenceDeploymentSpec.model_validate(body["spec"])
        except ValidationError as error:  # the schema passed, so this is our bug; still, do not crash-loop
            await self._write_status(body, None, Problem("InvalidSpec", str(error)))
            return
        written = spec
        spec, invalid = await self._effective(body, written)

        missing = await self._missing_prerequisites(spec, owner.namespace)
        if missing is not None:
            await self._write_status(body, spec, missing, written, invalid)
            await self.post(body, "Warning", missing.reason, missing.message)
            self.metrics.reconciles.labels("degraded").inc()
            raise RetryLater(missing.message, delay=10)

        unfit = model_fit_problem(spec)
        if unfit is not None:
            # Pods would only crash with out-of-memory while loading: apply nothing, say why.
            await self._write_status(body, spec, unfit, written, invalid)
            await self.post(body, "Warning", unfit.reason, unfit.message)
            self.metrics.reconciles.labels("degraded").inc()
            return
        target = Target(owner, spec, self.images)
        desired = build_children(target)
        failures: list[str] = []
        for child in desired:
            try:
                await self._apply_child(body, spec, child)
            except KubeError as error:
                if error.kind_not_installed:
                    failures.append(f"{child['kind']} is not installed in this cluster ({error.message})")
                else:
                    failures.append(f"{child['kind']}/{child['metadata']['name']}: {error}")
        # Make-before-break: after a mode switch the old pools serve until the new ones are ready.
        kept = await self._switch_pools(body, owner, spec)
        if prune:
            await self._prune(owner, {child_key(child) for child in desired} | kept)
        problem = Problem("ApplyFailed", "; ".join(failures)) if failures else None
        # While the old pools are kept they are what serves: status reports that mode until the switch ends.
        previous_mode = Mode.AGGREGATED if spec.mode == Mode.DISAGGREGATED else Mode.DISAGGREGATED
        await self._write_status(body, spec, problem, written, invalid, serving_mode=previous_mode if kept else None)
        self.metrics.reconciles.labels("degraded" if failures else "ok").inc()
        if failures:
            await self.post(body, "Warning", "ApplyFailed", problem.message if problem else "")
            raise RetryLater(problem.message if problem else "", delay=30)

    async def _effective(
        self, body: Mapping[str, Any], spec: InferenceDeploymentSpec
    ) -> tuple[InferenceDeploymentSpec, bool]:
        """The spec to serve: the written spec with dynamic optimization's overrides (read fresh) merged in,
        and whether those overrides had to be ignored because the result is invalid."""
        meta = body["metadata"]
        fresh = await self.kube.get(*IDEP, meta["namespace"], meta["name"])
        autopilot = ((fresh or body).get("status") or {}).get("autopilot") or {}
        overrides = autopilot.get("overrides") or {}
        if not overrides:
            return spec, False
        try:
            effective = effective_spec(spec, overrides)
        except ValidationError as error:
            effective, why = spec, str(error)
        else:
            problems = validate_object({**body, "spec": declared(effective)})
            why = "; ".join(f"{p.path}: {p.message}" for p in problems)
        if why:
            # _write_status drops them from status, so this is said once, not on every reconcile.
            await self.post(body, "Warning", "OptimizationInvalid", f"serving the spec as written: {why}"[:1000])
            return spec, True
        return effective, False

    async def _switch_pools(self, body: Mapping[str, Any], owner: Owner, spec: InferenceDeploymentSpec) -> set[Key]:
        """Children of the previous mode to keep for now; removed once every new pool is ready.

        Worker Deployments of roles the mode no longer has (and the prefill Service when going
        aggregated) stay until each new pool has a ready replica (or is sized to zero). The router
        keeps serving meanwhile: decode and aggregated workers share the decode Service, and a router
        without prefill workers sends requests whole to decode. Deleting the old pool then lets its
        pods leave the EndpointSlices as terminating and drain (preStop pause, then the worker's drain).
        """
        wanted = worker_roles(spec)
        leftovers: list[dict[str, Any]] = []
        for role in Role:
            if role in wanted:
                continue
            found = await self.kube.get("apps/v1", "Deployment", owner.namespace, pool_name(owner.name, role))
            if found is not None and _owned_by(found, owner):
                leftovers.append(found)
        if not leftovers:
            return set()
        if spec.mode == Mode.AGGREGATED:
            service = await self.kube.get("v1", "Service", owner.namespace, prefill_service_name(owner.name))
            if service is not None and _owned_by(service, owner):
                leftovers.append(service)
        for role in wanted:
            pool = await self.kube.get("apps/v1", "Deployment", owner.namespace, pool_name(owner.name, role))
            if pool is None or not _serving(pool):
                log.info(
                    "%s/%s: keeping the previous mode's pools until %s is ready", owner.namespace, owner.name, role
                )
                return {child_key(obj) for obj in leftovers}
        names = []
        for obj in leftovers:
            await self.kube.delete(obj["apiVersion"], obj["kind"], owner.namespace, obj["metadata"]["name"])
            names.append(f"{obj['kind']} {obj['metadata']['name']}")
        await self.post(
            body, "Normal", "ModeSwitched", f"{spec.mode} pools are ready; removed {', '.join(names)} (draining)"
        )
        return set()

    async def _missing_prerequisites(self, spec: InferenceDeploymentSpec, namespace: str) -> Problem | None:
        source = spec.model.source
        if source.hugging_face and source.hugging_face.token_secret_ref:
            ref = source.hugging_face.token_secret_ref
            secret = await self.kube.get("v1", "Secret", namespace, ref.name)
            if secret is None:
                return Problem(
                    "MissingSecret", f"Secret {ref.name} (model.source.huggingFace.tokenSecretRef) not found"
                )
            if ref.key not in (secret.get("data") or {}) and ref.key not in (secret.get("stringData") or {}):
                return Problem("MissingSecretKey", f"Secret {ref.name} has no key {ref.key!r}")
        if source.pvc is not None:
            claim = await self.kube.get("v1", "PersistentVolumeClaim", namespace, source.pvc.claim_name)
            if claim is None:
                return Problem(
                    "MissingVolumeClaim", f"PersistentVolumeClaim {source.pvc.claim_name} (model.source.pvc) not found"
                )
        return None

    async def _apply_child(self, body: Mapping[str, Any], spec: InferenceDeploymentSpec, child: dict[str, Any]) -> None:
        meta = child["metadata"]
        observed = await self.kube.get(child["apiVersion"], child["kind"], meta["namespace"], meta["name"])
        role = _worker_role(child)
        if observed is None and role is not None:
            # Created with its declared size by the scaler's field manager: the operator's own
            # apply set never contains spec.replicas (see builders.workers).
            declared = int(meta["annotations"][ANNOTATION_DECLARED_REPLICAS])
            sized = {**child, "spec": {**child["spec"], "replicas": declared}}
            await self.kube.create(sized, field_manager=SCALE_FIELD_MANAGER)
            await self.post(body, "Normal", "Created", f"created {child['kind']} {meta['name']} ({declared} replicas)")
            return
        if observed is None or not contains(observed, child):
            _, created = await self.kube.apply(child)
            if created:
                await self.post(body, "Normal", "Created", f"created {child['kind']} {meta['name']}")
            elif observed is not None:
                await self.post(body, "Normal", *_change_event(observed, child))
        if observed is not None and role is not None:
            await self._size_pool(body, spec, role, child, observed)

    async def _size_pool(
        self,
        body: Mapping[str, Any],
        spec: InferenceDeploymentSpec,
        role: Role,
        child: Mapping[str, Any],
        observed: Mapping[str, Any],
    ) -> None:
        """Write the spec's pool size only when the spec's declared count changed.

        With autoscaling off, a changed `replicas` in the spec is applied; a `kubectl scale` of the
        Deployment stays until the spec's count changes again. With autoscaling on, the autoscaler
        (built-in, KEDA or HPA) owns the size; the operator only pulls it back inside min/max.
        """
        meta = child["metadata"]
        declared = int(meta["annotations"][ANNOTATION_DECLARED_REPLICAS])
        previously = (observed["metadata"].get("annotations") or {}).get(ANNOTATION_DECLARED_REPLICAS)
        current = int(observed.get("spec", {}).get("replicas", 1))
        pool = role_pool(spec, role)
        if not spec.autoscaling.enabled:
            wanted, why = (declared, "the spec's replicas changed") if previously != str(declared) else (current, "")
        else:
            wanted = min(max(current, pool.min_replicas), pool.max_replicas)
            why = f"kept within minReplicas {pool.min_replicas} and maxReplicas {pool.max_replicas}"
        if wanted != current:
            await self.kube.scale(
                "apps/v1", "Deployment", meta["namespace"], meta["name"], wanted, field_manager=SCALE_FIELD_MANAGER
            )
            await self.post(body, "Normal", "Scaled", f"scaled {meta['name']} from {current} to {wanted}: {why}")

    async def _prune(self, owner: Owner, desired: set[tuple[str, str, str]]) -> None:
        for api_version, kind in PRUNABLE_KINDS:
            try:
                observed = await self.kube.list(api_version, kind, owner.namespace, f"{LABEL_DEPLOYMENT}={owner.name}")
            except KubeError as error:
                if error.kind_not_installed:
                    continue
                raise
            for obj in observed:
                refs = obj["metadata"].get("ownerReferences", [])
                ours = any(ref.get("uid") == owner.uid for ref in refs)
                if ours and child_key(obj) not in desired:
                    await self.kube.delete(api_version, kind, owner.namespace, obj["metadata"]["name"])

    async def _write_status(
        self,
        body: Mapping[str, Any],
        spec: InferenceDeploymentSpec | None,
        problem: Problem | None,
        written: InferenceDeploymentSpec | None = None,
        invalid_overrides: bool = False,
        *,
        serving_mode: Mode | None = None,
    ) -> None:
        """Roll up status for the served (effective) `spec`; `written` is the CR's own spec.

        `serving_mode` is set during a mode switch: the previous mode's pools still serve.
        """
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        # Read the status fresh: the autoscaler and diagnosis timers write parts of it too.
        fresh = await self.kube.get(*IDEP, namespace, name)
        previous = InferenceDeploymentStatus.model_validate((fresh or body).get("status") or {})
        observations: dict[str, PoolObservation | None] = {}
        for component in ("prefill", "decode", "aggregated", ROUTER_ROLE):
            deployment_name = router_name(name) if component == ROUTER_ROLE else pool_name(name, component)
            observations[component] = PoolObservation.from_deployment(
                await self.kube.get("apps/v1", "Deployment", namespace, deployment_name)
            )
        mode = serving_mode or (spec.mode if spec is not None else _declared_mode(body))
        status = roll_up(
            mode=mode,
            generation=int(meta.get("generation", 0)),
            previous=previous,
            prefill=observations["prefill"],
            decode=observations["aggregated"] if mode == Mode.AGGREGATED else observations["decode"],
            router=observations[ROUTER_ROLE],
            endpoint=router_endpoint(Owner(name, namespace), spec.router.port) if spec else previous.endpoint,
            problem=problem,
            now=utc_now(),
        )
        if serving_mode is not None and spec is not None:
            switching = Condition(
                type=ConditionType.PROGRESSING,
                status="True",
                reason="SwitchingMode",
                message=f"serving {serving_mode} until every {spec.mode} pool has a ready replica",
                last_transition_time=utc_now(),
                observed_generation=int(meta.get("generation", 0)),
            )
            status = status.model_copy(update={"conditions": merge_condition(status.conditions, switching)})
        if written is not None and previous.autopilot is not None:
            autopilot = await self._drop_inactive(body, written, previous.autopilot, invalid=invalid_overrides)
            status = status.model_copy(update={"autopilot": autopilot})
        await self._patch_status_if_changed(namespace, name, previous, status)

    async def _drop_inactive(
        self, body: Mapping[str, Any], written: InferenceDeploymentSpec, autopilot: AutopilotStatus, *, invalid: bool
    ) -> AutopilotStatus:
        """Overrides that no longer apply (dynamic turned off, a kind vetoed, invalid) leave status at once."""
        kept = {} if invalid else active_overrides(written, autopilot.overrides)
        if kept == autopilot.overrides:
            return autopilot
        if invalid:
            why = "the spec with them would be invalid"
        elif not written.optimization.dynamic:
            why = "dynamic optimization is off"
        else:
            why = "vetoed or equal to the spec"
        dropped = sorted(set(autopilot.overrides) - set(kept)) or sorted(autopilot.overrides)
        if autopilot.overrides:
            await self.post(body, "Normal", "OptimizationDropped", f"serving the spec as written for {dropped}: {why}")
        return autopilot.model_copy(update={"overrides": kept, "note": f"overrides dropped: {why}"})

    async def update_status(
        self, namespace: str, name: str, mutate: Callable[[InferenceDeploymentStatus], InferenceDeploymentStatus]
    ) -> None:
        """Change the status parts a timer owns, serialised with reconciles of the same object."""
        async with self._lock(namespace, name):
            fresh = await self.kube.get(*IDEP, namespace, name)
            if fresh is None:
                return
            previous = InferenceDeploymentStatus.model_validate(fresh.get("status") or {})
            await self._patch_status_if_changed(namespace, name, previous, mutate(previous))

    async def _patch_status_if_changed(
        self, namespace: str, name: str, previous: InferenceDeploymentStatus, status: InferenceDeploymentStatus
    ) -> None:
        new = status.model_dump(by_alias=True, mode="json", exclude_none=True)
        old = previous.model_dump(by_alias=True, mode="json", exclude_none=True)
        if new == old:
            return
        try:
            # A merge patch with nulls for removed keys, so a key that went away (an override) is removed.
            await self.kube.patch_status(*IDEP, namespace, name, merge_patch_between(old, new))
        except KubeError as error:
            if error.status != 404:
                raise
            log.info("%s/%s was deleted meanwhile; its children are garbage-collected", namespace, name)


def _owned_by(obj: Mapping[str, Any], owner: Owner) -> bool:
    return any(ref.get("uid") == owner.uid for ref in obj["metadata"].get("ownerReferences", []))


def _serving(deployment: Mapping[str, Any]) -> bool:
    """A pool is serving once it has a ready replica, or when it is sized to zero on purpose."""
    wanted = int(deployment.get("spec", {}).get("replicas", 1))
    return wanted == 0 or int((deployment.get("status") or {}).get("readyReplicas", 0)) >= 1


def _declared_mode(body: Mapping[str, Any]) -> Mode:
    """The mode an invalid spec asks for, so its status still reports the right pools."""
    declared = (body.get("spec") or {}).get("mode")
    return Mode.AGGREGATED if declared == Mode.AGGREGATED.value else Mode.DISAGGREGATED


def _change_event(observed: Mapping[str, Any], desired: Mapping[str, Any]) -> tuple[str, str]:
    """(reason, message) for a child we changed: Scaled when only its replica count moved."""
    label = f"{desired['kind']} {desired['metadata']['name']}"
    before = observed.get("spec", {}).get("replicas")
    after = desired.get("spec", {}).get("replicas")
    if after is not None and before != after:
        rest_observed = {**observed, "spec": {**observed.get("spec", {}), "replicas": after}}
        if contains(rest_observed, desired):
            return "Scaled", f"scaled {label} from {before} to {after} replicas"
    return "Updated", f"updated {label} to match the spec"


def _worker_role(child: Mapping[str, Any]) -> Role | None:
    """The role of a worker pool Deployment, or None for anything else (incl. the router)."""
    if child["kind"] != "Deployment":
        return None
    role = child["metadata"].get("labels", {}).get(LABEL_ROLE)
    return Role(role) if role in {r.value for r in Role} else None


def model_fit_problem(spec: InferenceDeploymentSpec) -> Problem | None:
    """ModelDoesNotFit when the weights certainly exceed the pools' GPUs (diagnosis question 1).

    Only certain verdicts block: the GPU type must be known from a node selector (not assumed)
    and the parameter count declared or read from the model's config (not guessed from a name).
    """
    facts = model_facts(spec)
    gpus = gpu_choices(spec, None)
    if any(choice.assumed for choice in gpus.values()) or facts.parameter_count is None:
        return None
    if spec.model.parameter_count is None and "config" not in facts.parameter_source:
        return None
    result = hardware_fit(DiagnosisInput(spec, facts, gpus))
    if not result.verdict.startswith("does not fit"):
        return None
    return Problem("ModelDoesNotFit", f"{result.verdict}. Options: {result.recommendation}"[:2000])
