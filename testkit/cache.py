"""Fill the operator's ClusterCache by listing, for tests that drive the Reconciler without kopf.

In the operator, kopf's watches feed the cache (controller.handlers' indexes). A test that calls the
Reconciler or a loop directly has no watches, so it lists what the API server holds, the same kinds
the operator indexes, before each step.
"""

from __future__ import annotations

from typing import Any

from splitserve.api.base import API_GROUP, API_VERSION, PLURAL
from splitserve.api.topology import CHILD_RESOURCES, LABEL_DEPLOYMENT, WORKER_POD_SELECTOR
from splitserve.controller.adapters import slim_pod
from splitserve.controller.cache import ClusterCache
from testkit.emulator.client import ApiError, AsyncEmulatorClient, resource_path


async def _listed(
    api: AsyncEmulatorClient, api_version: str, plural: str, namespace: str, selector: str | None
) -> list[dict[str, Any]]:
    params = {"labelSelector": selector} if selector else {}
    try:
        body = await api.request("GET", resource_path(api_version, plural, namespace=namespace), params=params)
    except ApiError as error:
        if error.status_code == 404:  # a kind whose CRD is not installed: the operator does not watch it either
            return []
        raise
    kind = str(body.get("kind", "")).removesuffix("List")
    # List items carry no apiVersion/kind on a real API server; a watch event's object does.
    return [{"apiVersion": api_version, "kind": kind, **item} for item in body["items"]]


async def fill_cache(cache: ClusterCache, api: AsyncEmulatorClient, namespace: str) -> None:
    """What a synced watch would show for `namespace`: its InferenceDeployments, their children and worker pods."""
    deployments: dict[Any, list[dict[str, Any]]] = {}
    for obj in await _listed(api, f"{API_GROUP}/{API_VERSION}", PLURAL, namespace, None):
        deployments[(namespace, obj["metadata"]["name"])] = [obj]
    children: dict[Any, list[dict[str, Any]]] = {}
    for group, version, plural in CHILD_RESOURCES:
        api_version = f"{group}/{version}" if group else version
        for obj in await _listed(api, api_version, plural, namespace, LABEL_DEPLOYMENT):
            owner = obj["metadata"]["labels"][LABEL_DEPLOYMENT]
            children.setdefault((namespace, owner), []).append(obj)
    pods: dict[Any, list[dict[str, Any]]] = {}
    for obj in await _listed(api, "v1", "pods", namespace, WORKER_POD_SELECTOR):
        pods.setdefault((namespace, obj["metadata"]["labels"][LABEL_DEPLOYMENT]), []).append(slim_pod(obj))
    cache.bind(deployments, children, pods)
    cache.synced = True
