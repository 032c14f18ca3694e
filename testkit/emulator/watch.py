"""Watch streams: newline-delimited JSON events, resumable from a resourceVersion, with a server timeout."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp.web

from testkit.emulator import errors, selectors
from testkit.emulator.resources import ResourceInfo
from testkit.emulator.store import ObjectStore, StoredEvent

DEFAULT_TIMEOUT_SECONDS = 1800.0
INITIAL_EVENTS_END = "k8s.io/initial-events-end"


@dataclasses.dataclass(frozen=True)
class WatchFilter:
    info: ResourceInfo
    namespace: str | None
    labels: list[selectors.Requirement]
    fields: list[selectors.Requirement]

    def matches(self, obj: Mapping[str, Any] | None) -> bool:
        if obj is None:
            return False
        if self.namespace is not None and (obj.get("metadata") or {}).get("namespace") != self.namespace:
            return False
        return selectors.labels_match(self.labels, obj) and selectors.fields_match(self.fields, obj)

    def translate(self, event: StoredEvent) -> tuple[str, dict[str, Any]] | None:
        """The event this watcher sees, if any: objects entering/leaving the selection are ADDED/DELETED."""
        if event.resource_key != self.info.key:
            return None
        now_in = self.matches(event.obj)
        was_in = self.matches(event.old)
        obj = copy.deepcopy(event.obj)
        obj["apiVersion"], obj["kind"] = self.info.api_version, self.info.kind
        if event.type == "DELETED":
            return ("DELETED", obj) if now_in or was_in else None
        if event.type == "ADDED":
            return ("ADDED", obj) if now_in else None
        if now_in and was_in:
            return ("MODIFIED", obj)
        if now_in:
            return ("ADDED", obj)
        if was_in:
            return ("DELETED", obj)
        return None


Renderer = Callable[[dict[str, Any]], dict[str, Any]]


@dataclasses.dataclass
class WatchRequest:
    filter: WatchFilter
    resource_version: str | None
    timeout_seconds: float
    allow_bookmarks: bool
    send_initial_events: bool

    @classmethod
    def from_params(cls, watch_filter: WatchFilter, params: Mapping[str, str]) -> WatchRequest:
        try:
            timeout = float(params.get("timeoutSeconds") or DEFAULT_TIMEOUT_SECONDS)
        except ValueError:
            raise errors.bad_request("timeoutSeconds must be a number") from None
        return cls(
            filter=watch_filter,
            resource_version=params.get("resourceVersion") or None,
            timeout_seconds=timeout,
            allow_bookmarks=params.get("allowWatchBookmarks", "").lower() in ("1", "true"),
            send_initial_events=params.get("sendInitialEvents", "").lower() in ("1", "true"),
        )


def _line(event_type: str, obj: Mapping[str, Any]) -> bytes:
    return json.dumps({"type": event_type, "object": obj}).encode() + b"\n"


def _bookmark(info: ResourceInfo, resource_version: int, *, initial_end: bool) -> dict[str, Any]:
    metadata: dict[str, Any] = {"resourceVersion": str(resource_version)}
    if initial_end:
        metadata["annotations"] = {INITIAL_EVENTS_END: "true"}
    return {"apiVersion": info.api_version, "kind": info.kind, "metadata": metadata}


async def serve_watch(
    raw_request: aiohttp.web.BaseRequest,
    store: ObjectStore,
    watch: WatchRequest,
    render: Renderer,
) -> aiohttp.web.StreamResponse:
    queue = store.subscribe()  # before reading the history, so that no event falls in between
    try:
        response = aiohttp.web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(raw_request)
        try:
            await _stream(response, store, watch, queue, render)
            await response.write_eof()
        except (ConnectionError, aiohttp.ClientConnectionResetError):
            pass  # the client went away; nothing to clean up but the subscription
        return response
    finally:
        store.unsubscribe(queue)


async def _stream(
    response: aiohttp.web.StreamResponse,
    store: ObjectStore,
    watch: WatchRequest,
    queue: asyncio.Queue[StoredEvent],
    render: Renderer,
) -> None:
    info = watch.filter.info
    sent_up_to = store.resource_version
    if watch.send_initial_events or watch.resource_version in (None, "0"):
        for obj in store.list_objects(info.key, watch.filter.namespace):
            if watch.filter.matches(obj):
                obj["apiVersion"], obj["kind"] = info.api_version, info.kind
                await response.write(_line("ADDED", render(obj)))
        if watch.send_initial_events and watch.allow_bookmarks:
            await response.write(_line("BOOKMARK", _bookmark(info, sent_up_to, initial_end=True)))
    else:
        try:
            since = int(watch.resource_version or 0)
        except ValueError:
            raise errors.bad_request(f"invalid resourceVersion: {watch.resource_version!r}") from None
        history = store.events_after(since)
        if history is None:
            gone = errors.gone(f"too old resource version: {since} ({store.resource_version})")
            await response.write(_line("ERROR", gone.status()))
            return
        for event in history:
            await _send(response, watch, event, render)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + watch.timeout_seconds
    while (remaining := deadline - loop.time()) > 0:
        try:
            event = await asyncio.wait_for(queue.get(), timeout=remaining)
        except TimeoutError:
            break
        if event.resource_version > sent_up_to:
            await _send(response, watch, event, render)
    if watch.allow_bookmarks:
        await response.write(_line("BOOKMARK", _bookmark(info, store.resource_version, initial_end=False)))


async def _send(
    response: aiohttp.web.StreamResponse, watch: WatchRequest, event: StoredEvent, render: Renderer
) -> None:
    translated = watch.filter.translate(event)
    if translated is not None:
        event_type, obj = translated
        await response.write(_line(event_type, render(obj)))
