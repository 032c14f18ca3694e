"""Make-before-break rollout of a new KV generation, pure: the cached children in; the pool sizes,
the old Deployments kept or deleted, the status parts and the Events out.

A KV generation (api/generation.py) is a set of worker Deployments labelled
`splitserve.io/generation`; the router pairs prefill and decode only within one and prefers those
with a complete ready pair, so the operator moves traffic by sizing Deployments and nothing else.
When the spec's generation G differs from what runs, G's pools come up beside the old ones:

- target[r]: the size G's role r must reach, fixed when the rollout starts (the old generations'
  current size of that side, clamped to min/max with autoscaling on) and recorded on G's Deployment
  as `splitserve.io/rollout-target-replicas`, so every later reconcile reads it back from the cluster;
- G's size: min(target, ready + maxSurge): never more than maxSurge new workers loading at once;
- the old generations' size: target - G's ready workers once G has a ready pair, never below one
  per role before that, never above their current size; the non-serving and oldest shrink first;
- done when G is ready at target and the old Deployments are at 0 with no pod left (their pods
  drained while terminating): then the old Deployments are deleted;
- paused (status.rollout.paused, set by the analysis loop for G): G goes to 0, the old back to
  target, and nothing more until the spec's generation changes;
- a revert (G is a generation that still has pools) reuses those pools; the others drain.

During a rollout KEDA/HPA objects are withheld (pruned) and the built-in autoscaler stands aside, so
nothing but this plan sizes a pool. The Deployment statuses are the only memory besides the
annotation: `status.rollout` only says which generation's recorded target is current and whether
it is paused.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from splitserve.api.generation import generation_changes
from splitserve.api.spec import InferenceDeploymentSpec, Mode, Role
from splitserve.api.status import (
    ConditionType,
    GenerationPool,
    GenerationState,
    GenerationStatus,
    InferenceDeploymentStatus,
    RolloutStatus,
)
from splitserve.api.topology import (
    ANNOTATION_DECLARED_REPLICAS,
    ANNOTATION_GENERATION_INPUTS,
    ANNOTATION_ROLLOUT_TARGET,
    Owner,
    prefill_service_name,
    role_pool,
    worker_roles,
)
from splitserve.builders.autoscalers import is_autoscaler
from splitserve.controller.children import ChildKey, Children, Write, key_of, worker_pools, worker_role

MAX_GENERATIONS_SHOWN = 8  # status.generations' schema bound


def side(role: Role) -> Role:
    """Which half of a pair a pool is: decode and aggregated workers both answer decode requests."""
    return Role.PREFILL if role == Role.PREFILL else Role.DECODE


def _count(value: Any, default: int = 0) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


@dataclass(frozen=True)
class Pool:
    """One worker Deployment, as the plan reads it."""

    generation: str
    role: Role
    obj: Mapping[str, Any]

    @property
    def name(self) -> str:
        return str(self.obj["metadata"]["name"])

    @property
    def key(self) -> ChildKey:
        return key_of(self.obj)

    @property
    def desired(self) -> int:
        return _count((self.obj.get("spec") or {}).get("replicas"), 1)

    @property
    def ready(self) -> int:
        return _count((self.obj.get("status") or {}).get("readyReplicas"))

    def annotation(self, name: str) -> str | None:
        value = (self.obj["metadata"].get("annotations") or {}).get(name)
        return None if value is None else str(value)

    @property
    def gone(self) -> bool:
        """Sized to 0 and no pod left, as the Deployment controller last saw it: drained."""
        status = self.obj.get("status") or {}
        generation = self.obj["metadata"].get("generation")
        observed = status.get("observedGeneration")
        seen = observed is None or generation is None or _count(observed) >= _count(generation)
        pods = _count(status.get("replicas")) + _count(status.get("terminatingReplicas"))
        return self.desired == 0 and pods == 0 and seen


@dataclass(frozen=True)
class Generation:
    id: str
    pools: Mapping[Role, Pool] = field(default_factory=dict)

    def on(self, half: Role) -> list[Pool]:
        return [pool for role, pool in sorted(self.pools.items()) if side(role) == half]

    def ready(self, half: Role) -> int:
        return sum(pool.ready for pool in self.on(half))

    @property
    def has_pair(self) -> bool:
        """Every pool it has serves (a generation without prefill serves aggregated on decode)."""
        return bool(self.pools) and self.ready(Role.DECODE) >= 1 and all(p.ready >= 1 for p in self.pools.values())

    @property
    def created(self) -> str:
        return min((str(p.obj["metadata"].get("creationTimestamp") or "") for p in self.pools.values()), default="")

    @property
    def inputs(self) -> dict[str, Any] | None:
        """Its generation inputs as the builders recorded them on its Deployments (None: not recorded)."""
        for pool in self.pools.values():
            recorded = _inputs(pool.annotation(ANNOTATION_GENERATION_INPUTS))
            if recorded is not None:
                return recorded
        return None


def _inputs(text: str | None) -> dict[str, Any] | None:
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def generations_of(children: Children, owner: Owner) -> dict[str, Generation]:
    pools: dict[str, dict[Role, Pool]] = {}
    for generation, role, obj in worker_pools(children, owner):
        # One Deployment per generation and role by construction; a second (made by hand) is not ours.
        pools.setdefault(generation, {}).setdefault(role, Pool(generation, role, obj))
    return {generation: Generation(generation, found) for generation, found in pools.items()}


def by_keep_priority(generations: Iterable[Generation]) -> list[Generation]:
    """Most worth keeping first: serving ones before the others, newest before oldest (a legacy
    generation is the oldest). Capacity is taken from the end of this list."""
    return sorted(generations, key=lambda g: (g.has_pair, g.created, g.id), reverse=True)


@dataclass(frozen=True)
class RolloutPlan:
    """What the reconcile does about generations. Outside a rollout: nothing (`rolling` False)."""

    generation: str
    desired: list[dict[str, Any]]  # the children to apply (G's pools annotated, KEDA/HPA withheld)
    rolling: bool = False
    paused: bool = False
    complete: bool = False
    targets: Mapping[Role, int] = field(default_factory=dict)
    sizes: Mapping[str, int] = field(default_factory=dict)  # G's Deployment name -> replicas to create/scale to
    writes: tuple[Write, ...] = ()  # /scale of old generations' Deployments
    keep: frozenset[ChildKey] = frozenset()  # old Deployments (and what they need) not to prune
    remove: tuple[Mapping[str, Any], ...] = ()  # old Deployments to delete: the rollout is done
    events: tuple[tuple[str, str, str], ...] = ()  # (Normal|Warning, reason, message)
    changed: tuple[str, ...] | None = None  # generation_changes against the replaced one; None: unknown


def plan_rollout(
    spec: InferenceDeploymentSpec,
    owner: Owner,
    children: Children,
    generation: str,
    desired: list[dict[str, Any]],
    previous: InferenceDeploymentStatus,
) -> RolloutPlan:
    """Sizes, kept and deleted Deployments and Events for the served spec's generation `generation`."""
    generations = generations_of(children, owner)
    new = generations.pop(generation, Generation(generation))
    old = by_keep_priority(generations.values())
    prev = previous.rollout
    if not old:
        done = prev is not None and not prev.paused  # the old pools went by other hands than ours
        said = (("Normal", "RolloutComplete", f"KV generation {generation} serves alone"),) if done else ()
        return RolloutPlan(generation, desired, events=said)

    roles = worker_roles(spec)
    current = prev is not None and prev.generation == generation
    paused = current and prev is not None and prev.paused
    targets = {role: _target(spec, role, new, generations, prev, current) for role in roles}
    ready = {role: new.pools[role].ready if role in new.pools else 0 for role in roles}
    pair = all(ready[role] >= 1 or targets[role] == 0 for role in roles)
    new_sizes = {role: 0 if paused else min(targets[role], ready[role] + max_surge(spec, role)) for role in roles}
    old_sizes = _old_sizes(old, roles, targets, ready, pair=pair, paused=paused)
    complete = (
        not paused
        and all(
            role in new.pools and ready[role] >= targets[role] and new.pools[role].desired == targets[role]
            for role in roles
        )
        and all(old_sizes[pool.key] == 0 and pool.gone for g in old for pool in g.pools.values())
    )
    changed = _changed(desired, old[0])
    events = list(_events(generation, new, old, targets, prev, previous, changed, paused=paused))
    old_pools = [pool for g in old for pool in g.pools.values()]
    if complete:
        names = ", ".join(pool.name for pool in old_pools)
        counts = ", ".join(f"{role} {ready[role]}/{targets[role]}" for role in roles)
        events.append(
            ("Normal", "RolloutComplete", f"KV generation {generation} serves alone ({counts}); deleted {names}")
        )
        return RolloutPlan(
            generation,
            desired,
            rolling=True,
            complete=True,
            targets=targets,
            remove=tuple(pool.obj for pool in old_pools),
            events=tuple(events),
            changed=changed,
        )
    pool_names = {role: child["metadata"]["name"] for child in desired if (role := worker_role(child)) is not None}
    writes = tuple(
        Write(
            "scale",
            pool.obj,
            old_sizes[pool.key],
            "Scaled",
            f"rollout of {generation}: scaled {pool.name} from {pool.desired} to {old_sizes[pool.key]}",
        )
        for pool in old_pools
        if old_sizes[pool.key] != pool.desired
    )
    keep = {pool.key for pool in old_pools}
    prefill_service = ("v1", "Service", prefill_service_name(owner.name))
    if spec.mode == Mode.AGGREGATED and prefill_service in children and any(g.on(Role.PREFILL) for g in old):
        keep.add(prefill_service)  # the old prefill pools' Service, until they are gone
    return RolloutPlan(
        generation,
        _during_rollout(desired, targets),
        rolling=True,
        paused=paused,
        targets=targets,
        sizes={pool_names[role]: new_sizes[role] for role in roles if role in pool_names},
        writes=writes,
        keep=frozenset(keep),
        events=tuple(events),
        changed=changed,
    )


def max_surge(spec: InferenceDeploymentSpec, role: Role) -> int:
    return spec.rollout.prefill.max_surge if role == Role.PREFILL else spec.rollout.decode.max_surge


def _target(
    spec: InferenceDeploymentSpec,
    role: Role,
    new: Generation,
    others: Mapping[str, Generation],
    prev: RolloutStatus | None,
    current: bool,
) -> int:
    """target[role]: recorded on G's pool when this rollout recorded it; else the target of the
    rollout this one supersedes or reverts (recorded on that generation's pools); else fresh."""
    recorded: int | None = None
    if current and role in new.pools:
        recorded = _recorded(new.pools[role])
    elif prev is not None and prev.generation in others:
        earlier = others[prev.generation].on(side(role))
        recorded = _recorded(earlier[0]) if earlier else None
    if recorded is None:
        recorded = _fresh_target(spec, role, others.values())
    return _clamped(spec, role, recorded)


def _recorded(pool: Pool) -> int | None:
    text = pool.annotation(ANNOTATION_ROLLOUT_TARGET)
    return _count(text) if text is not None and text.isdigit() else None


def _fresh_target(spec: InferenceDeploymentSpec, role: Role, old: Iterable[Generation]) -> int:
    """The old generations' current size of this side: the new one takes over what serves now. The
    spec's count when no old pool has this side (a mode change) or, with autoscaling off, when the
    spec's count itself changed with this change (a new intent, as in plan_size)."""
    declared = role_pool(spec, role).replicas
    pools = [pool for g in old for pool in g.on(side(role))]
    if not pools:
        return declared
    if not spec.autoscaling.enabled and all(p.annotation(ANNOTATION_DECLARED_REPLICAS) != str(declared) for p in pools):
        return declared
    return sum(pool.desired for pool in pools)


def _clamped(spec: InferenceDeploymentSpec, role: Role, replicas: int) -> int:
    if not spec.autoscaling.enabled:
        return replicas
    pool = role_pool(spec, role)
    return min(max(replicas, pool.min_replicas), pool.max_replicas)


def _old_sizes(
    old: list[Generation],
    roles: list[Role],
    targets: Mapping[Role, int],
    ready: Mapping[Role, int],
    *,
    pair: bool,
    paused: bool,
) -> dict[ChildKey, int]:
    """The size of every old pool, side by side; `old` is in keep-priority order."""
    sizes: dict[ChildKey, int] = {}
    for half in (Role.PREFILL, Role.DECODE):
        pools = [pool for g in old for pool in g.on(half)]
        if not pools:
            continue
        role = next((r for r in roles if side(r) == half), None)
        have = sum(pool.desired for pool in pools)
        if paused:
            # Traffic back on the old: the most serving old generation back to target, the others
            # drained once it has its pair.
            first, rest = pools[0], pools[1:]
            sizes[first.key] = targets[role] if role is not None else first.desired
            primary = next(g for g in old if first in g.pools.values())
            for pool in rest:
                sizes[pool.key] = 0 if primary.has_pair else pool.desired
            continue
        if role is None:
            # The new generation has no pool of this side (aggregated now): it serves without one.
            for pool in pools:
                sizes[pool.key] = 0 if pair else pool.desired
            continue
        want = targets[role] - (ready[role] if pair else 0)
        if not pair:
            want = max(want, min(1, have))  # a ready old pair until the new one has its own
        remaining = min(max(want, 0), have)
        for pool in pools:
            sizes[pool.key] = min(pool.desired, remaining)
            remaining -= sizes[pool.key]
    return sizes


def _changed(desired: list[dict[str, Any]], replaced: Generation) -> tuple[str, ...] | None:
    after = next(
        (
            found
            for child in desired
            if worker_role(child) is not None
            and (found := _inputs((child["metadata"].get("annotations") or {}).get(ANNOTATION_GENERATION_INPUTS)))
        ),
        None,
    )
    before = replaced.inputs
    if after is None or before is None:
        return None
    return tuple(generation_changes(before, after))


def _events(
    generation: str,
    new: Generation,
    old: list[Generation],
    targets: Mapping[Role, int],
    prev: RolloutStatus | None,
    previous: InferenceDeploymentStatus,
    changed: tuple[str, ...] | None,
    *,
    paused: bool,
) -> Iterable[tuple[str, str, str]]:
    old_ids = ", ".join(g.id for g in old)
    if prev is None or prev.generation != generation:
        if new.pools and prev is not None:
            names = ", ".join(pool.name for pool in new.pools.values())
            yield (
                "Normal",
                "RolloutReverted",
                f"back to KV generation {generation}, reusing {names}; draining {old_ids}",
            )
        else:
            sizes = ", ".join(f"{role} 0/{target}" for role, target in targets.items())
            why = f" ({'; '.join(changed)})" if changed else ""
            yield "Normal", "RolloutStarted", f"rolling out KV generation {generation} beside {old_ids}{why}: {sizes}"
    if paused:
        was = next((g for g in previous.generations if g.id == generation), None)
        if was is None or was.state != GenerationState.PAUSED:
            message = prev.message if prev is not None and prev.message else "paused"
            yield (
                "Warning",
                "RolloutPaused",
                f"rollout of KV generation {generation} paused: {message}; traffic back on {old_ids}",
            )


def _during_rollout(desired: list[dict[str, Any]], targets: Mapping[Role, int]) -> list[dict[str, Any]]:
    """The desired children while a rollout sizes the pools: G's pools carry their target, and no
    KEDA/HPA object exists to fight over the size."""
    result = []
    for child in desired:
        if is_autoscaler(child):
            continue  # another scaler would size the pools: withheld while the rollout does
        role = worker_role(child)
        if role is not None and role in targets:
            meta = child["metadata"]
            annotations = {**(meta.get("annotations") or {}), ANNOTATION_ROLLOUT_TARGET: str(targets[role])}
            child = {**child, "metadata": {**meta, "annotations": annotations}}
        result.append(child)
    return result


# --------------------------------------------------------------------------- status


def with_generations(
    status: InferenceDeploymentStatus,
    plan: RolloutPlan,
    children: Children,
    owner: Owner,
    previous: InferenceDeploymentStatus,
    *,
    now: str,
    observed_generation: int,
) -> InferenceDeploymentStatus:
    """status.kvGeneration, .generations, .rollout and (during a rollout) Progressing, from the
    children as they are after this reconcile's writes."""
    generations = generations_of(children, owner)
    new = generations.pop(plan.generation, Generation(plan.generation))
    old = by_keep_priority(generations.values())
    serving = [g for g in (new, *old) if g.has_pair]
    total = sum(g.ready(Role.DECODE) for g in serving)

    def share(g: Generation) -> float:
        return round(g.ready(Role.DECODE) / total, 3) if g.has_pair and total else 0.0

    was = {g.id: g for g in previous.generations}
    new_pair = bool(new.pools) and all(
        pool.ready >= 1 or plan.targets.get(role, 1) == 0 for role, pool in new.pools.items()
    )

    def entry(g: Generation, state: GenerationState, changed: list[str]) -> GenerationStatus:
        before = was.get(g.id)
        return GenerationStatus(
            id=g.id,
            state=state,
            changed=changed,
            pools=[
                GenerationPool(role=str(role), ready=p.ready, desired=p.desired) for role, p in sorted(g.pools.items())
            ],
            traffic_share=share(g),
            analysis=before.analysis if before is not None else "",
            since=before.since if before is not None and before.state == state and before.since else now,
        )

    earlier = was.get(plan.generation)
    changed = list(plan.changed) if plan.changed is not None else (list(earlier.changed) if earlier else [])
    if not old:
        entries = [entry(new, GenerationState.SERVING, changed)]
        return status.model_copy(update={"kv_generation": plan.generation, "generations": entries, "rollout": None})
    new_state = GenerationState.PAUSED if plan.paused else GenerationState.ROLLING_OUT
    old_state = GenerationState.DRAINING if new_pair and not plan.paused else GenerationState.SERVING
    entries = [entry(new, new_state, changed), *(entry(g, old_state, []) for g in old)][:MAX_GENERATIONS_SHOWN]
    progress = ", ".join(
        f"{role} {new.pools[role].ready if role in new.pools else 0}/{target}" for role, target in plan.targets.items()
    )
    prev = previous.rollout if previous.rollout is not None and previous.rollout.generation == plan.generation else None
    ready = sum(min(new.pools[r].ready, t) if r in new.pools else 0 for r, t in plan.targets.items())
    wanted = sum(plan.targets.values())
    replacing = sorted((g for g in old), key=lambda g: (g.created, g.id))
    if plan.paused:
        reason = prev.reason if prev is not None and prev.reason else "RolloutPaused"
        message = prev.message if prev is not None and prev.message else "paused"
        summary = f"{plan.generation} paused"
        status = status.with_condition(
            ConditionType.PROGRESSING,
            "False",
            "RolloutPaused",
            f"KV generation {plan.generation} paused: {message}",
            now=now,
            generation=observed_generation,
        )
    else:
        reason, message = "RollingOut", f"{progress} ready"
        summary = f"{plan.generation} {ready}/{wanted} {round(share(new) * 100)}%"
        status = status.with_condition(
            ConditionType.PROGRESSING,
            "True",
            "RollingOut",
            f"rolling out KV generation {plan.generation} ({progress} ready), replacing "
            + ", ".join(g.id for g in replacing),
            now=now,
            generation=observed_generation,
        )
    rollout = RolloutStatus(
        generation=plan.generation,
        replacing=[g.id for g in replacing],
        paused=plan.paused,
        reason=reason,
        message=message,
        started=prev.started if prev is not None and prev.started else now,
        summary=summary,
    )
    return status.model_copy(update={"kv_generation": plan.generation, "generations": entries, "rollout": rollout})
