"""A small typed httpx client for tests: CRUD, patches, apply, the request log, and polling helpers."""

from __future__ import annotations

import builtins
import json
import time
from collections.abc import Callable, Mapping
from typing import Any

import httpx

JsonObject = dict[str, Any]

PATCH_TYPES = {
    "merge": "application/merge-patch+json",
    "json": "application/json-patch+json",
    "strategic": "application/strategic-merge-patch+json",
    "apply": "application/apply-patch+yaml",
}


class ApiError(Exception):
    def __init__(self, status_code: int, body: Any) -> None:
        self.status_code = status_code
        self.body = body
        self.reason = body.get("reason", "") if isinstance(body, Mapping) else ""
        super().__init__(f"HTTP {status_code} {self.reason}: {body}")


def resource_path(
    api_version: str,
    plural: str,
    *,
    namespace: str | None = None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    prefix = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    parts = [prefix]
    if namespace:
        parts.append(f"namespaces/{namespace}")
    parts.append(plural)
    if name:
        parts.append(name)
    if subresource:
        parts.append(subresource)
    return "/".join(parts)


class EmulatorClient:
    """Synchronous client; resources are addressed by apiVersion + plural (e.g. "apps/v1", "deployments")."""

    def __init__(self, base_url: str, *, user_agent: str = "emulator-test-client/1.0") -> None:
        self.base_url = base_url
        self.http = httpx.Client(base_url=base_url, headers={"User-Agent": user_agent}, timeout=10.0)
        self._plurals: dict[tuple[str, str], str] = {}

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> EmulatorClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.http.request(method, path, **kwargs)
        body: Any = response.json() if response.content else None
        if response.status_code >= 400:
            raise ApiError(response.status_code, body)
        return body

    def plural_for(self, api_version: str, kind: str) -> str:
        """Resolve a kind to its plural through discovery, like kubectl does."""
        if (api_version, kind) not in self._plurals:
            prefix = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
            for resource in self.request("GET", prefix)["resources"]:
                if "/" not in resource["name"]:
                    self._plurals[(api_version, resource["kind"])] = resource["name"]
        return self._plurals[(api_version, kind)]

    def _path_of(self, obj: Mapping[str, Any], namespace: str | None) -> tuple[str, str]:
        api_version, kind = obj["apiVersion"], obj["kind"]
        plural = self.plural_for(api_version, kind)
        found_namespace = namespace or (obj.get("metadata") or {}).get("namespace")
        return resource_path(api_version, plural, namespace=found_namespace), plural

    def create(self, obj: Mapping[str, Any], *, namespace: str | None = None) -> JsonObject:
        path, _ = self._path_of(obj, namespace)
        created: JsonObject = self.request("POST", path, json=dict(obj))
        return created

    def get(
        self, api_version: str, plural: str, name: str, *, namespace: str | None = None, subresource: str | None = None
    ) -> JsonObject:
        path = resource_path(api_version, plural, namespace=namespace, name=name, subresource=subresource)
        found: JsonObject = self.request("GET", path)
        return found

    def get_or_none(
        self, api_version: str, plural: str, name: str, *, namespace: str | None = None
    ) -> JsonObject | None:
        try:
            return self.get(api_version, plural, name, namespace=namespace)
        except ApiError as e:
            if e.status_code == 404:
                return None
            raise

    def list(
        self,
        api_version: str,
        plural: str,
        *,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> builtins.list[JsonObject]:
        params = {
            key: value for key, value in (("labelSelector", label_selector), ("fieldSelector", field_selector)) if value
        }
        body = self.request("GET", resource_path(api_version, plural, namespace=namespace), params=params)
        items: builtins.list[JsonObject] = body["items"]
        return items

    def replace(
        self, api_version: str, plural: str, obj: Mapping[str, Any], *, subresource: str | None = None
    ) -> JsonObject:
        metadata = obj["metadata"]
        path = resource_path(
            api_version, plural, namespace=metadata.get("namespace"), name=metadata["name"], subresource=subresource
        )
        replaced: JsonObject = self.request("PUT", path, json=dict(obj))
        return replaced

    def patch(
        self,
        api_version: str,
        plural: str,
        name: str,
        patch: Any,
        *,
        namespace: str | None = None,
        patch_type: str = "merge",
        subresource: str | None = None,
        field_manager: str | None = None,
        force: bool = False,
    ) -> JsonObject:
        params: dict[str, str] = {}
        if field_manager:
            params["fieldManager"] = field_manager
        if force:
            params["force"] = "true"
        path = resource_path(api_version, plural, namespace=namespace, name=name, subresource=subresource)
        patched: JsonObject = self.request(
            "PATCH",
            path,
            content=json.dumps(patch),
            params=params,
            headers={"Content-Type": PATCH_TYPES[patch_type]},
        )
        return patched

    def apply(self, obj: Mapping[str, Any], *, field_manager: str, force: bool = False) -> JsonObject:
        """Server-side apply (the body is JSON, which is valid YAML)."""
        metadata = obj["metadata"]
        plural = self.plural_for(obj["apiVersion"], obj["kind"])
        return self.patch(
            obj["apiVersion"],
            plural,
            metadata["name"],
            dict(obj),
            namespace=metadata.get("namespace"),
            patch_type="apply",
            field_manager=field_manager,
            force=force,
        )

    def delete(
        self, api_version: str, plural: str, name: str, *, namespace: str | None = None, propagation: str | None = None
    ) -> JsonObject:
        params = {"propagationPolicy": propagation} if propagation else {}
        deleted: JsonObject = self.request(
            "DELETE", resource_path(api_version, plural, namespace=namespace, name=name), params=params
        )
        return deleted

    def create_namespace(self, name: str) -> JsonObject:
        return self.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})

    # Emulator-only endpoints.
    def requests_log(self) -> builtins.list[JsonObject]:
        """Every API request served so far: method, path, verb, group, resource, namespace, user_agent..."""
        records: builtins.list[JsonObject] = self.request("GET", "/emulator/requests")
        return records

    def clear_requests_log(self) -> None:
        self.request("DELETE", "/emulator/requests")

    def compact(self) -> None:
        """Drop the watch history so resuming an old resourceVersion answers 410 Gone."""
        self.request("POST", "/emulator/compact")


def wait_for(
    condition: Callable[[], Any], *, timeout: float = 10.0, interval: float = 0.1, message: str = "condition"
) -> Any:
    """Poll until condition() returns something truthy; returns it, or raises TimeoutError."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = condition()
        if last:
            return last
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {message} (last: {last!r})")


class AsyncEmulatorClient:
    """The async twin of EmulatorClient (same paths and errors) for tests running on an event loop."""

    def __init__(self, base_url: str, *, user_agent: str = "emulator-test-client/1.0") -> None:
        self.base_url = base_url
        self.http = httpx.AsyncClient(base_url=base_url, headers={"User-Agent": user_agent}, timeout=10.0)

    async def __aenter__(self) -> AsyncEmulatorClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.http.aclose()

    async def request(self, method: str, path: str, **kwargs: Any) -> Any:
        response = await self.http.request(method, path, **kwargs)
        body: Any = response.json() if response.content else None
        if response.status_code >= 400:
            raise ApiError(response.status_code, body)
        return body

    async def create(
        self, api_version: str, plural: str, obj: Mapping[str, Any], *, namespace: str | None = None
    ) -> JsonObject:
        created: JsonObject = await self.request(
            "POST", resource_path(api_version, plural, namespace=namespace), json=dict(obj)
        )
        return created

    async def get(
        self, api_version: str, plural: str, name: str, *, namespace: str | None = None, subresource: str | None = None
    ) -> JsonObject:
        found: JsonObject = await self.request(
            "GET", resource_path(api_version, plural, namespace=namespace, name=name, subresource=subresource)
        )
        return found

    async def list(
        self, api_version: str, plural: str, *, namespace: str | None = None, label_selector: str | None = None
    ) -> builtins.list[JsonObject]:
        params = {"labelSelector": label_selector} if label_selector else {}
        body = await self.request("GET", resource_path(api_version, plural, namespace=namespace), params=params)
        items: builtins.list[JsonObject] = body["items"]
        return items

    async def patch(
        self,
        api_version: str,
        plural: str,
        name: str,
        patch: Any,
        *,
        namespace: str | None = None,
        patch_type: str = "merge",
        subresource: str | None = None,
        field_manager: str | None = None,
        force: bool = False,
    ) -> JsonObject:
        params = {"fieldManager": field_manager} if field_manager else {}
        if force:
            params["force"] = "true"
        patched: JsonObject = await self.request(
            "PATCH",
            resource_path(api_version, plural, namespace=namespace, name=name, subresource=subresource),
            content=json.dumps(patch),
            params=params,
            headers={"Content-Type": PATCH_TYPES[patch_type]},
        )
        return patched

    async def delete(self, api_version: str, plural: str, name: str, *, namespace: str | None = None) -> JsonObject:
        deleted: JsonObject = await self.request(
            "DELETE", resource_path(api_version, plural, namespace=namespace, name=name)
        )
        return deleted

    async def requests_log(self) -> builtins.list[JsonObject]:
        records: builtins.list[JsonObject] = await self.request("GET", "/emulator/requests")
        return records
