"""Thin kopf handlers. All the logic lives in Reconciler; these only route events to it.

- create / update / resume of an InferenceDeployment: full reconcile (with pruning);
- any event of a child Deployment or Service (labelled with its owner): reconcile the owner,
  which restores a child deleted or edited by hand and rolls its status up;
- a slow timer: the same reconcile, catching drift on kinds that are not watched (RBAC, PDBs);
- the built-in autoscaler (a daemon), the diagnosis (a slow timer) and, only while
  spec.optimization.dynamic is on, the autopilot (a timer, SPLITSERVE_AUTOPILOT_* knobs).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import kopf

from splitserve.api.base import API_GROUP, API_VERSION, PLURAL
from splitserve.autoscaling.decision import AutoscalerState
from splitserve.autoscaling.prometheus import PrometheusClient
from splitserve.builders.naming import FIELD_MANAGER, LABEL_DEPLOYMENT, Images
from splitserve.controller.autopilot_loop import AutopilotSettings, new_samples, optimize_once
from splitserve.controller.kube import KubeClient, load_access
from splitserve.controller.metrics import OperatorMetrics
from splitserve.controller.reconcile import Reconciler, RetryLater
from splitserve.controller.timers import autoscale_once, builtin_autoscaling, diagnose_once

DRIFT_INTERVAL_SECONDS = 60.0
# Diagnosis reads minutes of telemetry; more often would only repeat itself. Tests shorten it.
DIAGNOSIS_INTERVAL_SECONDS = float(os.environ.get("SPLITSERVE_DIAGNOSIS_INTERVAL_SECONDS", "300"))
# One telemetry sample per run; the policy's windows are what make evidence "sustained". Tests shorten all.
AUTOPILOT = AutopilotSettings.from_environment()
# Typed loosely: kopf.PRESENT is a filter token, not a str.
CHILD_FILTER: dict[str, Any] = {
    LABEL_DEPLOYMENT: kopf.PRESENT,
    "app.kubernetes.io/managed-by": FIELD_MANAGER,
}


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
    # `splitserve operator` puts its metrics (served on --metrics-port) into the memo.
    metrics = memo.get("metrics") or OperatorMetrics()
    memo.reconciler = Reconciler(KubeClient(load_access()), _post_event, Images.from_environment(), metrics)


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    await memo.reconciler.kube.aclose()


async def _run(reconciler: Reconciler, body: Mapping[str, Any], *, prune: bool) -> None:
    try:
        await reconciler.reconcile(body, prune=prune)
    except RetryLater as retry:
        raise kopf.TemporaryError(str(retry), delay=retry.delay) from retry


@kopf.on.resume(API_GROUP, API_VERSION, PLURAL)
@kopf.on.create(API_GROUP, API_VERSION, PLURAL)
@kopf.on.update(API_GROUP, API_VERSION, PLURAL)
async def reconcile_handler(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    await _run(memo.reconciler, body, prune=True)


@kopf.timer(API_GROUP, API_VERSION, PLURAL, interval=DRIFT_INTERVAL_SECONDS, initial_delay=DRIFT_INTERVAL_SECONDS)
async def drift_timer(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    await _run(memo.reconciler, body, prune=True)


@kopf.on.event("apps", "v1", "deployments", labels=CHILD_FILTER)
@kopf.on.event("", "v1", "services", labels=CHILD_FILTER)
async def child_event(labels: kopf.Labels, namespace: str | None, memo: kopf.Memo, **_: Any) -> None:
    if namespace is None:
        return
    # The owner's own handler retries a RetryLater; a child event must not start a second retry loop.
    with contextlib.suppress(RetryLater):
        await memo.reconciler.reconcile_by_name(namespace, labels[LABEL_DEPLOYMENT], prune=False)


def _builtin_autoscaling(spec: kopf.Spec, **_: Any) -> bool:
    return builtin_autoscaling(dict(spec))


@kopf.daemon(API_GROUP, API_VERSION, PLURAL, when=_builtin_autoscaling, cancellation_timeout=10)
async def autoscaler(
    stopped: kopf.DaemonStopped, namespace: str | None, name: str, spec: kopf.Spec, memo: kopf.Memo, **_: Any
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
                url, client = wanted, PrometheusClient(wanted)
            state = await autoscale_once(memo.reconciler, namespace, name, state, client)
            await stopped.wait(float(spec.get("autoscaling", {}).get("intervalSeconds", 15)))
    finally:
        if client is not None:
            await client.aclose()


@kopf.timer(API_GROUP, API_VERSION, PLURAL, interval=DIAGNOSIS_INTERVAL_SECONDS, initial_delay=5)
async def diagnosis_timer(namespace: str | None, name: str, spec: kopf.Spec, memo: kopf.Memo, **_: Any) -> None:
    """The six-question diagnosis, written to status.diagnosis on a slow timer."""
    if namespace is None:
        return
    url = str(spec.get("autoscaling", {}).get("prometheusUrl", ""))
    async with PrometheusClient(url) as client:
        await diagnose_once(memo.reconciler, namespace, name, client)


def _dynamic(spec: kopf.Spec, **_: Any) -> bool:
    return bool((spec.get("optimization") or {}).get("dynamic"))


@kopf.timer(API_GROUP, API_VERSION, PLURAL, interval=AUTOPILOT.interval_s, initial_delay=1, when=_dynamic)
async def autopilot_timer(namespace: str | None, name: str, spec: kopf.Spec, memo: kopf.Memo, **_: Any) -> None:
    """Dynamic optimization: one sample, one decision, at most one change (spec.optimization.dynamic)."""
    if namespace is None:
        return
    # kopf gives each object its own memo (a copy of the operator's): the sample window lives there.
    if "autopilot_samples" not in memo:
        memo["autopilot_samples"] = new_samples(AUTOPILOT)
    url = str(spec.get("autoscaling", {}).get("prometheusUrl", ""))
    async with PrometheusClient(url) as client:
        await optimize_once(memo.reconciler, namespace, name, client, memo["autopilot_samples"], time.time(), AUTOPILOT)
