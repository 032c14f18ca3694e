"""Level-based reconcile of one InferenceDeployment: read → plan → build → apply.

- read: the CR and its children from the watch-fed cache (controller.cache), no API call;
- plan and build: the served spec, the desired children (builders) and every write, pure (controller.plan);
- apply: only the writes the plan holds, each answer put back into the cache.

Called by the kopf handlers for create/update/resume, by (coalesced) child events and by a drift
timer; it is idempotent, so it does not matter which of them runs it or how often. A no-op
reconcile makes no API call at all.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import ValidationError

from splitserve.api.base import API_GROUP, API_VERSION, KIND
from splitserve.api.spec import InferenceDeploymentSpec, Mode
from splitserve.api.status import InferenceDeploymentStatus, Problem
from splitserve.api.topology import SCALE_FIELD_MANAGER, Owner
from splitserve.builders.adapters import adapters_token_ref
from splitserve.builders.bundle import build_children, child_key
from splitserve.builders.target import Images, Target
from splitserve.controller.adapters import adapter_claims_to_check
from splitserve.controller.cache import ClusterCache
from splitserve.controller.metrics import OperatorMetrics
from splitserve.controller.plan import (
    PRUNABLE_KINDS,
    Children,
    StatusInput,
    Write,
    plan_mode_switch,
    plan_prune,
    plan_status,
    plan_writes,
)
from splitserve.controller.rollout import RolloutPlan, plan_rollout
from splitserve.diagnosis.fit import model_fit_problem
from splitserve.io.kube import KubeClient, KubeError
from splitserve.optimization.overrides import effective_spec, merge_patch_between, servable
from splitserve.validation import validate_object

log = logging.getLogger("splitserve.reconcile")

IDEP = (f"{API_GROUP}/{API_VERSION}", KIND)
__all__ = ["IDEP", "PRUNABLE_KINDS", "Reconciler", "RetryLater", "read_live", "utc_now"]

# Event poster: (owner body, type Normal|Warning, CamelCase reason, message).
EventSink = Callable[[Mapping[str, Any], str, str, str], Awaitable[None] | None]


class RetryLater(Exception):
    """The spec cannot be realised yet (missing Secret/PVC, API error): retry after `delay`."""

    def __init__(self, message: str, delay: float) -> None:
        super().__init__(message)
        self.delay = delay


def read_live(cache: ClusterCache, namespace: str, name: str) -> tuple[dict[str, Any], InferenceDeploymentSpec] | None:
    """The object and its spec as written; None when it is gone, being deleted or invalid (the
    reconciler reports InvalidSpec, so the periodic loops just skip it)."""
    body = cache.deployment(namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return None
    try:
        return body, InferenceDeploymentSpec.model_validate(body["spec"])
    except ValidationError:
        return None


# Specs whose verdict is remembered; past this many (a thousand CRs, or a spec churning) start afresh.
VERDICTS_KEPT = 4096
_SCHEMA_BUG = "the spec passed the schema but not the operator's model (a bug; reported, not retried)"


def _problem(body: Mapping[str, Any]) -> Problem | None:
    """Why the schema or the CEL rules reject the object, as one InvalidSpec problem (None: valid)."""
    problems = validate_object(dict(body))
    if not problems:
        return None
    return Problem("InvalidSpec", "; ".join(f"{p.path}: {p.message}" for p in problems))


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Reconciler:
    kube: KubeClient
    post_event: EventSink
    images: Images = field(default_factory=Images)
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    cache: ClusterCache = field(default_factory=ClusterCache)
    # One lock per InferenceDeployment: handlers, child events and timers never interleave on one object.
    _locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
    _verdicts: dict[str, Problem | None] = field(default_factory=dict)

    def _lock(self, namespace: str, name: str) -> asyncio.Lock:
        return self._locks.setdefault((namespace, name), asyncio.Lock())

    async def post(self, body: Mapping[str, Any], kind: str, reason: str, message: str) -> None:
        result = self.post_event(body, kind, reason, message)
        if result is not None:
            await result

    # ------------------------------------------------------------------ entry points

    async def reconcile(self, body: Mapping[str, Any], *, prune: bool = True, prerequisites: bool = True) -> None:
        """`prerequisites`: also check the Secret and PVC the spec names (two GETs at most). Done when the
        spec changes or the operator resumes; a child event or the drift pass does not repeat it."""
        meta = body["metadata"]
        async with self._lock(meta["namespace"], meta["name"]):
            # The cache may hold a newer version than the event that started this (our own status write).
            current = self.cache.deployment(meta["namespace"], meta["name"])
            if current is not None and current["metadata"].get("uid") == meta.get("uid"):
                body = {**body, "status": current.get("status") or {}}
            await self._reconcile_locked(body, prune=prune, prerequisites=prerequisites)

    async def reconcile_by_name(
        self, namespace: str, name: str, *, prune: bool = True, prerequisites: bool = False
    ) -> None:
        """The owner as the cache holds it, reconciled (spec changes, child events and timers alike)."""
        body = self.cache.deployment(namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return  # deleted: garbage collection removes the children
        await self.reconcile(body, prune=prune, prerequisites=prerequisites)

    # ------------------------------------------------------------------ the reconcile

    async def _reconcile_locked(self, body: Mapping[str, Any], *, prune: bool, prerequisites: bool) -> None:
        # read
        meta = body["metadata"]
        owner = Owner(meta["name"], meta["namespace"], meta["uid"])
        children = self.cache.owned(owner.namespace, owner.name)
        # plan: is the spec servable at all?
        verdict = self._verdict(body)
        if isinstance(verdict, Problem):
            await self._write_status(StatusInput(body, children, None, verdict, utc_now()))
            if verdict.message != _SCHEMA_BUG:
                await self.post(body, "Warning", "InvalidSpec", verdict.message)
            self.metrics.reconciles.labels("invalid").inc()
            return  # nothing to retry: the next spec change triggers a new reconcile
        written = verdict
        spec, invalid = await self._effective(body, written)
        previous = InferenceDeploymentStatus.model_validate(body.get("status") or {})
        pods = self.cache.worker_pods(owner.namespace, owner.name)
        # Adapters on a claim the cluster lacks are left out of the pods (status.adapters says so).
        claims = adapter_claims_to_check(spec, previous, every=prerequisites)
        missing_claims = await self._missing_claims(claims, owner.namespace)

        def status(
            problem: Problem | None, serving_mode: Mode | None = None, rollout: RolloutPlan | None = None
        ) -> StatusInput:
            return StatusInput(
                body,
                children,
                spec,
                problem,
                utc_now(),
                written,
                invalid,
                serving_mode,
                rollout,
                pods,
                missing_claims,
            )

        missing = await self._missing_prerequisites(spec, owner.namespace) if prerequisites else None
        if missing is not None:
            await self._write_status(status(missing))
            await self.post(body, "Warning", missing.reason, missing.message)
            self.metrics.reconciles.labels("degraded").inc()
            raise RetryLater(missing.message, delay=10)
        unfit = model_fit_problem(spec)
        if unfit is not None:
            # Pods would only crash with out-of-memory while loading: apply nothing, say why.
            await self._write_status(status(unfit))
            await self.post(body, "Warning", unfit.reason, unfit.message)
            self.metrics.reconciles.labels("degraded").inc()
            return
        # build, then plan the writes against what the cache holds
        target = Target(owner, spec, self.images, missing_claims)
        # Make-before-break: a new KV generation's pools come up beside the old ones, which drain.
        rollout = plan_rollout(spec, owner, children, target.generation, build_children(target), previous)
        writes = [*plan_writes(spec, rollout.desired, children, rollout.sizes), *rollout.writes]
        # Make-before-break: after a mode switch the old pools serve until the new ones are ready.
        switch = plan_mode_switch(spec, owner, children, target.generation)
        wanted = {child_key(child) for child in rollout.desired} | switch.keep | rollout.keep
        # Never prune on the strength of a cache that has not been listed once: a child missing from it
        # is unknown, not unwanted. (kopf runs no handler before its indexes are listed, so in the
        # operator this only guards callers that bypass it.)
        strays = plan_prune(children, wanted, owner) if prune and self.cache.synced else []
        removed = {child_key(dict(obj)) for obj in rollout.remove}
        strays = [obj for obj in strays if child_key(dict(obj)) not in removed]

        # apply
        failures = await self._perform(body, owner, writes)
        for obj in switch.remove:
            await self._delete(owner, obj)
        if switch.remove:
            names = ", ".join(f"{obj['kind']} {obj['metadata']['name']}" for obj in switch.remove)
            await self.post(body, "Normal", "ModeSwitched", f"{spec.mode} pools are ready; removed {names} (draining)")
        elif switch.waiting_for is not None:
            log.info(
                "%s/%s: keeping the previous mode's pools until %s is ready",
                owner.namespace,
                owner.name,
                switch.waiting_for,
            )
        for obj in rollout.remove:
            await self._delete(owner, obj)
        for obj in strays:
            await self._delete(owner, obj)
        for kind, reason, message in rollout.events:
            await self.post(body, kind, reason, message)
        problem = Problem("ApplyFailed", "; ".join(failures)) if failures else None
        # While the old pools are kept they are what serves: status reports that mode until the switch ends.
        previous_mode = Mode.AGGREGATED if spec.mode == Mode.DISAGGREGATED else Mode.DISAGGREGATED
        deleted = bool(switch.remove or rollout.remove or strays)
        wrote_status = await self._write_status(
            status(problem, previous_mode if switch.switching else None, rollout),
            children=self.cache.owned(owner.namespace, owner.name) if writes or deleted else children,
        )
        changed = bool(writes or deleted or wrote_status)
        self.metrics.reconciles.labels("degraded" if failures else "ok" if changed else "unchanged").inc()
        if problem is not None:
            await self.post(body, "Warning", "ApplyFailed", problem.message)
            raise RetryLater(problem.message, delay=30)

    def _verdict(self, body: Mapping[str, Any]) -> InferenceDeploymentSpec | Problem:
        """The parsed spec, or why it is invalid. The schema and CEL verdict is remembered per spec: it
        costs more than the rest of a no-op reconcile, and the spec changes rarely."""
        key = json.dumps([body.get("apiVersion"), body.get("kind"), body["metadata"].get("name"), body.get("spec")])
        if key not in self._verdicts:
            if len(self._verdicts) >= VERDICTS_KEPT:
                self._verdicts.clear()
            self._verdicts[key] = _problem(body)
        problem = self._verdicts[key]
        if problem is not None:
            return problem
        try:
            # Parsed afresh each time (cheap next to the checks): callers may change what they get.
            return InferenceDeploymentSpec.model_validate(body["spec"])
        except ValidationError as error:  # the schema passed, so this is our bug; still, do not crash-loop
            log.error("%s: %s", _SCHEMA_BUG, error)
            return Problem("InvalidSpec", _SCHEMA_BUG)

    async def _perform(self, body: Mapping[str, Any], owner: Owner, writes: list[Write]) -> list[str]:
        """Make the planned writes; failures come back as one line each. One Event per reason, not per child."""
        failures: list[str] = []
        said: dict[str, list[str]] = {}
        for write in writes:
            obj = write.obj
            try:
                await self._write(owner, write)
            except KubeError as error:
                if error.kind_not_installed:
                    failures.append(f"{obj['kind']} is not installed in this cluster ({error.message})")
                else:
                    failures.append(f"{obj['kind']}/{obj['metadata']['name']}: {error}")
                continue
            if write.reason:
                said.setdefault(write.reason, []).append(write.message)
        for reason, messages in said.items():
            verb = {"Created": "created", "Updated": "", "Scaled": ""}.get(reason, "")
            text = "; ".join(messages)
            await self.post(body, "Normal", reason, f"{verb} {text}".strip() if verb else text)
        return failures

    async def _write(self, owner: Owner, write: Write) -> None:
        obj = dict(write.obj)
        meta = obj["metadata"]
        if write.verb == "create":
            try:
                self.cache.wrote(await self.kube.create(obj, field_manager=SCALE_FIELD_MANAGER))
            except KubeError as error:
                if error.status != 409:
                    raise
                # The cache had not seen it yet: read it once, then apply over it like any other.
                found = await self.kube.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
                if found is not None:
                    self.cache.wrote(found)
                without_size = {**obj, "spec": {k: v for k, v in obj["spec"].items() if k != "replicas"}}
                self.cache.wrote((await self.kube.apply(without_size))[0])
        elif write.verb == "apply":
            self.cache.wrote((await self.kube.apply(obj))[0])
        elif write.verb == "patch":
            ops = [dict(op) for op in write.ops]
            self.cache.wrote(
                await self.kube.json_patch(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"], ops)
            )
        else:
            assert write.replicas is not None
            scale = await self.kube.scale(
                obj["apiVersion"],
                obj["kind"],
                meta["namespace"],
                meta["name"],
                write.replicas,
                field_manager=SCALE_FIELD_MANAGER,
            )
            self.cache.wrote(scaled(obj, write.replicas, scale))

    async def _delete(self, owner: Owner, obj: Mapping[str, Any]) -> None:
        api_version, kind, name = obj["apiVersion"], obj["kind"], obj["metadata"]["name"]
        try:
            await self.kube.delete(api_version, kind, owner.namespace, name)
        except KubeError as error:
            if not error.kind_not_installed:
                raise
        self.cache.deleted(api_version, kind, owner.namespace, name)

    async def _effective(
        self, body: Mapping[str, Any], spec: InferenceDeploymentSpec
    ) -> tuple[InferenceDeploymentSpec, bool]:
        """The spec to serve: the written spec with dynamic optimization's overrides merged in, and
        whether those overrides had to be ignored because the result is invalid."""
        overrides = ((body.get("status") or {}).get("autopilot") or {}).get("overrides") or {}
        if not overrides:
            return spec, False
        why = servable(body, spec, overrides)
        if why:
            # The status write drops them, so this is said once, not on every reconcile.
            await self.post(body, "Warning", "OptimizationInvalid", f"serving the spec as written: {why}"[:1000])
            return spec, True
        return effective_spec(spec, overrides), False

    async def _missing_claims(self, claims: list[str], namespace: str) -> frozenset[str]:
        """Those of `claims` (PersistentVolumeClaims) the namespace lacks."""
        found = [await self.kube.get("v1", "PersistentVolumeClaim", namespace, claim) for claim in claims]
        return frozenset(claim for claim, obj in zip(claims, found, strict=True) if obj is None)

    async def _missing_prerequisites(self, spec: InferenceDeploymentSpec, namespace: str) -> Problem | None:
        source = spec.model.source
        # The workers' one HF token: the model's, else the adapters' (their pods could not start without it).
        ref = adapters_token_ref(spec)
        if ref is not None:
            field = "model.source" if source.hugging_face and source.hugging_face.token_secret_ref else "adapters[]"
            secret = await self.kube.get("v1", "Secret", namespace, ref.name)
            if secret is None:
                return Problem("MissingSecret", f"Secret {ref.name} ({field}.huggingFace.tokenSecretRef) not found")
            if ref.key not in (secret.get("data") or {}) and ref.key not in (secret.get("stringData") or {}):
                return Problem("MissingSecretKey", f"Secret {ref.name} has no key {ref.key!r}")
        if source.pvc is not None:
            claim = await self.kube.get("v1", "PersistentVolumeClaim", namespace, source.pvc.claim_name)
            if claim is None:
                return Problem(
                    "MissingVolumeClaim", f"PersistentVolumeClaim {source.pvc.claim_name} (model.source.pvc) not found"
                )
        return None

    async def _write_status(self, inp: StatusInput, *, children: Children | None = None) -> bool:
        """Roll the status up (from `children` when given: the cache after this reconcile's writes); True if written."""
        if children is not None:
            inp = replace(inp, children=children)
        planned = plan_status(inp)
        if planned.event is not None:
            await self.post(inp.body, "Normal", *planned.event)
        meta = inp.body["metadata"]
        previous = InferenceDeploymentStatus.model_validate(inp.body.get("status") or {})
        return await self._patch_status_if_changed(meta["namespace"], meta["name"], previous, planned.status)

    async def update_status(
        self, namespace: str, name: str, mutate: Callable[[InferenceDeploymentStatus], InferenceDeploymentStatus]
    ) -> None:
        """Change the status parts a timer owns, serialised with reconciles of the same object."""
        async with self._lock(namespace, name):
            fresh = self.cache.deployment(namespace, name)
            if fresh is None:
                return
            previous = InferenceDeploymentStatus.model_validate(fresh.get("status") or {})
            await self._patch_status_if_changed(namespace, name, previous, mutate(previous))

    async def _patch_status_if_changed(
        self, namespace: str, name: str, previous: InferenceDeploymentStatus, status: InferenceDeploymentStatus
    ) -> bool:
        new = status.model_dump(by_alias=True, mode="json", exclude_none=True)
        old = previous.model_dump(by_alias=True, mode="json", exclude_none=True)
        if new == old:
            return False
        try:
            # A merge patch with nulls for removed keys, so a key that went away (an override) is removed.
            self.cache.wrote(await self.kube.patch_status(*IDEP, namespace, name, merge_patch_between(old, new)))
        except KubeError as error:
            if error.status != 404:
                raise
            log.info("%s/%s was deleted meanwhile; its children are garbage-collected", namespace, name)
        return True


def scaled(observed: Mapping[str, Any], replicas: int, scale: Mapping[str, Any]) -> dict[str, Any]:
    """The Deployment as it is after a /scale write: the Scale answer carries the new resourceVersion."""
    result = copy.deepcopy(dict(observed))
    result.setdefault("spec", {})["replicas"] = replicas
    version = (scale.get("metadata") or {}).get("resourceVersion")
    if version is not None:
        result["metadata"]["resourceVersion"] = version
    return result
