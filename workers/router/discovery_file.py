"""File discovery: the workers, their states and KV generations, read from a JSON file.

For ``splitserve up``, the local stack and tests, which start workers themselves and know each
one's generation. The file's writer replaces it atomically (write a temporary file, rename it over)
whenever the workers change; the router polls it::

    {"pools": {"prefill": [{"url": "http://127.0.0.1:8101", "generation": "aaaaaaaaaa", "state": "ready"}],
               "decode":  [{"url": "http://127.0.0.1:8201", "generation": "aaaaaaaaaa", "state": "terminating"}]}}

``generation`` defaults to "" (unknown), ``state`` to "ready"; an absent pool has no workers. A file
that is missing or does not parse keeps the last snapshot (a warning is logged once per problem):
a half-written or briefly absent file must never empty the pools under live traffic.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson

from splitserve.router.discovery import POOLS, PoolSnapshot, UpdateCallback

log = logging.getLogger(__name__)

STATES = ("ready", "terminating")


class EndpointsFileError(ValueError):
    """The endpoints file is not what the format says."""


def _entry(pool: str, index: int, raw: object) -> tuple[str, str, str]:
    where = f"pools.{pool}[{index}]"
    if not isinstance(raw, dict):
        raise EndpointsFileError(f"{where} must be an object")
    url, generation, state = raw.get("url"), raw.get("generation", ""), raw.get("state", "ready")
    if not isinstance(url, str) or not url.startswith("http://"):
        raise EndpointsFileError(f"{where}.url must be an http:// URL, got {url!r}")
    if not isinstance(generation, str):
        raise EndpointsFileError(f"{where}.generation must be a string, got {generation!r}")
    if state not in STATES:
        raise EndpointsFileError(f"{where}.state must be one of {', '.join(STATES)}, got {state!r}")
    return url.rstrip("/"), generation, state


def parse_endpoints_file(data: bytes | str) -> dict[str, PoolSnapshot]:
    """The snapshot of both pools ("prefill", "decode"; always both) the file describes.

    Raises EndpointsFileError when it is not JSON or not in the format. Pools other than the two a
    router has are ignored (a newer writer may describe more). A URL listed both ready and
    terminating is ready.
    """
    try:
        document: Any = orjson.loads(data)
    except orjson.JSONDecodeError as error:
        raise EndpointsFileError(f"not JSON: {error}") from None
    if not isinstance(document, dict) or not isinstance(document.get("pools"), dict):
        raise EndpointsFileError('expected an object with a "pools" object')
    pools = {name: PoolSnapshot() for name in POOLS}
    for name, snapshot in pools.items():
        entries = document["pools"].get(name, [])
        if not isinstance(entries, list):
            raise EndpointsFileError(f"pools.{name} must be a list")
        for index, raw in enumerate(entries):
            url, generation, state = _entry(name, index, raw)
            if state == "ready":
                snapshot.ready.add(url)
                snapshot.generations[url] = generation
            else:
                snapshot.terminating.add(url)
                snapshot.generations.setdefault(url, generation)
        snapshot.terminating -= snapshot.ready
    return pools


def read_endpoints_file(path: str) -> dict[str, PoolSnapshot]:
    with open(path, "rb") as handle:
        return parse_endpoints_file(handle.read())


class FileDiscovery:
    """Polls the endpoints file every ``interval`` seconds and reports both pools when it changed."""

    def __init__(self, path: str, interval: float = 0.2) -> None:
        self._path = path
        self._interval = interval

    async def run(self, on_update: UpdateCallback) -> None:
        last: dict[str, PoolSnapshot] | None = None
        problem: str | None = None
        while True:
            try:
                # A small local file: reading it on the loop costs less than a thread hop.
                snapshot = read_endpoints_file(self._path)
            except (OSError, EndpointsFileError) as error:
                if str(error) != problem:
                    problem = str(error)
                    kept = "keeping the last snapshot" if last is not None else "no workers yet"
                    log.warning("endpoints file %s unusable (%s); %s", self._path, problem, kept)
            else:
                if problem is not None:
                    log.info("endpoints file %s readable again", self._path)
                problem = None
                if snapshot != last:
                    for pool, pool_snapshot in snapshot.items():
                        pool_snapshot.report(pool, on_update)
                    last = snapshot
            await asyncio.sleep(self._interval)
