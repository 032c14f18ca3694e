"""Where the workers are: static lists, DNS of headless Services, or EndpointSlices watched live
(file and Pod discovery, which also know each worker's KV generation, are in discovery_file.py and
discovery_pods.py).

Each source calls ``on_update(pool, ready_urls, terminating_urls[, generations])`` with a full
snapshot of a pool whenever it learns something; the pool diffs it against what it has (see
WorkerPool.set_endpoints). ``generations`` maps a URL to its worker's KV generation; sources that
cannot know it leave it out, and every worker's generation is then "" (unknown).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import orjson

from splitserve.kubeconfig import KubeAccess

log = logging.getLogger(__name__)


class UpdateCallback(Protocol):
    """A full snapshot of one pool. ``generations`` is optional so that sources without generations
    (and callers outside this package, e.g. benchmarks' push discoveries) keep calling with three."""

    def __call__(
        self, pool: str, ready: set[str], terminating: set[str], generations: Mapping[str, str] | None = None, /
    ) -> None: ...


@dataclass
class PoolSnapshot:
    """What a generation-aware source knows of one pool: URLs by state and each URL's generation."""

    ready: set[str] = field(default_factory=set)
    terminating: set[str] = field(default_factory=set)
    generations: dict[str, str] = field(default_factory=dict)

    def report(self, pool: str, on_update: UpdateCallback) -> None:
        on_update(pool, set(self.ready), set(self.terminating), dict(self.generations))


# The two pools of a router. Decode also takes aggregated workers (they serve whole requests).
POOLS = ("prefill", "decode")


def url_of(host: str, port: int) -> str:
    """``http://host:port``, an IPv6 address in brackets."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class Discovery(Protocol):
    async def run(self, on_update: UpdateCallback) -> None:
        """Report snapshots until cancelled (a static source reports once and returns)."""
        ...


class StaticDiscovery:
    def __init__(self, pools: Mapping[str, Iterable[str]]) -> None:
        self._pools = {name: set(urls) for name, urls in pools.items()}

    async def run(self, on_update: UpdateCallback) -> None:
        for name, urls in self._pools.items():
            on_update(name, set(urls), set())


class DnsDiscovery:
    """Resolves headless Service names (one A/AAAA record per ready pod) every ``interval`` s."""

    def __init__(self, services: Mapping[str, str], port: int, interval: float) -> None:
        self._services = dict(services)
        self._port = port
        self._interval = interval

    async def resolve(self, host: str) -> set[str]:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, self._port, type=socket.SOCK_STREAM)
        urls = set()
        for family, _, _, _, sockaddr in infos:
            address = str(sockaddr[0])
            urls.add(
                f"http://[{address}]:{self._port}" if family == socket.AF_INET6 else f"http://{address}:{self._port}"
            )
        return urls

    async def run(self, on_update: UpdateCallback) -> None:
        while True:
            for pool, host in self._services.items():
                try:
                    urls = await self.resolve(host)
                except OSError as error:
                    # NXDOMAIN is what a headless Service with zero ready pods answers: an empty pool.
                    log.debug("DNS lookup of %s failed: %s", host, error)
                    urls = set()
                on_update(pool, urls, set())
            await asyncio.sleep(self._interval)


def endpoints_of_slices(slices: Iterable[Mapping[str, Any]], port: int) -> tuple[set[str], set[str]]:
    """(ready, terminating) worker URLs from EndpointSlice objects.

    Ready means conditions.ready is not false and terminating is not true (the API's own reading of
    unset conditions). A terminating endpoint keeps its in-flight requests but gets no new ones; an
    endpoint that is simply not ready is left out.
    """
    ready: set[str] = set()
    terminating: set[str] = set()
    for item in slices:
        family = item.get("addressType", "IPv4")
        for endpoint in item.get("endpoints") or []:
            conditions = endpoint.get("conditions") or {}
            for address in endpoint.get("addresses") or []:
                host = f"[{address}]" if family == "IPv6" else address
                url = f"http://{host}:{port}"
                if conditions.get("terminating") is True:
                    terminating.add(url)
                elif conditions.get("ready") is not False:
                    ready.add(url)
    return ready, terminating - ready


class ApiDiscovery:
    """The base of the sources that follow the Kubernetes API with ListWatch (EndpointSlices here, Pods
    in discovery_pods.py): the API, the namespace, the workers' port, and the watch timeout and retry
    delay each of their ListWatches gets."""

    def __init__(
        self, access: KubeAccess, namespace: str, port: int, watch_timeout_seconds: int, retry_delay: float
    ) -> None:
        self._access = access
        self._namespace = namespace
        self._port = port
        self._watch_timeout = watch_timeout_seconds
        self._retry_delay = retry_delay

    def _list_watch(
        self,
        session: aiohttp.ClientSession,
        path: str,
        selector: str,
        on_change: Callable[[Mapping[str, Mapping[str, Any]]], None],
        what: str,
    ) -> ListWatch:
        return ListWatch(
            session, self._access, path, selector, on_change, what=what,
            watch_timeout_seconds=self._watch_timeout, retry_delay=self._retry_delay,
        )  # fmt: skip


class KubernetesDiscovery(ApiDiscovery):
    """Lists then watches discovery.k8s.io/v1 EndpointSlices of each Service, relisting on 410 Gone."""

    def __init__(
        self,
        access: KubeAccess,
        namespace: str,
        services: Mapping[str, str],
        port: int,
        watch_timeout_seconds: int = 240,
        retry_delay: float = 1.0,
    ) -> None:
        super().__init__(access, namespace, port, watch_timeout_seconds, retry_delay)
        self._services = dict(services)

    async def run(self, on_update: UpdateCallback) -> None:
        path = f"{self._access.server}/apis/discovery.k8s.io/v1/namespaces/{self._namespace}/endpointslices"
        async with api_session(self._access) as session:

            def follower(pool: str, service: str) -> ListWatch:
                def changed(slices: Mapping[str, Mapping[str, Any]]) -> None:
                    on_update(pool, *endpoints_of_slices(slices.values(), self._port))

                selector = f"kubernetes.io/service-name={service}"
                return self._list_watch(session, path, selector, changed, f"EndpointSlices of {service}")

            await asyncio.gather(*(follower(pool, svc).run() for pool, svc in self._services.items()))


def api_session(access: KubeAccess) -> aiohttp.ClientSession:
    """A session for the Kubernetes API: no total timeout, since watches stay open for minutes."""
    connector = aiohttp.TCPConnector(ssl=access.ssl_context)
    return aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None, connect=10.0, sock_read=None)
    )


class ListWatch:
    """Follows one label-selected collection of the Kubernetes API: list, then watch from the list's
    resourceVersion, relist on 410 Gone, and keep the last snapshot while the API is unreachable.

    ``on_change`` gets every object currently selected, by name, after the list and after each event.
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        access: KubeAccess,
        path: str,
        selector: str,
        on_change: Callable[[Mapping[str, Mapping[str, Any]]], None],
        *,
        what: str,
        watch_timeout_seconds: int = 240,
        retry_delay: float = 1.0,
    ) -> None:
        self._session = session
        self._access = access
        self._path = path
        self._selector = selector
        self._on_change = on_change
        self._what = what
        self._watch_timeout = watch_timeout_seconds
        self._retry_delay = retry_delay

    async def run(self) -> None:
        while True:
            try:
                objects: dict[str, Mapping[str, Any]] = {}
                async with self._session.get(
                    self._path, params={"labelSelector": self._selector}, headers=self._access.headers()
                ) as response:
                    if response.status != 200:
                        text = (await response.text())[:200]
                        raise RuntimeError(f"list {self._what}: HTTP {response.status}: {text}")
                    listing = orjson.loads(await response.read())
                for item in listing.get("items") or []:
                    objects[item["metadata"]["name"]] = item
                version = listing.get("metadata", {}).get("resourceVersion", "")
                self._on_change(objects)
                while True:
                    version = await self._watch(version, objects)
            except asyncio.CancelledError:
                raise
            except _Gone:
                log.info("watch of %s expired; relisting", self._what)
                continue
            except Exception as error:  # API down, RBAC missing, network: keep the last snapshot, retry
                log.warning("discovery of %s failed: %s; retrying", self._what, error)
                await asyncio.sleep(self._retry_delay)

    async def _watch(self, version: str, objects: dict[str, Mapping[str, Any]]) -> str:
        params = {
            "labelSelector": self._selector,
            "watch": "1",
            "allowWatchBookmarks": "true",
            "resourceVersion": version,
            "timeoutSeconds": str(self._watch_timeout),
        }
        async with self._session.get(self._path, params=params, headers=self._access.headers()) as response:
            if response.status == 410:
                raise _Gone
            if response.status != 200:
                raise RuntimeError(f"watch {self._what}: HTTP {response.status}")
            async for line in response.content:
                if not line.strip():
                    continue
                event = orjson.loads(line)
                kind = event.get("type")
                obj = event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise _Gone
                    raise RuntimeError(f"watch error: {obj.get('message')}")
                version = (obj.get("metadata") or {}).get("resourceVersion", version)
                if kind == "BOOKMARK":
                    continue
                name = obj["metadata"]["name"]
                if kind == "DELETED":
                    objects.pop(name, None)
                else:
                    objects[name] = obj
                self._on_change(objects)
        return version


class _Gone(Exception):
    """The watch's resourceVersion is too old (HTTP 410): list again."""
