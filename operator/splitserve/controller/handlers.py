"""Thin kopf handlers. All the logic lives in Reconciler; these only route events to it.

- indexes: the InferenceDeployments and every kind of child, fed by kopf's watches, are the cache the
  reconciler and the loops read (controller.cache): no handler GETs what a watch already shows;
- create / update / resume of an InferenceDeployment: full reconcile (with pruning);
- any event of a child (labelled with its owner): a coalesced reconcile of the owner, which restores
  a child deleted or edited by hand and rolls its status up;
- the worker pods (an index of slim copies, watched with a server-side label selector): an event of one
  that reports its adapters (splitserve.io/AdaptersReady) reconciles its owner, whose status.adapters
  rolls those reports up;
- a slow timer: the same reconcile from the cache, catching drift missed by nothing in particular;
- the built-in autoscaler (a daemon), the diagnosis (a slow timer) and, only while
  spec.optimization.dynamic is on, the autopilot (a timer, SPLITSERVE_AUTOPILOT_* knobs);
- only while spec.rollout.analysis is set, the rollout analysis (a daemon; it queries Prometheus only
  while a rollout is under way).
"""

from __future__ import annotations

import copy
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import kopf

from splitserve.api.base import API_GROUP, API_VERSION, PLURAL
from splitserve.api.topology import (
    ADAPTERS_CONDITION,
    CHILD_RESOURCES,
    FIELD_MANAGER,
    LABEL_DEPLOYMENT,
    WORKER_POD_SELECTOR,
)
from splitserve.autoscaling.decision import AutoscalerState
from splitserve.builders.target import Images
from splitserve.controller.adapters import slim_pod
from splitserve.controller.coalesce import Coalescer
from splitserve.controller.loops.analysis import ScalarSource, analyse_once, analysis_settings, interval_seconds
from splitserve.controller.loops.autopilot import AutopilotSettings, new_samples, optimize_once
from splitserve.controller.loops.autoscaler import autoscale_once, builtin_autoscaling
from splitserve.controller.loops.diagnosis import diagnose_once
from splitserve.controller.metrics import OperatorMetrics
from splitserve.controller.reconcile import Reconciler, RetryLater
from splitserve.io.kube import KubeClient
from splitserve.io.prometheus import PrometheusClient, shared_http_client
from splitserve.kubeconfig import load_access

DRIFT_INTERVAL_SECONDS = float(os.environ.get("SPLITSERVE_DRIFT_INTERVAL_SECONDS", "60"))
# Child events closer together than this make one reconcile of their owner.
COALESCE_SECONDS = float(os.environ.get("SPLITSERVE_COALESCE_SECONDS", "0.2"))
# Diagnosis reads minutes of telemetry; more often would only repeat itself. Tests shorten it.
DIAGNOSIS_INTERVAL_SECONDS = float(os.environ.get("SPLITSERVE_DIAGNOSIS_INTERVAL_SECONDS", "300"))
# Rollout analysis passes: unset, min(30 s, windowSeconds / 4) (loops/analysis.py); tests shorten it.
ANALYSIS_INTERVAL_SECONDS = float(os.environ.get("SPLITSERVE_ANALYSIS_INTERVAL_SECONDS", "0")) or None
# One telemetry sample per run; the policy's windows are what make evidence "sustained". Tests shorten all.
AUTOPILOT = AutopilotSettings.from_environment()
# Typed loosely: kopf.PRESENT is a filter token, not a str.
CHILD_FILTER: dict[str, Any] = {
    LABEL_DEPLOYMENT: kopf.PRESENT,
    "app.kubernetes.io/managed-by": FIELD_MANAGER,
}


def _plain(body: kopf.Body) -> dict[str, Any]:
    """A plain copy of a watched object: kopf's Body is a live view and must not be kept."""
    plain: dict[str, Any] = copy.deepcopy(dict(body))
    return plain


@kopf.index(API_GROUP, API_VERSION, PLURAL)
async def inference_deployments(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    return {(namespace, name): _plain(body)}


async def _index_children(
    body: kopf.Body, namespace: str | None, labels: kopf.Labels, memo: kopf.Memo, **_: Any
) -> dict[Any, Any]:
    owner = labels[LABEL_DEPLOYMENT]
    # Every change of a child asks for one (coalesced) reconcile of its owner. Done here rather than in
    # an event handler: kopf runs indexers on every event without a handler's bookkeeping and log line.
    reconciler: Reconciler | None = memo.get("reconciler")
    if namespace is not None and reconciler is not None and reconciler.cache.synced:
        memo.coalescer.request(namespace, owner)
    return {(namespace, owner): _plain(body)}


# One index fed by every child kind (kopf merges what handlers of the same id return).
for _group, _version, _plural in CHILD_RESOURCES:
    kopf.index(_group, _version, _plural, labels=CHILD_FILTER, id="owned_children")(_index_children)


@kopf.index("", "v1", "pods", labels=CHILD_FILTER)
async def worker_pods(
    body: kopf.Body, namespace: str | None, labels: kopf.Labels, memo: kopf.Memo, **_: Any
) -> dict[Any, Any]:
    """Worker pods by owner, slim; a change of one that reports adapters asks for a reconcile of its owner
    (its status.adapters). Pods without the report change nothing the operator writes."""
    owner = labels[LABEL_DEPLOYMENT]
    pod = slim_pod(body)
    reconciler: Reconciler | None = memo.get("reconciler")
    reports = any(c.get("type") == ADAPTERS_CONDITION for c in pod["status"]["conditions"])
    if reports and namespace is not None and reconciler is not None and reconciler.cache.synced:
        memo.coalescer.request(namespace, owner)
    return {(namespace, owner): pod}


def _bind(memo: kopf.Memo, kwargs: Mapping[str, Any]) -> Reconciler:
    """The reconciler, reading kopf's current indexes (handed to every handler as keyword arguments)."""
    reconciler: Reconciler = memo.reconciler
    reconciler.cache.bind(kwargs["inference_deployments"], kwargs["owned_children"], kwargs["worker_pods"])
    reconciler.cache.synced = True  # kopf runs no handler before every index is listed
    return reconciler


def _post_event(body: Mapping[str, Any], kind: str, reason: str, message: str) -> None:
    kopf.event(dict(body), type=kind, reason=reason, message=message[:1024])  # type: ignore[arg-type]


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Handler progress and the diff base live in annotations: the CRD's status schema is strict
    # and would prune kopf's own status fields; status is written only by the Reconciler.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=API_GROUP, key="last-handled-configuration"
    )
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 270
    settings.watching.client_timeout = 300
    settings.networking.request_timeout = 60
    settings.batching.error_delays = [1, 2, 5, 10, 20, 30]
    settings.watching.label_selectors["v1", "pods"] = WORKER_POD_SELECTOR
    # `splitserve operator` puts its metrics (served on --metrics-port) into the memo.
    metrics = memo.get("metrics") or OperatorMetrics()
    reconciler = Reconciler(KubeClient(load_access()), _post_event, Images.from_environment(), metrics)
    memo.reconciler = reconciler
    memo.prometheus_http = shared_http_client()
    memo.coalescer = Coalescer(
        lambda namespace, name, full: _reconcile_owner(reconciler, namespace, name, full), COALESCE_SECONDS
    )
    # (namespace, name) -> (uid, generation, rollout generation, paused) last asked for: a new one is a
    # spec change (or a rollout paused) to reconcile.
    memo.generations = {}


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    await memo.coalescer.aclose()
    await memo.prometheus_http.aclose()
    await memo.reconciler.kube.aclose()


async def _reconcile_owner(reconciler: Reconciler, namespace: str, name: str, full: bool) -> float | None:
    """What the coalescer runs: a reconcile from the cache; `full` also checks the spec's prerequisites.
    Returns the seconds after which to try again when the spec cannot be realised yet."""
    try:
        await reconciler.reconcile_by_name(namespace, name, prerequisites=full)
    except RetryLater as retry:
        return retry.delay
    return None


@kopf.on.event(API_GROUP, API_VERSION, PLURAL)
async def deployment_event(
    type: str | None, body: kopf.Body, namespace: str | None, name: str, memo: kopf.Memo, **kwargs: Any
) -> None:
    """A spec change (a new generation), or first sight after a (re)start: one full reconcile.

    An event handler, not kopf's create/update/resume handlers: those keep their progress and a copy of
    the whole spec in annotations, two patches per change and a diff per event, to find out what
    metadata.generation already says. The operator's own status writes do not bump the generation,
    so they cost nothing here."""
    if namespace is None:
        return
    reconciler = _bind(memo, kwargs)
    key = (namespace, name)
    if type == "DELETED":
        memo.coalescer.forget(namespace, name)
        memo.generations.pop(key, None)
        reconciler.cache.gone(body)  # its status writes must not outlive it in the cache
        return
    meta = body["metadata"]
    # A paused (or resumed) rollout is a status write by another hand (the rollout analysis, or a
    # person with `kubectl patch --subresource=status`) that the pools must follow at once.
    rollout = (body.get("status") or {}).get("rollout") or {}
    seen = (meta.get("uid"), meta.get("generation"), rollout.get("generation"), bool(rollout.get("paused")))
    before = memo.generations.get(key)
    if before != seen:
        memo.generations[key] = seen
        # Only a new spec (or first sight) re-reads the prerequisites; a pause is a plain reconcile.
        memo.coalescer.request(namespace, name, full=before is None or before[:2] != seen[:2])


@kopf.timer(API_GROUP, API_VERSION, PLURAL, interval=DRIFT_INTERVAL_SECONDS, initial_delay=DRIFT_INTERVAL_SECONDS)
async def drift_timer(namespace: str | None, name: str, memo: kopf.Memo, **kwargs: Any) -> None:
    """Drift nothing else noticed (a watch event lost): the same reconcile, from the cache."""
    if namespace is not None:
        _bind(memo, kwargs)
        memo.coalescer.request(namespace, name)


def _deleted(type: str | None, **_: Any) -> bool:
    return type == "DELETED"


async def child_deleted(
    body: kopf.Body, labels: kopf.Labels, namespace: str | None, memo: kopf.Memo, **kwargs: Any
) -> None:
    """A child deleted (by hand, or by us): the owner's reconcile restores it if it is still wanted."""
    if namespace is None:
        return
    _bind(memo, kwargs).cache.gone(body)
    memo.coalescer.request(namespace, labels[LABEL_DEPLOYMENT])


for _group, _version, _plural in CHILD_RESOURCES:
    kopf.on.event(_group, _version, _plural, labels=CHILD_FILTER, when=_deleted, id="child_deleted")(child_deleted)


def _builtin_autoscaling(spec: kopf.Spec, **_: Any) -> bool:
    return builtin_autoscaling(dict(spec))


@kopf.daemon(API_GROUP, API_VERSION, PLURAL, when=_builtin_autoscaling, cancellation_timeout=10)
async def autoscaler(
    stopped: kopf.DaemonStopped, namespace: str | None, name: str, spec: kopf.Spec, memo: kopf.Memo, **kwargs: Any
) -> None:
    """The built-in autoscaler: one evaluation every spec.autoscaling.intervalSeconds."""
    if namespace is None:
        return
    state = AutoscalerState()
    url = ""
    client: PrometheusClient | None = None
    try:
        while not stopped:
            wanted = str(spec.get("autoscaling", {}).get("prometheusUrl", ""))
            if client is None or wanted != url:
                if client is not None:
                    await client.aclose()
                url, client = wanted, PrometheusClient(wanted, http=memo.prometheus_http)
            state = await autoscale_once(_bind(memo, kwargs), namespace, name, state, client)
            await stopped.wait(float(spec.get("autoscaling", {}).get("intervalSeconds", 15)))
    finally:
        if client is not None:
            await client.aclose()


# The first diagnosis within a minute of creation (sooner when the interval is shorter): earlier, the
# pools have served nothing to diagnose, and a roll-out of many deployments is busy enough.
@kopf.timer(
    API_GROUP,
    API_VERSION,
    PLURAL,
    interval=DIAGNOSIS_INTERVAL_SECONDS,
    initial_delay=min(DIAGNOSIS_INTERVAL_SECONDS, 60.0),
)
async def diagnosis_timer(namespace: str | None, name: str, spec: kopf.Spec, memo: kopf.Memo, **kwargs: Any) -> None:
    """The six-question diagnosis, written to status.diagnosis on a slow timer."""
    if namespace is None:
        return
    url = str(spec.get("autoscaling", {}).get("prometheusUrl", ""))
    async with PrometheusClient(url, http=memo.prometheus_http) as client:
        await diagnose_once(_bind(memo, kwargs), namespace, name, client)


def _dynamic(spec: kopf.Spec, **_: Any) -> bool:
    return bool((spec.get("optimization") or {}).get("dynamic"))


@kopf.timer(API_GROUP, API_VERSION, PLURAL, interval=AUTOPILOT.interval_s, initial_delay=1, when=_dynamic)
async def autopilot_timer(namespace: str | None, name: str, spec: kopf.Spec, memo: kopf.Memo, **kwargs: Any) -> None:
    """Dynamic optimization: one sample, one decision, at most one change (spec.optimization.dynamic)."""
    if namespace is None:
        return
    # kopf gives each object its own memo (a copy of the operator's): the sample window lives there.
    if "autopilot_samples" not in memo:
        memo["autopilot_samples"] = new_samples(AUTOPILOT)
    url = str(spec.get("autoscaling", {}).get("prometheusUrl", ""))
    async with PrometheusClient(url, http=memo.prometheus_http) as client:
        await optimize_once(
            _bind(memo, kwargs), namespace, name, client, memo["autopilot_samples"], time.time(), AUTOPILOT
        )


def _rollout_analysis(spec: kopf.Spec, **_: Any) -> bool:
    return analysis_settings(dict(spec)) is not None


@kopf.daemon(API_GROUP, API_VERSION, PLURAL, when=_rollout_analysis, cancellation_timeout=10)
async def rollout_analysis(
    stopped: kopf.DaemonStopped, namespace: str | None, name: str, spec: kopf.Spec, memo: kopf.Memo, **kwargs: Any
) -> None:
    """spec.rollout.analysis: judge a rollout's new generation against the old, pause it on a regression."""
    if namespace is None:
        return

    def client_for(url: str) -> ScalarSource:
        # Cheap: the clients share the operator's pooled HTTP client (and closing one leaves it open).
        return PrometheusClient(url, http=memo.prometheus_http)

    while not stopped:
        # The coalescer, not a reconcile here: it serialises with the other reasons to reconcile and retries.
        await analyse_once(
            _bind(memo, kwargs),
            namespace,
            name,
            client_for,
            reconcile=lambda ns, owner: memo.coalescer.request(ns, owner),
        )
        await stopped.wait(ANALYSIS_INTERVAL_SECONDS or interval_seconds(dict(spec)))
