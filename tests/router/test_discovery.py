"""Discovery: EndpointSlice reading, a live watch against a fake API server, DNS, pool membership,
and credentials from the kubernetes client's loaders (kubeconfig tokens, exec plugins)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from aiohttp import web

from splitserve.kubeconfig import KubeAccess, authorization_header, kubeconfig_access
from splitserve.router.discovery import DnsDiscovery, KubernetesDiscovery, endpoints_of_slices
from splitserve.router.policies import RoutingRequest
from splitserve.sim import SimWorker
from testkit.router import router_config, running_router, sim_config
from tests.router.conftest import wait_until


def endpoint_slice(name: str, endpoints: list[tuple[str, dict[str, bool]]], version: str = "1") -> dict[str, Any]:
    return {
        "metadata": {"name": name, "resourceVersion": version, "labels": {"kubernetes.io/service-name": "decode"}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [address], "conditions": conditions} for address, conditions in endpoints],
        "ports": [{"port": 8000}],
    }


def test_endpoints_of_slices_reads_ready_and_terminating() -> None:
    slices = [
        endpoint_slice("a", [("10.0.0.1", {"ready": True}), ("10.0.0.2", {"ready": False})]),
        endpoint_slice("b", [("10.0.0.3", {"ready": False, "serving": True, "terminating": True}), ("10.0.0.4", {})]),
    ]
    ready, terminating = endpoints_of_slices(slices, 8000)
    assert ready == {"http://10.0.0.1:8000", "http://10.0.0.4:8000"}  # unset ready means ready
    assert terminating == {"http://10.0.0.3:8000"}


class FakeApiServer:
    """Just enough of the Kubernetes API: list and watch EndpointSlices by label selector."""

    def __init__(self) -> None:
        self.slices: dict[str, dict[str, Any]] = {}
        self.version = 1
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.selectors: list[str] = []
        self.authorization: list[str] = []

    def put(self, item: dict[str, Any]) -> None:
        self.version += 1
        item["metadata"]["resourceVersion"] = str(self.version)
        kind = "MODIFIED" if item["metadata"]["name"] in self.slices else "ADDED"
        self.slices[item["metadata"]["name"]] = item
        self.events.put_nowait({"type": kind, "object": item})

    def delete(self, name: str) -> None:
        self.version += 1
        item = self.slices.pop(name)
        self.events.put_nowait({"type": "DELETED", "object": item})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.selectors.append(request.query.get("labelSelector", ""))
        self.authorization.append(request.headers.get("Authorization", ""))
        if request.query.get("watch") != "1":
            listing = {"metadata": {"resourceVersion": str(self.version)}, "items": list(self.slices.values())}
            return web.Response(body=orjson.dumps(listing), content_type="application/json")
        response = web.StreamResponse()
        await response.prepare(request)
        while True:
            event = await self.events.get()
            await response.write(orjson.dumps(event) + b"\n")

    @classmethod
    async def start(cls) -> tuple[FakeApiServer, web.AppRunner, str]:
        api = cls()
        app = web.Application()
        app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/serving/endpointslices", api.handle)
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return api, runner, f"http://127.0.0.1:{port}"


@pytest.fixture
async def api() -> AsyncIterator[tuple[FakeApiServer, str]]:
    server, runner, url = await FakeApiServer.start()
    yield server, url
    await runner.cleanup()


async def test_endpointslice_watch_follows_scale_up_terminating_and_scale_down(api: tuple[FakeApiServer, str]) -> None:
    server, api_url = api
    server.slices["d1"] = endpoint_slice("d1", [("127.0.0.1", {"ready": True})])
    updates: list[tuple[str, set[str], set[str]]] = []
    discovery = KubernetesDiscovery(
        KubeAccess(api_url, False, token="t0ken"), "serving", {"decode": "llama-decode"}, 8000
    )
    task = asyncio.create_task(discovery.run(lambda pool, ready, term: updates.append((pool, ready, term))))
    try:
        await wait_until(lambda: updates)
        assert updates[-1] == ("decode", {"http://127.0.0.1:8000"}, set())
        assert server.selectors[0] == "kubernetes.io/service-name=llama-decode"
        assert server.authorization[0] == "Bearer t0ken"
        await wait_until(lambda: len(server.selectors) >= 2)  # the watch is open
        server.put(endpoint_slice("d2", [("127.0.0.2", {"ready": True})]))
        await wait_until(lambda: len(updates[-1][1]) == 2)
        server.put(endpoint_slice("d1", [("127.0.0.1", {"ready": False, "terminating": True})]))
        await wait_until(lambda: updates[-1][2] == {"http://127.0.0.1:8000"})
        assert updates[-1][1] == {"http://127.0.0.2:8000"}
        server.delete("d1")
        await wait_until(lambda: updates[-1] == ("decode", {"http://127.0.0.2:8000"}, set()))
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_router_follows_endpointslices_and_terminating_workers_finish(api: tuple[FakeApiServer, str]) -> None:
    server, api_url = api
    async with SimWorker(sim_config("aggregated")) as worker:
        port = int(worker.url.rsplit(":", 1)[1])
        discovery = KubernetesDiscovery(KubeAccess(api_url, False), "serving", {"decode": "d"}, port)
        async with running_router(router_config(decode_service="d"), discovery=discovery) as (router, _):
            assert not router.ready
            server.put(endpoint_slice("d1", [("127.0.0.1", {"ready": True})]))
            await wait_until(lambda: router.ready)
            held = router.decode._try_acquire(RoutingRequest(), frozenset())  # an in-flight request
            assert held is not None
            server.put(endpoint_slice("d1", [("127.0.0.1", {"ready": False, "terminating": True})]))
            await wait_until(lambda: not router.ready)
            assert router.decode._try_acquire(RoutingRequest(), frozenset()) is None  # no new requests
            assert not held.session.closed  # ... but the in-flight one keeps its connection
            server.delete("d1")
            await wait_until(lambda: not router.decode.workers)
            assert not held.session.closed
            router.decode.release(held)
            await wait_until(lambda: held.session.closed)


async def test_dns_discovery_resolves_names() -> None:
    discovery = DnsDiscovery({"decode": "localhost"}, 8123, interval=60)
    urls = await discovery.resolve("localhost")
    assert "http://127.0.0.1:8123" in urls or "http://[::1]:8123" in urls
    updates: list[tuple[str, set[str], set[str]]] = []
    task = asyncio.create_task(discovery.run(lambda p, r, t: updates.append((p, r, t))))
    await wait_until(lambda: updates)
    task.cancel()
    assert updates[0][0] == "decode" and updates[0][1] == urls


async def test_dns_name_that_does_not_resolve_is_an_empty_pool() -> None:
    discovery = DnsDiscovery({"decode": "no-such-service.invalid"}, 8000, interval=60)
    updates: list[tuple[str, set[str], set[str]]] = []
    task = asyncio.create_task(discovery.run(lambda p, r, t: updates.append((p, r, t))))
    await wait_until(lambda: updates, within=10)
    task.cancel()
    assert updates[0] == ("decode", set(), set())


def test_kubeconfig_with_token_and_insecure_server(tmp_path: Any) -> None:
    path = tmp_path / "config"
    path.write_text(
        "apiVersion: v1\ncurrent-context: c\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
        "clusters: [{name: k, cluster: {server: 'https://10.1.2.3:6443', insecure-skip-tls-verify: true}}]\n"
        "users: [{name: u, user: {token: abc}}]\n"
    )
    access = kubeconfig_access(str(path))
    assert access.server == "https://10.1.2.3:6443"
    assert access.headers() == {"Authorization": "Bearer abc"}


def _exec_kubeconfig(tmp_path: Path, server: str, expiry: str) -> Path:
    """A kubeconfig whose user is an exec credential plugin: a shell script printing an ExecCredential
    with token exec-<n>, n counting its runs."""
    counter = tmp_path / "runs"
    plugin = tmp_path / "credential-plugin.sh"
    plugin.write_text(
        "#!/bin/sh\n"
        f'n=$(( $(cat "{counter}" 2>/dev/null || echo 0) + 1 ))\n'
        f'echo "$n" > "{counter}"\n'
        'printf \'{"apiVersion":"client.authentication.k8s.io/v1","kind":"ExecCredential",'
        f'"status":{{"token":"exec-%s","expirationTimestamp":"{expiry}"}}}}\' "$n"\n'
    )
    plugin.chmod(0o755)
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "c",
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
        "clusters": [{"name": "k", "cluster": {"server": server}}],
        "users": [
            {
                "name": "u",
                "user": {
                    "exec": {
                        "apiVersion": "client.authentication.k8s.io/v1",
                        "command": str(plugin),
                        "interactiveMode": "Never",
                    }
                },
            }
        ],
    }
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return path


async def test_an_exec_credential_plugins_token_reaches_the_api_server(
    api: tuple[FakeApiServer, str], tmp_path: Path
) -> None:
    server, api_url = api
    server.slices["d1"] = endpoint_slice("d1", [("127.0.0.1", {"ready": True})])
    access = kubeconfig_access(str(_exec_kubeconfig(tmp_path, api_url, "2999-01-01T00:00:00Z")))
    updates: list[tuple[str, set[str], set[str]]] = []
    discovery = KubernetesDiscovery(access, "serving", {"decode": "llama-decode"}, 8000)
    task = asyncio.create_task(discovery.run(lambda pool, ready, term: updates.append((pool, ready, term))))
    try:
        await wait_until(lambda: updates and len(server.authorization) >= 2)  # listed, then watching
        assert updates[-1] == ("decode", {"http://127.0.0.1:8000"}, set())
        # The plugin ran once: its token is still valid, so list and watch both carry it.
        assert server.authorization[:2] == ["Bearer exec-1", "Bearer exec-1"]
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def test_an_expired_exec_credential_is_fetched_again(tmp_path: Path) -> None:
    access = kubeconfig_access(str(_exec_kubeconfig(tmp_path, "http://127.0.0.1:1", "2000-01-01T00:00:00Z")))
    first = access.headers()["Authorization"]
    second = access.headers()["Authorization"]
    assert first.startswith("Bearer exec-") and second.startswith("Bearer exec-")
    assert first != second, "an expired token must be replaced by the plugin's next one"


def test_a_missing_kubeconfig_is_one_line() -> None:
    with pytest.raises(RuntimeError, match="kubeconfig /no/such/kubeconfig") as error:
        kubeconfig_access("/no/such/kubeconfig")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("stored", "header"),
    [
        ("Bearer abc", "Bearer abc"),
        ("bearer abc\n", "Bearer abc"),  # the in-cluster loader's spelling, token file's newline included
        ("abc", "Bearer abc"),
        ("Basic dTpw", "Basic dTpw"),
        ("", None),
        (None, None),
    ],
)
def test_the_clients_stored_key_becomes_one_authorization_header(stored: str | None, header: str | None) -> None:
    assert authorization_header(stored) == header
