"""HTTP layer: routes kmock's parsed requests to the API, renders JSON/Table/watch answers, logs requests."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import aiohttp.web
import yaml

from testkit.emulator import discovery, errors, protobuf, selectors, tables
from testkit.emulator.api import PATCH_CONTENT_TYPES, KubernetesApi
from testkit.emulator.resources import ResourceInfo
from testkit.emulator.routing import ResourcePath, parse_resource_path, verb_for
from testkit.emulator.watch import WatchFilter, WatchRequest, serve_watch

CONTROL_PREFIX = "/emulator/"


@dataclasses.dataclass(frozen=True)
class RequestRecord:
    """One served API request, for assertions (e.g. deriving the RBAC rules an operator needs)."""

    method: str
    path: str
    query: dict[str, str]
    verb: str
    group: str
    version: str
    resource: str
    subresource: str
    namespace: str | None
    name: str | None
    user_agent: str
    code: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _json_response(body: Any, status: int = 200) -> aiohttp.web.Response:
    return aiohttp.web.Response(body=json.dumps(body).encode(), status=status, content_type="application/json")


def _error_response(error: errors.ApiError) -> aiohttp.web.Response:
    return _json_response(error.status(), status=error.code)


def _parse_body(raw: bytes, content_type: str) -> Any:
    if "protobuf" in content_type:
        try:
            return protobuf.decode(raw)
        except protobuf.ProtobufError as e:
            raise errors.ApiError(415, "UnsupportedMediaType", str(e)) from None
    if "cbor" in content_type:
        raise errors.ApiError(
            415,
            "UnsupportedMediaType",
            f"the body of the request was in an unknown format - accepted media types include: application/json, "
            f"application/yaml (got {content_type})",
        )
    if not raw.strip():
        return None
    try:
        if "yaml" in content_type:
            return yaml.safe_load(raw)
        return json.loads(raw)
    except (ValueError, yaml.YAMLError) as e:
        raise errors.bad_request(f"cannot parse the request body: {e}") from None


def _manager(params: Mapping[str, str], user_agent: str) -> str:
    if params.get("fieldManager"):
        return params["fieldManager"]
    # The real server derives the default manager from the client's executable name in the User-Agent.
    return user_agent.split("/")[0].strip() or "unknown"


class HttpFrontend:
    def __init__(self, api: KubernetesApi, server_address: str) -> None:
        self.api = api
        self.server_address = server_address
        self.records: list[RequestRecord] = []

    async def serve(
        self,
        raw_request: aiohttp.web.BaseRequest,
        body: bytes,
    ) -> aiohttp.web.StreamResponse:
        path = raw_request.path
        params = dict(raw_request.query)
        if path.startswith(CONTROL_PREFIX):
            return self._serve_control(raw_request.method, path)
        target = parse_resource_path(path, self.api.registry)
        # A watch stays open for minutes: log it when it starts, not when it ends.
        watching = verb_for(raw_request.method, target, params) == "watch"
        if watching:
            self._record(raw_request, target, params, 200)
        try:
            response = await self._dispatch(raw_request, target, params, body)
        except errors.ApiError as e:
            response = _error_response(e)
        if not watching:
            self._record(raw_request, target, params, response.status)
        return response

    def _record(
        self, raw_request: aiohttp.web.BaseRequest, target: ResourcePath | None, params: dict[str, str], code: int
    ) -> None:
        self.records.append(
            RequestRecord(
                method=raw_request.method,
                path=raw_request.path,
                query=params,
                verb=verb_for(raw_request.method, target, params),
                group=target.group if target else "",
                version=target.version if target else "",
                resource=target.plural if target else "",
                subresource=target.subresource if target else "",
                namespace=target.namespace if target else None,
                name=target.name if target else None,
                user_agent=raw_request.headers.get("User-Agent", ""),
                code=code,
            )
        )

    def _serve_control(self, method: str, path: str) -> aiohttp.web.Response:
        if path == "/emulator/requests" and method == "GET":
            return _json_response([record.to_json() for record in self.records])
        if path == "/emulator/requests" and method == "DELETE":
            self.records.clear()
            return _json_response({"cleared": True})
        if path == "/emulator/compact" and method == "POST":
            self.api.store.compact()
            return _json_response({"compactedAt": self.api.store.resource_version})
        if path == "/emulator/health":
            return _json_response({"ok": True, "resourceVersion": self.api.store.resource_version})
        return _error_response(errors.ApiError(404, "NotFound", f"unknown emulator control path {path}"))

    async def _dispatch(
        self,
        raw_request: aiohttp.web.BaseRequest,
        target: ResourcePath | None,
        params: dict[str, str],
        body: bytes,
    ) -> aiohttp.web.StreamResponse:
        if target is None:
            return self._serve_non_resource(raw_request.method, raw_request.path)
        info = self.api.registry.find(target.group, target.version, target.plural)
        if info is None:
            raise errors.ApiError(
                404, "NotFound", f"the server could not find the requested resource ({target.plural})"
            )
        if target.namespace is None and info.namespaced and target.name is not None:
            raise errors.ApiError(404, "NotFound", "the server could not find the requested resource")
        namespace = target.namespace or ""
        method = raw_request.method.upper()
        accept = raw_request.headers.get("Accept", "")
        content_type = raw_request.headers.get("Content-Type", "application/json").split(";")[0].strip()
        user_agent = raw_request.headers.get("User-Agent", "")
        manager = _manager(params, user_agent)
        verb = verb_for(method, target, params)
        if target.subresource and target.subresource not in self._subresources(info):
            raise errors.ApiError(
                404,
                "NotFound",
                f"the server could not find the requested resource ({target.plural}/{target.subresource})",
            )

        if verb == "watch":
            return await self._watch(raw_request, info, target.namespace, params, accept)
        if verb == "list":
            items = self.api.list_objects(
                info,
                target.namespace,
                label_selector=params.get("labelSelector"),
                field_selector=params.get("fieldSelector"),
            )
            return self._list_response(info, items, accept, params)
        object_name = target.name or ""
        if verb == "get":
            if target.subresource == "scale":
                return _json_response(self.api.get_scale(info, namespace, object_name))
            obj = self.api.get(info, namespace, object_name)
            return self._object_response(info, obj, accept, params)
        if verb == "create":
            new_obj = self.api.create(info, namespace, _parse_body(body, content_type), manager=manager)
            return _json_response(new_obj, status=201)
        if verb == "update":
            updated = self.api.replace(
                info,
                namespace,
                object_name,
                _parse_body(body, content_type),
                subresource=target.subresource,
                manager=manager,
            )
            return _json_response(updated)
        if verb == "patch":
            kind = PATCH_CONTENT_TYPES.get(content_type)
            if kind is None:
                raise errors.ApiError(
                    415,
                    "UnsupportedMediaType",
                    f"the body of the request was in an unknown "
                    f"format - accepted media types include: {', '.join(PATCH_CONTENT_TYPES)}",
                )
            patched_obj, created = self.api.patch(
                info,
                namespace,
                object_name,
                kind,
                _parse_body(body, content_type),
                subresource=target.subresource,
                manager=params.get("fieldManager", "") if kind == "apply" else manager,
                force=params.get("force", "").lower() in ("1", "true"),
            )
            return _json_response(patched_obj, status=201 if created else 200)
        if verb == "delete":
            options = _parse_body(body, "application/json") or {}
            propagation = params.get("propagationPolicy") or options.get("propagationPolicy") or "Background"
            deleted = self.api.delete(
                info,
                namespace,
                object_name,
                propagation=propagation,
                preconditions=options.get("preconditions"),
            )
            return _json_response(deleted)
        if verb == "deletecollection":
            deleted_items = self.api.delete_collection(
                info,
                target.namespace,
                label_selector=params.get("labelSelector"),
                field_selector=params.get("fieldSelector"),
            )
            return _json_response(self._list_body(info, deleted_items))
        raise errors.ApiError(405, "MethodNotAllowed", f"{method} is not supported on {raw_request.path}")

    def _subresources(self, info: ResourceInfo) -> set[str]:
        found = {"status"} if info.has_status else set()
        if info.scale is not None:
            found.add("scale")
        return found

    def _serve_non_resource(self, method: str, path: str) -> aiohttp.web.Response:
        registry = self.api.registry
        normalized = "/" + path.strip("/")
        segments = [segment for segment in normalized.split("/") if segment]
        answer: Any = None
        if method.upper() != "GET":
            answer = None
        elif normalized == "/":
            answer = discovery.root_paths(registry)
        elif normalized == "/version":
            answer = discovery.KUBERNETES_VERSION
        elif normalized in ("/healthz", "/readyz", "/livez"):
            return aiohttp.web.Response(text="ok")
        elif normalized == "/api":
            answer = discovery.core_versions(self.server_address)
        elif normalized == "/api/v1":
            answer = discovery.resource_list(registry, "", "v1")
        elif normalized == "/apis":
            answer = discovery.group_list(registry)
        elif len(segments) == 2 and segments[0] == "apis":
            answer = discovery.group(registry, segments[1])
        elif len(segments) == 3 and segments[0] == "apis":
            answer = discovery.resource_list(registry, segments[1], segments[2])
        if answer is None:
            # /openapi/v2 and /openapi/v3 included: kubectl then skips client-side validation and schema
            # lookups (use --validate=false for apply) and falls back to its built-in knowledge.
            raise errors.ApiError(404, "NotFound", "the server could not find the requested resource")
        return _json_response(answer)

    def _list_body(self, info: ResourceInfo, items: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "kind": f"{info.kind}List",
            "apiVersion": info.api_version,
            "metadata": {"resourceVersion": str(self.api.store.resource_version)},
            "items": items,
        }

    def _list_response(
        self, info: ResourceInfo, items: list[dict[str, Any]], accept: str, params: Mapping[str, str]
    ) -> aiohttp.web.Response:
        if tables.wants_table(accept):
            return _json_response(
                tables.to_table(
                    items,
                    info,
                    resource_version=str(self.api.store.resource_version),
                    include_object=params.get("includeObject", "Metadata"),
                )
            )
        return _json_response(self._list_body(info, items))

    def _object_response(
        self, info: ResourceInfo, obj: dict[str, Any], accept: str, params: Mapping[str, str]
    ) -> aiohttp.web.Response:
        if tables.wants_table(accept):
            return _json_response(
                tables.to_table(
                    [obj],
                    info,
                    resource_version=obj["metadata"]["resourceVersion"],
                    include_object=params.get("includeObject", "Metadata"),
                )
            )
        return _json_response(obj)

    async def _watch(
        self,
        raw_request: aiohttp.web.BaseRequest,
        info: ResourceInfo,
        namespace: str | None,
        params: Mapping[str, str],
        accept: str,
    ) -> aiohttp.web.StreamResponse:
        try:
            watch_filter = WatchFilter(
                info=info,
                namespace=namespace if info.namespaced else None,
                labels=selectors.parse_label_selector(params.get("labelSelector")),
                fields=selectors.parse_field_selector(params.get("fieldSelector")),
            )
        except selectors.SelectorError as e:
            raise errors.bad_request(str(e)) from None
        request = WatchRequest.from_params(watch_filter, params)
        include_object = params.get("includeObject", "Metadata")

        def render(obj: dict[str, Any]) -> dict[str, Any]:
            if tables.wants_table(accept):
                return tables.to_table(
                    [obj],
                    info,
                    resource_version=obj["metadata"].get("resourceVersion", ""),
                    include_object=include_object,
                )
            return obj

        return await serve_watch(raw_request, self.api.store, request, render)
