"""In-memory object store: one global resourceVersion counter (like etcd), an event history for watches."""

from __future__ import annotations

import asyncio
import collections
import copy
import dataclasses
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ObjectKey = tuple[str, str]  # (namespace or "" for cluster-scoped, name)


@dataclasses.dataclass(frozen=True)
class StoredEvent:
    type: str  # ADDED, MODIFIED, DELETED
    resource_key: str  # ResourceInfo.key: "group/plural"
    obj: dict[str, Any]
    old: dict[str, Any] | None
    resource_version: int


class ObjectStore:
    def __init__(self, *, history_limit: int = 10_000, state_file: Path | None = None) -> None:
        self._objects: dict[str, dict[ObjectKey, dict[str, Any]]] = collections.defaultdict(dict)
        self._history: collections.deque[StoredEvent] = collections.deque(maxlen=history_limit)
        self._subscribers: set[asyncio.Queue[StoredEvent]] = set()
        # Seeded from the clock, so a restarted (emptied) emulator never reuses the resourceVersions a
        # client still holds: resuming a watch from one answers 410 Gone and the client re-lists, as after an
        # etcd compaction. (Starting from 0 would make old versions look like future ones.)
        self._resource_version = int(time.time() * 1000)
        self._state_file = state_file
        # The oldest resourceVersion a watch may resume from; older ones answer 410 Gone.
        self._compacted_at = self._resource_version

    @property
    def resource_version(self) -> int:
        return self._resource_version

    def next_resource_version(self) -> int:
        self._resource_version += 1
        return self._resource_version

    def get(self, resource_key: str, namespace: str, name: str) -> dict[str, Any] | None:
        found = self._objects[resource_key].get((namespace, name))
        return copy.deepcopy(found) if found is not None else None

    def list_objects(self, resource_key: str, namespace: str | None = None) -> list[dict[str, Any]]:
        objects = [
            copy.deepcopy(obj)
            for (obj_namespace, _), obj in sorted(self._objects[resource_key].items())
            if namespace is None or obj_namespace == namespace
        ]
        return objects

    def items(self) -> Iterator[tuple[str, dict[str, Any]]]:
        for resource_key, objects in list(self._objects.items()):
            for obj in list(objects.values()):
                yield resource_key, obj

    def find_uid(self, uid: str) -> bool:
        return any(obj.get("metadata", {}).get("uid") == uid for _, obj in self.items())

    def put(self, resource_key: str, obj: dict[str, Any], *, created: bool) -> dict[str, Any]:
        """Store a new version; the caller set everything except metadata.resourceVersion."""
        metadata = obj["metadata"]
        key = (metadata.get("namespace", ""), metadata["name"])
        old = self._objects[resource_key].get(key)
        rv = self.next_resource_version()
        metadata["resourceVersion"] = str(rv)
        stored = copy.deepcopy(obj)
        self._objects[resource_key][key] = stored
        self._emit(StoredEvent("ADDED" if created else "MODIFIED", resource_key, stored, old, rv))
        return copy.deepcopy(stored)

    def remove(
        self, resource_key: str, namespace: str, name: str, *, final: dict[str, Any] | None = None
    ) -> dict[str, Any] | None:
        """Delete an object; `final` is its last content (an update removing the last finalizer)."""
        old = self._objects[resource_key].pop((namespace, name), None)
        if old is None:
            return None
        rv = self.next_resource_version()
        final = copy.deepcopy(final if final is not None else old)
        final["metadata"]["resourceVersion"] = str(rv)
        self._emit(StoredEvent("DELETED", resource_key, final, old, rv))
        return copy.deepcopy(final)

    def _emit(self, event: StoredEvent) -> None:
        if self._history.maxlen is not None and len(self._history) == self._history.maxlen:
            self._compacted_at = self._history[0].resource_version
        self._history.append(event)
        for queue in list(self._subscribers):
            queue.put_nowait(event)
        self._persist()

    def subscribe(self) -> asyncio.Queue[StoredEvent]:
        queue: asyncio.Queue[StoredEvent] = asyncio.Queue()
        self._subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[StoredEvent]) -> None:
        self._subscribers.discard(queue)

    def events_after(self, resource_version: int) -> list[StoredEvent] | None:
        """Events newer than resource_version, or None when the history no longer reaches back there.

        A version newer than the newest one (a client that saw another server's history) is as unusable.
        """
        if resource_version < self._compacted_at or resource_version > self._resource_version:
            return None
        return [event for event in self._history if event.resource_version > resource_version]

    def compact(self) -> None:
        """Forget the event history (tests use it to provoke 410 Gone on watch resumption)."""
        self._history.clear()
        self._compacted_at = self._resource_version

    # Persistence: optional, so a restarted emulator can keep its objects (--state FILE).
    def _persist(self) -> None:
        if self._state_file is None:
            return
        snapshot = {
            "resourceVersion": self._resource_version,
            "objects": {key: list(objects.values()) for key, objects in self._objects.items() if objects},
        }
        temporary = self._state_file.with_suffix(self._state_file.suffix + ".tmp")
        temporary.write_text(json.dumps(snapshot))
        os.replace(temporary, self._state_file)

    def load(self) -> None:
        if self._state_file is None or not self._state_file.exists():
            return
        snapshot = json.loads(self._state_file.read_text())
        self._resource_version = max(self._resource_version, int(snapshot.get("resourceVersion", 0)))
        self._compacted_at = self._resource_version
        for resource_key, objects in snapshot.get("objects", {}).items():
            for obj in objects:
                metadata = obj["metadata"]
                self._objects[resource_key][(metadata.get("namespace", ""), metadata["name"])] = obj
