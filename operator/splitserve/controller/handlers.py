"""Thin kopf handlers. All the logic lives in Reconciler; these only route events to it.

- create / update / resume of an InferenceDeployment: full reconcile (with pruning);
- any event of a child Deployment or Service (labelled with its owner): reconcile the owner,
  which restores a child deleted or edited by hand and rolls its status up;
- a slow timer: the same reconcile, catching drift on kinds that are not watched (RBAC, PDBs).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from typing import Any

import kopf

from splitserve.api.base import API_GROUP, API_VERSION, PLURAL
from splitserve.builders.naming import FIELD_MANAGER, LABEL_DEPLOYMENT
from splitserve.controller.kube import KubeClient, load_access
from splitserve.controller.reconcile import Reconciler, RetryLater

DRIFT_INTERVAL_SECONDS = 60.0
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
    memo.reconciler = Reconciler(KubeClient(load_access()), _post_event)


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
