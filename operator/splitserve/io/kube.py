"""The one module that talks to the Kubernetes API (besides kopf's own watching).

Server-side apply with one fixed field manager, typed errors, and a small table of the kinds
splitserve manages. Credentials come from splitserve.kubeconfig (the `kubernetes`
client's loaders, shared with the router), so exec plugins, rotated tokens and the usual env
variables keep working.
"""

from __future__ import annotations

import json
from collections.abc import Generator
from typing import Any

import httpx

from splitserve.api.topology import FIELD_MANAGER
from splitserve.kubeconfig import KubeAccess

# (apiVersion, kind) -> plural. Everything splitserve manages is namespaced.
PLURALS: dict[tuple[str, str], str] = {
    ("v1", "Service"): "services",
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Secret"): "secrets",
    ("v1", "PersistentVolumeClaim"): "persistentvolumeclaims",
    ("v1", "Pod"): "pods",
    ("v1", "Event"): "events",
    ("apps/v1", "Deployment"): "deployments",
    ("rbac.authorization.k8s.io/v1", "Role"): "roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitors",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitors",
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobjects",
    ("autoscaling/v2", "HorizontalPodAutoscaler"): "horizontalpodautoscalers",
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepools",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproutes",
    ("splitserve.io/v1alpha1", "InferenceDeployment"): "inferencedeployments",
}


USER_AGENT = "splitserve-operator/0.1.0"
MAX_CONNECTIONS = 16


class KubeError(Exception):
    """A failed API call, with the server's reason and message."""

    def __init__(self, status: int, reason: str, message: str, *, path: str = "") -> None:
        super().__init__(f"{status} {reason}: {message}" + (f" ({path})" if path else ""))
        self.status = status
        self.reason = reason
        self.message = message
        self.path = path

    @property
    def kind_not_installed(self) -> bool:
        """404 for a whole resource type (e.g. prometheus-operator's CRDs absent), not an object."""
        return self.status == 404 and self.reason == "NotFound" and "the server could not find" in self.message


def resource_path(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
    plural = PLURALS[(api_version, kind)]
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{prefix}/namespaces/{namespace}/{plural}"
    return f"{path}/{name}" if name else path


class KubeAuth(httpx.Auth):
    """The Authorization header asked of the credentials for every request (see splitserve.kubeconfig)."""

    def __init__(self, access: KubeAccess) -> None:
        self.access = access

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers.update(self.access.headers())
        yield request


class KubeClient:
    """Async Kubernetes API calls used by the reconciler. One pooled HTTP client, explicit timeouts."""

    def __init__(self, access: KubeAccess, *, timeout_seconds: float = 30.0) -> None:
        self._http = httpx.AsyncClient(
            base_url=access.server,
            headers={"User-Agent": USER_AGENT},
            verify=access.ssl_context,
            auth=KubeAuth(access),
            timeout=httpx.Timeout(timeout_seconds, connect=5.0),
            # A few connections, all kept alive: a hundred reconciles at once gain nothing from a hundred
            # connections (each a TLS handshake on a real cluster), they queue for these instead.
            limits=httpx.Limits(max_connections=MAX_CONNECTIONS, max_keepalive_connections=MAX_CONNECTIONS),
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = await self._http.request(method, path, **kwargs)
        except httpx.HTTPError as error:
            raise KubeError(0, "Unreachable", f"{type(error).__name__}: {error}", path=path) from error
        if response.status_code >= 400:
            reason, message = "Error", response.text[:500]
            try:
                body = response.json()
                reason, message = body.get("reason") or reason, body.get("message") or message
            except ValueError:
                pass
            raise KubeError(response.status_code, reason, message, path=path)
        return response

    async def apply(self, obj: dict[str, Any], *, field_manager: str = FIELD_MANAGER) -> tuple[dict[str, Any], bool]:
        """Server-side apply `obj` as `field_manager`; returns (object, created).

        Other managers (the autoscaler owning spec.replicas, `kubectl scale`) keep the fields
        they own as long as the applied object leaves them out.
        """
        meta = obj["metadata"]
        path = resource_path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        response = await self._request(
            "PATCH",
            path,
            params={"fieldManager": field_manager, "force": "true"},
            content=json.dumps(obj),
            headers={"Content-Type": "application/apply-patch+yaml"},
        )
        result: dict[str, Any] = response.json()
        return result, response.status_code == 201

    async def create(self, obj: dict[str, Any], *, field_manager: str) -> dict[str, Any]:
        """Plain create (not apply): fields set here are owned by `field_manager` as an update."""
        meta = obj["metadata"]
        response = await self._request(
            "POST",
            resource_path(obj["apiVersion"], obj["kind"], meta["namespace"]),
            params={"fieldManager": field_manager},
            json=obj,
        )
        result: dict[str, Any] = response.json()
        return result

    async def json_patch(
        self, api_version: str, kind: str, namespace: str, name: str, ops: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """A JSON patch (RFC 6902) as the operator; a failed `test` op answers 422."""
        response = await self._request(
            "PATCH",
            resource_path(api_version, kind, namespace, name),
            params={"fieldManager": FIELD_MANAGER},
            content=json.dumps(ops),
            headers={"Content-Type": "application/json-patch+json"},
        )
        result: dict[str, Any] = response.json()
        return result

    async def scale(
        self, api_version: str, kind: str, namespace: str, name: str, replicas: int, *, field_manager: str
    ) -> dict[str, Any]:
        """Set replicas through the /scale subresource, as `kubectl scale`, an HPA or KEDA would."""
        response = await self._request(
            "PATCH",
            resource_path(api_version, kind, namespace, name) + "/scale",
            params={"fieldManager": field_manager},
            content=json.dumps({"spec": {"replicas": replicas}}),
            headers={"Content-Type": "application/merge-patch+json"},
        )
        result: dict[str, Any] = response.json()
        return result

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            response = await self._request("GET", resource_path(api_version, kind, namespace, name))
        except KubeError as error:
            if error.status == 404 and not error.kind_not_installed:
                return None
            raise
        result: dict[str, Any] = response.json()
        return result

    async def list(self, api_version: str, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        response = await self._request(
            "GET", resource_path(api_version, kind, namespace), params={"labelSelector": label_selector}
        )
        items: list[dict[str, Any]] = response.json().get("items", [])
        return items

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        try:
            await self._request(
                "DELETE",
                resource_path(api_version, kind, namespace, name),
                json={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"},
            )
        except KubeError as error:
            if error.status == 404:
                return False
            raise
        return True

    async def patch_status(
        self, api_version: str, kind: str, namespace: str, name: str, status: dict[str, Any]
    ) -> dict[str, Any]:
        response = await self._request(
            "PATCH",
            resource_path(api_version, kind, namespace, name) + "/status",
            content=json.dumps({"status": status}),
            headers={"Content-Type": "application/merge-patch+json"},
        )
        result: dict[str, Any] = response.json()
        return result
