"""What the operator knows of the cluster without asking: watch-fed indexes plus its own recent writes.

The indexes are kopf's (`@kopf.index` in handlers.py), fed by the watches the operator holds anyway:
the InferenceDeployments by (namespace, name), every child kind by (namespace, owner name), and the
worker pods (a slim copy: name, labels, the Ready and AdaptersReady conditions) by (namespace, owner name). kopf
runs no handler before every index has been listed once, so whatever reads this cache reads a synced
one. A watch event lags the write that caused it, though, so the cache also keeps the server's answer
to each write the operator made (apply, create, scale, status) until the watch has caught up: a
reconcile right after a write sees that write, and does not repeat it.

No I/O here: the reconciler puts what the API server answered, the watches fill the indexes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from splitserve.api.base import API_GROUP, API_VERSION, KIND
from splitserve.api.topology import LABEL_DEPLOYMENT

# (apiVersion, kind, namespace, name)
ObjectKey = tuple[str, str, str, str]
# An index as kopf hands it to handlers: key -> the values every matching object gave for that key.
Index = Mapping[Any, Iterable[Mapping[str, Any]]]

IDEP_API_VERSION, IDEP_KIND = f"{API_GROUP}/{API_VERSION}", KIND
# A write the watch never confirms (another writer raced us) stops shadowing the index after this long;
# a watched deletion ends it at once. Long, because a busy operator's watch events lag by seconds.
WRITE_SHADOW_SECONDS = 120.0


def key_of(obj: Mapping[str, Any]) -> ObjectKey:
    meta = obj["metadata"]
    return obj["apiVersion"], obj["kind"], meta.get("namespace", ""), meta["name"]


def _version(obj: Mapping[str, Any] | None) -> int | None:
    """resourceVersion as a number when it is one (etcd revisions are): lets an older event lose to a newer write."""
    if obj is None:
        return None
    text = str(obj.get("metadata", {}).get("resourceVersion", ""))
    return int(text) if text.isdigit() else None


@dataclass(frozen=True)
class _Written:
    obj: dict[str, Any] | None  # None: the operator deleted it
    at: float


@dataclass
class ClusterCache:
    """Reads for the reconciler and the periodic loops; `bind` hands it kopf's current indexes."""

    clock: Callable[[], float] = time.monotonic
    deployments: Index = field(default_factory=dict)  # (namespace, name) -> [InferenceDeployment]
    children: Index = field(default_factory=dict)  # (namespace, owner) -> [child of any kind]
    pods: Index = field(default_factory=dict)  # (namespace, owner) -> [slim worker pod]
    _written: dict[ObjectKey, _Written] = field(default_factory=dict)

    def bind(self, deployments: Index, children: Index, pods: Index | None = None) -> None:
        self.deployments, self.children = deployments, children
        if pods is not None:
            self.pods = pods

    # ------------------------------------------------------------------ what the operator wrote

    def wrote(self, obj: Mapping[str, Any]) -> None:
        """The API server's answer to a write: newer than anything the watch has shown so far."""
        self._written[key_of(obj)] = _Written(dict(obj), self.clock())

    synced: bool = False  # set by the first handler kopf runs: every index has been listed by then

    def gone(self, obj: Mapping[str, Any]) -> None:
        """A watched deletion: whatever the operator wrote before is no longer there."""
        self._written.pop(key_of(obj), None)

    def deleted(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        self._written[(api_version, kind, namespace, name)] = _Written(None, self.clock())

    def _overlay(self, key: ObjectKey, indexed: dict[str, Any] | None) -> dict[str, Any] | None:
        written = self._written.get(key)
        if written is None:
            return indexed
        if self.clock() - written.at > WRITE_SHADOW_SECONDS or _caught_up(indexed, written.obj):
            del self._written[key]
            return indexed
        return written.obj

    # ------------------------------------------------------------------ reads

    def deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The InferenceDeployment as last seen (None: gone)."""
        found = next(iter(self.deployments.get((namespace, name), ())), None)
        key = (IDEP_API_VERSION, IDEP_KIND, namespace, name)
        return self._overlay(key, dict(found) if found is not None else None)

    def owned(self, namespace: str, owner: str) -> dict[tuple[str, str, str], dict[str, Any]]:
        """Every child labelled with `owner`, keyed by (apiVersion, kind, name), written ones included."""
        result: dict[tuple[str, str, str], dict[str, Any]] = {}
        for child in self.children.get((namespace, owner), ()):
            result[(child["apiVersion"], child["kind"], child["metadata"]["name"])] = dict(child)
        for key in [k for k in self._written if k[2] == namespace]:
            written = self._written[key].obj
            labels = (written or {}).get("metadata", {}).get("labels") or {}
            child_key = (key[0], key[1], key[3])
            if written is not None and labels.get(LABEL_DEPLOYMENT) != owner:
                continue
            if written is None and child_key not in result:
                continue
            seen = self._overlay(key, result.get(child_key))
            if seen is None:
                result.pop(child_key, None)
            else:
                result[child_key] = seen
        return result

    def worker_pods(self, namespace: str, owner: str) -> list[dict[str, Any]]:
        """The owner's worker pods as last watched (slim copies, see controller.adapters.slim_pod)."""
        return [dict(pod) for pod in self.pods.get((namespace, owner), ())]

    def child(self, namespace: str, owner: str, api_version: str, kind: str, name: str) -> dict[str, Any] | None:
        return self.owned(namespace, owner).get((api_version, kind, name))


def _caught_up(indexed: Mapping[str, Any] | None, written: Mapping[str, Any] | None) -> bool:
    if written is None:
        return indexed is None
    if indexed is None:
        return False
    new, old = _version(indexed), _version(written)
    if new is not None and old is not None:
        return new >= old
    same: bool = indexed.get("metadata", {}).get("resourceVersion") == written.get("metadata", {}).get(
        "resourceVersion"
    )
    return same
