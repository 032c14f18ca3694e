"""The adapter sync's outcome as a condition on the worker's own Pod, for the operator to aggregate.

    status.conditions[type=splitserve.io/AdaptersReady]: status True/False,
    reason AdaptersLoaded | AdaptersLoading | AdapterLoadFailed, message (adapter_plan.adapters_condition)

Written with a strategic-merge patch of pods/status: Pod conditions merge by `type`, so the kubelet's
own (Ready, ...) are untouched, and the kubelet keeps a condition type it does not own. On only in a
cluster: POD_NAME and POD_NAMESPACE from the downward API, and a ServiceAccount allowed to `patch`
`pods/status`. A failed patch is logged and tried again (the latest state) a few seconds later.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import httpx

from splitserve.api.topology import ADAPTERS_CONDITION
from splitserve.engine.adapter_plan import AdaptersState, Condition, adapters_condition
from splitserve.kubeconfig import KubeAccess, load_access

log = logging.getLogger(__name__)

RETRY_SECONDS = 5.0
REQUEST_TIMEOUT_SECONDS = 10.0
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"


def condition_patch(condition: Condition, last_transition: str) -> dict[str, Any]:
    """The pods/status strategic-merge patch that sets this one condition."""
    return {
        "status": {
            "conditions": [
                {
                    "type": ADAPTERS_CONDITION,
                    "status": condition.status,
                    "reason": condition.reason,
                    "message": condition.message,
                    "lastTransitionTime": last_transition,
                }
            ]
        }
    }


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class PodConditionReporter:
    """Sets splitserve.io/AdaptersReady on one Pod: `update` with each new state, `run` until stopped."""

    def __init__(
        self,
        access: KubeAccess,
        namespace: str,
        pod: str,
        *,
        retry_s: float = RETRY_SECONDS,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        self.access = access
        self.path = f"/api/v1/namespaces/{namespace}/pods/{pod}/status"
        self._retry_s = retry_s
        self._http = http
        self._latest: AdaptersState | None = None
        self._written: Condition | None = None
        self._transition: str = _now()
        self._wake = asyncio.Event()
        self._problem: str | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> PodConditionReporter | None:
        """A reporter for the Pod named by POD_NAME and POD_NAMESPACE, with the in-cluster service
        account (else the default kubeconfig); None, after one line, when those are missing."""
        pod, namespace = environ.get("POD_NAME"), environ.get("POD_NAMESPACE")
        if not pod or not namespace:
            return None
        try:
            access = load_access()
        except RuntimeError as error:
            log.warning("adapters: not reporting the pod condition: %s", error)
            return None
        return cls(access, namespace, pod)

    def update(self, state: AdaptersState) -> None:
        """The newest state to report (an earlier one not yet written is skipped). Never blocks."""
        self._latest = state
        self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Write each new condition until `stop`; a failed write is retried every `retry_s` seconds."""
        async with contextlib.AsyncExitStack() as stack:
            if self._http is None:
                self._http = await stack.enter_async_context(
                    httpx.AsyncClient(
                        base_url=self.access.server,
                        verify=self.access.ssl_context,
                        timeout=httpx.Timeout(REQUEST_TIMEOUT_SECONDS, connect=5.0),
                    )
                )
            stopped = asyncio.create_task(stop.wait())
            try:
                while not stop.is_set():
                    woken = asyncio.create_task(self._wake.wait())
                    await asyncio.wait({woken, stopped}, return_when=asyncio.FIRST_COMPLETED)
                    woken.cancel()
                    if stop.is_set():
                        break
                    self._wake.clear()
                    if not await self.write_latest():
                        # Again with whatever state is newest by then.
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(asyncio.shield(stopped), self._retry_s)
                        self._wake.set()
            finally:
                stopped.cancel()

    async def write_latest(self) -> bool:
        """Patch the Pod with the latest state's condition if it differs from the one written; False on failure."""
        if self._latest is None:
            return True
        condition = adapters_condition(self._latest)
        if condition == self._written:
            return True
        # The time the status last changed (a new message alone keeps it), as Kubernetes means it.
        changed = self._written is None or condition.status != self._written.status
        transition = _now() if changed else self._transition
        assert self._http is not None, "PodConditionReporter.run owns the HTTP client"
        body = json.dumps(condition_patch(condition, transition))
        try:
            # The Authorization header asked again for each patch: a service-account token rotates.
            headers = {**self.access.headers(), "Content-Type": STRATEGIC_MERGE_PATCH}
            response = await self._http.patch(self.path, content=body, headers=headers)
            problem = None if response.status_code < 300 else f"HTTP {response.status_code}: {response.text[:300]}"
        except httpx.HTTPError as error:
            problem = f"{type(error).__name__}: {error}"
        if problem is not None:
            if problem != self._problem:
                log.warning("adapters: cannot set the pod condition (PATCH %s): %s; retrying", self.path, problem)
            self._problem = problem
            return False
        if self._problem is not None:
            log.info("adapters: pod condition set again")
        self._problem = None
        self._written, self._transition = condition, transition
        return True
