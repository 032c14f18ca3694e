"""Where the workers are: static lists, DNS of headless Services, or EndpointSlices watched live.

Each source calls ``on_update(pool, ready_urls, terminating_urls)`` with a full snapshot of a pool
whenever it learns something; the pool diffs it against what it has (see WorkerPool.set_endpoints).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import aiohttp
import orjson

from splitserve.kubeconfig import KubeAccess

log = logging.getLogger(__name__)

UpdateCallback = Callable[[str, set[str], set[str]], None]


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


class KubernetesDiscovery:
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
        self._access = access
        self._namespace = namespace
        self._services = dict(services)
        self._port = port
        self._watch_timeout = watch_timeout_seconds
        self._retry_delay = retry_delay

    async def run(self, on_update: UpdateCallback) -> None:
        connector = aiohttp.TCPConnector(ssl=self._access.ssl_context)
        async with aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None, connect=10.0, sock_read=None)
        ) as session:
            await asyncio.gather(*(self._follow(session, pool, svc, on_update) for pool, svc in self._services.items()))

    def _path(self) -> str:
        return f"{self._access.server}/apis/discovery.k8s.io/v1/namespaces/{self._namespace}/endpointslices"

    async def _follow(self, session: aiohttp.ClientSession, pool: str, service: str, on_update: UpdateCallback) -> None:
        selector = f"kubernetes.io/service-name={service}"
        while True:
            try:
                slices: dict[str, Mapping[str, Any]] = {}
                async with session.get(
                    self._path(), params={"labelSelector": selector}, headers=self._access.headers()
                ) as response:
                    if response.status != 200:
                        raise RuntimeError(
                            f"list EndpointSlices: HTTP {response.status}: {(await response.text())[:200]}"
                        )
                    listing = orjson.loads(await response.read())
                for item in listing.get("items") or []:
                    slices[item["metadata"]["name"]] = item
                version = listing.get("metadata", {}).get("resourceVersion", "")
                on_update(pool, *endpoints_of_slices(slices.values(), self._port))
                while True:
                    version = await self._watch(session, pool, selector, version, slices, on_update)
            except asyncio.CancelledError:
                raise
            except _Gone:
                log.info("EndpointSlice watch of %s expired; relisting", service)
                continue
            except Exception as error:  # API down, RBAC missing, network: keep the last snapshot, retry
                log.warning("EndpointSlice discovery of %s failed: %s; retrying", service, error)
                await asyncio.sleep(self._retry_delay)

    async def _watch(
        self,
        session: aiohttp.ClientSession,
        pool: str,
        selector: str,
        version: str,
        slices: dict[str, Mapping[str, Any]],
        on_update: UpdateCallback,
    ) -> str:
        params = {
            "labelSelector": selector,
            "watch": "1",
            "allowWatchBookmarks": "true",
            "resourceVersion": version,
            "timeoutSeconds": str(self._watch_timeout),
        }
        async with session.get(self._path(), params=params, headers=self._access.headers()) as response:
            if response.status == 410:
                raise _Gone
            if response.status != 200:
                raise RuntimeError(f"watch EndpointSlices: HTTP {response.status}")
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
                    slices.pop(name, None)
                else:
                    slices[name] = obj
                on_update(pool, *endpoints_of_slices(slices.values(), self._port))
        return version


class _Gone(Exception):
    """The watch's resourceVersion is too old (HTTP 410): list again."""
