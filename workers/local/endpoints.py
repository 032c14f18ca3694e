"""The local router's view of the workers: the endpoints file `up` writes, and what the router reports.

The router of a local stack runs with file discovery (`--discovery file --endpoints-file PATH`). `up`
owns the file and rewrites it whole, atomically (a temporary file renamed over it), whenever a worker
joins, starts terminating or leaves; the router polls it:

    {"pools": {"prefill": [{"url": "http://127.0.0.1:8101", "generation": "aaaaaaaaaa", "state": "ready"}],
               "decode":  [{"url": "http://127.0.0.1:8201", "generation": "aaaaaaaaaa", "state": "terminating"}]}}

Each write is a full snapshot, so whatever version the router reads is consistent. A worker that died
and is being restarted (restarts.py) is not ready: `up` keeps it in memory but leaves it out of the
file, as an EndpointSlice endpoint whose readiness probe fails is no longer ready, and writes it back
once it answers again. What the router
made of it comes back from `GET /splitserve/workers` (per pool: url, generation, state
healthy|ejected|terminating|departing, inflight), which is how a rollout knows that the router took
the new workers and that nothing is left in flight on the old ones.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from splitserve.local.plan import ProcessSpec

POOLS = ("prefill", "decode")
READY = "ready"
TERMINATING = "terminating"
NOT_READY = "not-ready"  # known to `up`, not written to the file (the router has no such state)


@dataclass(frozen=True)
class Endpoint:
    pool: str
    url: str
    generation: str
    state: str = READY


class EndpointsFile:
    """The workers the router may use, kept in memory and written whole on every change."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._endpoints: dict[str, Endpoint] = {}

    @property
    def endpoints(self) -> list[Endpoint]:
        return list(self._endpoints.values())

    def add(self, workers: Iterable[ProcessSpec]) -> None:
        for worker in workers:
            self._endpoints[worker.base_url] = Endpoint(worker.pool, worker.base_url, worker.generation)
        self.write()

    def mark_terminating(self, urls: Iterable[str]) -> None:
        for url in urls:
            endpoint = self._endpoints[url]
            self._endpoints[url] = Endpoint(endpoint.pool, url, endpoint.generation, TERMINATING)
        self.write()

    def mark_not_ready(self, urls: Iterable[str]) -> None:
        """Ready workers that died: out of the file until mark_ready (terminating ones stay as they are)."""
        self._set_state(urls, READY, NOT_READY)

    def mark_ready(self, urls: Iterable[str]) -> None:
        """Not-ready workers that answer again: back in the file as ready."""
        self._set_state(urls, NOT_READY, READY)

    def _set_state(self, urls: Iterable[str], before: str, after: str) -> None:
        changed = False
        for url in urls:
            endpoint = self._endpoints.get(url)
            if endpoint is not None and endpoint.state == before:
                self._endpoints[url] = Endpoint(endpoint.pool, url, endpoint.generation, after)
                changed = True
        if changed:
            self.write()

    def remove(self, urls: Iterable[str]) -> None:
        for url in urls:
            self._endpoints.pop(url, None)
        self.write()

    def document(self) -> dict[str, Any]:
        pools: dict[str, list[dict[str, str]]] = {pool: [] for pool in POOLS}
        for endpoint in sorted(self._endpoints.values(), key=lambda e: e.url):
            if endpoint.state == NOT_READY:
                continue
            entry = {"url": endpoint.url, "generation": endpoint.generation, "state": endpoint.state}
            pools[endpoint.pool].append(entry)
        return {"pools": pools}

    def write(self) -> None:
        write_atomically(self.path, json.dumps(self.document(), indent=2) + "\n")


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` by `text` so a reader sees the old content or the new one, never a part."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)


# ---------------------------------------------------------------------------------- the router's side

RouterWorkers = Mapping[str, Sequence[Mapping[str, Any]]]


def router_workers(client: httpx.Client, router_url: str) -> RouterWorkers | None:
    """`GET /splitserve/workers` of the router, or None when it does not answer (yet)."""
    try:
        response = client.get(f"{router_url}/splitserve/workers")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    document = response.json()
    return document if isinstance(document, dict) else None


def _entries(report: RouterWorkers, url: str) -> list[Mapping[str, Any]]:
    return [entry for pool in POOLS for entry in report.get(pool, []) if entry.get("url") == url]


def all_healthy(report: RouterWorkers, urls: Iterable[str]) -> bool:
    """Whether the router lists each URL as healthy (it routes new requests to it)."""
    return all(any(entry.get("state") == "healthy" for entry in _entries(report, url)) for url in urls)


def inflight_on(report: RouterWorkers, urls: Iterable[str]) -> int:
    """Requests the router still has on these workers (departing ones included)."""
    return sum(int(entry.get("inflight", 0)) for url in urls for entry in _entries(report, url))


def drained(report: RouterWorkers, urls: Iterable[str]) -> bool:
    """Whether the router sends these workers nothing new (no longer healthy there, or forgotten) and has
    no request left on them: then they may leave the file and stop."""
    for url in urls:
        for entry in _entries(report, url):
            if entry.get("state") in ("healthy", "ejected") or int(entry.get("inflight", 0)) > 0:
                return False
    return True
