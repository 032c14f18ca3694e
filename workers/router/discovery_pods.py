"""Pod discovery: worker Pods watched live, with each one's role and KV generation from its labels.

EndpointSlices do not carry Pod labels, so a router that must pair prefill and decode workers of
one generation (during a rollout two run side by side) follows the Pods themselves: core/v1 Pods
labelled ``splitserve.io/deployment=<name>``, their pool from ``splitserve.io/role`` and their
generation from ``splitserve.io/generation``. The list/watch/relist/retry loop is the same one the
EndpointSlice discovery uses (discovery.ListWatch, started by discovery.ApiDiscovery).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from splitserve.kubeconfig import KubeAccess
from splitserve.router.discovery import POOLS, ApiDiscovery, PoolSnapshot, UpdateCallback, api_session, url_of

DEPLOYMENT_LABEL = "splitserve.io/deployment"
ROLE_LABEL = "splitserve.io/role"
GENERATION_LABEL = "splitserve.io/generation"
# Role label -> router pool. Aggregated workers serve whole requests, as decode does when a request
# is not split; other roles (the router's own Pods) are not workers.
POOL_OF_ROLE = {"prefill": "prefill", "decode": "decode", "aggregated": "decode"}


def _is_ready(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def endpoints_of_pods(pods: Iterable[Mapping[str, Any]], port: int) -> dict[str, PoolSnapshot]:
    """Per pool ("prefill", "decode"; both always present), the worker URLs of ``pods`` by state and
    their generations.

    Ready: not being deleted, condition Ready "True", and an IP. Terminating: a deletionTimestamp
    and an IP (it finishes its in-flight requests, gets no new ones). Anything else (pending, not
    ready, no IP yet) is left out, as an EndpointSlice leaves a not-ready endpoint out.
    """
    pools = {name: PoolSnapshot() for name in POOLS}
    for pod in pods:
        metadata = pod.get("metadata") or {}
        labels = metadata.get("labels") or {}
        pool = POOL_OF_ROLE.get(labels.get(ROLE_LABEL, ""))
        ip = (pod.get("status") or {}).get("podIP")
        if pool is None or not ip:
            continue
        url = url_of(ip, port)
        snapshot = pools[pool]
        generation = str(labels.get(GENERATION_LABEL, ""))
        # A Pod IP may be reused by a new Pod while the old one still terminates: the ready Pod wins,
        # with its generation.
        if metadata.get("deletionTimestamp"):
            snapshot.terminating.add(url)
            snapshot.generations.setdefault(url, generation)
        elif _is_ready(pod):
            snapshot.ready.add(url)
            snapshot.generations[url] = generation
    for snapshot in pools.values():
        snapshot.terminating -= snapshot.ready
    return pools


class PodDiscovery(ApiDiscovery):
    """Lists then watches the worker Pods of one SplitServe deployment in a namespace."""

    def __init__(
        self,
        access: KubeAccess,
        namespace: str,
        deployment: str,
        port: int,
        watch_timeout_seconds: int = 240,
        retry_delay: float = 1.0,
    ) -> None:
        super().__init__(access, namespace, port, watch_timeout_seconds, retry_delay)
        self._deployment = deployment

    @property
    def selector(self) -> str:
        return f"{DEPLOYMENT_LABEL}={self._deployment}"

    async def run(self, on_update: UpdateCallback) -> None:
        def changed(pods: Mapping[str, Mapping[str, Any]]) -> None:
            for pool, snapshot in endpoints_of_pods(pods.values(), self._port).items():
                snapshot.report(pool, on_update)

        path = f"{self._access.server}/api/v1/namespaces/{self._namespace}/pods"
        async with api_session(self._access) as session:
            await self._list_watch(session, path, self.selector, changed, f"Pods of {self._deployment}").run()
