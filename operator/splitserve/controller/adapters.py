"""status.adapters and the AdaptersReady condition, pure: the worker pods' own reports in.

Each worker's adapter sync sets the condition splitserve.io/AdaptersReady on its pod (api.topology): True
(AdaptersLoaded, message `loaded a, b`) once it serves every adapter of its adapters file, else False with
AdaptersLoading (`loading a, b`) or AdapterLoadFailed and a message of `<adapter>: <why>` entries joined by
"; ". Here the serving workers' reports become, per declared adapter, how many serve it and, when not all,
why: the first failure's reason and message, so `kubectl get` names the adapter that cannot be loaded and
vLLM's words for it.

A worker counts while its pod is Ready and not terminating (it takes requests); one that has not reported
yet counts as loading, and so does an adapter its `loaded ...` report does not name (the kubelet refreshes
the mounted adapters file within a minute or so of a ConfigMap change: until then the worker has not seen
a new adapter). Adapter names hold no spaces, so the lists split on ", ".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set
from typing import Any

from splitserve.api.spec import AdapterSpec, InferenceDeploymentSpec, Role
from splitserve.api.status import AdapterStatus, ConditionStatus, ConditionType, InferenceDeploymentStatus
from splitserve.api.topology import (
    ADAPTER_LOAD_FAILED,
    ADAPTERS_CONDITION,
    ADAPTERS_LOADED,
    ADAPTERS_LOADING,
    LABEL_ROLE,
    serves_adapters,
)
from splitserve.builders.adapters import adapter_claims

WORKER_ROLES = frozenset(role.value for role in Role)
# Per-adapter reasons (status.adapters[].reason).
LOADED = "AdapterLoaded"
LOADING = "AdapterLoading"
LOAD_FAILED = ADAPTER_LOAD_FAILED
MISSING_CLAIM = "MissingVolumeClaim"
NO_WORKERS = "NoWorkers"
FAILING = (MISSING_CLAIM, LOAD_FAILED)
MESSAGE_LIMIT = 1000  # characters of one adapter's message kept in status


def slim_pod(body: Mapping[str, Any]) -> dict[str, Any]:
    """What the operator keeps of a worker pod (its pods index): name, labels, whether it is going, and the
    two conditions read here. A pod's full status would only cost memory."""
    meta = body.get("metadata") or {}
    status = body.get("status") or {}
    kept = {"Ready", ADAPTERS_CONDITION}
    return {
        "metadata": {
            "name": meta.get("name"),
            "labels": dict(meta.get("labels") or {}),
            **({"deletionTimestamp": meta["deletionTimestamp"]} if meta.get("deletionTimestamp") else {}),
        },
        "status": {"conditions": [dict(c) for c in status.get("conditions") or [] if c.get("type") in kept]},
    }


def _condition(pod: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == kind), None)


def serving_workers(pods: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The worker pods that take requests: Ready, not terminating; sorted by name (stable messages)."""
    serving = [
        pod
        for pod in pods
        if (pod.get("metadata") or {}).get("labels", {}).get(LABEL_ROLE) in WORKER_ROLES
        and not (pod.get("metadata") or {}).get("deletionTimestamp")
        and (_condition(pod, "Ready") or {}).get("status") == "True"
    ]
    return sorted(serving, key=lambda pod: str(pod["metadata"].get("name")))


def failure_messages(message: str, names: Iterable[str]) -> dict[str, str]:
    """A report's `<adapter>: <why>; ...` message as {adapter: why}, for the declared `names` only. An entry is
    found by its name, so a `; ` inside vLLM's reason stays part of that reason."""
    known = sorted(set(names), key=len, reverse=True)  # "a:b" before "a", should both be declared
    found: dict[str, str] = {}
    current: str | None = None
    for piece in message.split("; "):
        name = next((n for n in known if piece.startswith(n + ": ")), None)
        if name is not None:
            current = name
            found[name] = piece[len(name) + 2 :]
        elif current is not None:
            found[current] += "; " + piece
    return found


def _listed(message: str, prefix: str) -> set[str] | None:
    """The names of a `loaded a, b` / `loading a, b` report; None for a message of another form."""
    if not message.startswith(prefix):
        return None
    return {name for name in message[len(prefix) :].split(", ") if name}


def _adapter_state(pod: Mapping[str, Any], adapter: str, names: Set[str]) -> tuple[str, str]:
    """(reason, message) of one adapter on one serving worker."""
    condition = _condition(pod, ADAPTERS_CONDITION)
    if condition is None:
        return LOADING, "a worker has not reported its adapters yet"
    message = str(condition.get("message") or "")
    if condition.get("status") == "True":
        loaded = _listed(message, "loaded ")
        if loaded is None or adapter in loaded:
            return LOADED, ""
        return LOADING, "a worker has not read it from its adapters file yet"
    if condition.get("reason") == ADAPTERS_LOADING:
        loading = _listed(message, "loading ")
        if loading is not None:
            return (LOADING, "loading") if adapter in loading else (LOADED, "")
    named = failure_messages(message, names)
    if adapter in named:
        reason = LOAD_FAILED if condition.get("reason") == ADAPTER_LOAD_FAILED else LOADING
        return reason, named[adapter]
    if named:
        return LOADED, ""  # the report names the others only
    return LOADING, message or str(condition.get("reason") or "loading")


def _one_adapter(
    adapter: AdapterSpec, workers: list[Mapping[str, Any]], names: Set[str], missing_claims: Set[str]
) -> AdapterStatus:
    pvc = adapter.source.pvc
    if pvc is not None and pvc.claim_name in missing_claims:
        return AdapterStatus(
            name=adapter.name,
            workers=len(workers),
            reason=MISSING_CLAIM,
            message=f"PersistentVolumeClaim {pvc.claim_name} not found: the workers do not mount it, nor load "
            "the adapter, until it exists",
        )
    states = [(str(pod["metadata"]["name"]), *_adapter_state(pod, adapter.name, names)) for pod in workers]
    ready = sum(1 for _, reason, _ in states if reason == LOADED)
    failed = [(pod, message) for pod, reason, message in states if reason == LOAD_FAILED]
    if failed:
        pod, message = failed[0]
        where = f" (on {len(failed)} of {len(workers)} workers, e.g. {pod})"
        reason, text = LOAD_FAILED, message[: MESSAGE_LIMIT - len(where)] + where
    elif not workers:
        reason, text = NO_WORKERS, "no worker is serving yet"
    elif ready < len(workers):
        waiting = next(message for _, reason, message in states if reason != LOADED)
        reason, text = LOADING, f"{len(workers) - ready} of {len(workers)} workers still loading it ({waiting})"
    else:
        reason, text = LOADED, ""
    return AdapterStatus(name=adapter.name, ready_workers=ready, workers=len(workers), reason=reason, message=text)


def adapter_statuses(
    spec: InferenceDeploymentSpec, pods: Iterable[Mapping[str, Any]], missing_claims: Set[str] = frozenset()
) -> list[AdapterStatus]:
    """status.adapters: each declared adapter, in the spec's order, on the serving workers."""
    workers = serving_workers(pods)
    names = {adapter.name for adapter in spec.adapters}
    return [_one_adapter(adapter, workers, names, missing_claims) for adapter in spec.adapters]


def adapters_condition(adapters: list[AdapterStatus]) -> tuple[ConditionStatus, str, str]:
    """AdaptersReady: True when every worker serves every adapter; False naming each adapter that fails (a
    missing claim, a load error) with its reason and message, else the ones still loading; Unknown while no
    worker serves."""
    failing = [a for a in adapters if a.reason in FAILING]
    if failing:
        text = "; ".join(f"{a.name}: {a.reason}: {a.message}" for a in failing)
        return "False", failing[0].reason, text
    if any(a.reason == NO_WORKERS for a in adapters):
        return "Unknown", NO_WORKERS, "no worker is serving yet"
    loading = [a for a in adapters if a.reason != LOADED]
    if loading:
        text = "; ".join(f"{a.name}: {a.ready_workers}/{a.workers} workers" for a in loading)
        return "False", LOADING, text
    workers = adapters[0].workers if adapters else 0
    return "True", ADAPTERS_LOADED, f"{len(adapters)} adapters loaded on every worker ({workers})"


def with_adapters(
    status: InferenceDeploymentStatus,
    spec: InferenceDeploymentSpec,
    pods: Iterable[Mapping[str, Any]],
    missing_claims: Set[str],
    *,
    now: str,
    generation: int,
) -> InferenceDeploymentStatus:
    """The status with its adapters parts: status.adapters and AdaptersReady while adapters are declared,
    neither once they are not."""
    if not serves_adapters(spec):
        return status.without_condition(ConditionType.ADAPTERS_READY).model_copy(update={"adapters": []})
    adapters = adapter_statuses(spec, pods, missing_claims)
    value, reason, message = adapters_condition(adapters)
    status = status.with_condition(
        ConditionType.ADAPTERS_READY, value, reason, message[:32768], now=now, generation=generation
    )
    return status.model_copy(update={"adapters": adapters})


def adapter_claims_to_check(
    spec: InferenceDeploymentSpec, previous: InferenceDeploymentStatus, *, every: bool
) -> list[str]:
    """The adapter claims a reconcile looks up: all of them when it checks the spec's prerequisites (a new
    spec, a restart), else only those it reported missing, until they appear (one GET each per reconcile,
    only while something is missing). The model's own claim is checked with the model."""
    claims = adapter_claims(spec)
    if every:
        return claims
    missing = {a.name for a in previous.adapters if a.reason == MISSING_CLAIM}
    reported = {a.source.pvc.claim_name for a in spec.adapters if a.name in missing and a.source.pvc is not None}
    return [claim for claim in claims if claim in reported]
