"""The emulator as a kmock handler: kmock's DSL reactions (fault injection) first, then the emulated API."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import traceback
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import aiohttp.web
import attrs
import kmock
from typing_extensions import override

from testkit.emulator.api import KubernetesApi
from testkit.emulator.controllers import run_fake_controllers
from testkit.emulator.handlers import HttpFrontend
from testkit.emulator.resources import BUILTIN_RESOURCES, ResourceRegistry, omit_resources
from testkit.emulator.store import ObjectStore


@attrs.define(kw_only=True)
class EmulatorHandler(kmock.RawHandler):
    """A kmock handler serving a stateful Kubernetes API.

    Reactions added with kmock's DSL take precedence, so tests can inject faults into an otherwise
    working API, e.g. ``handler['get /api/v1/namespaces/ns/pods'][:2] << 500``.
    """

    frontend: HttpFrontend

    @override
    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        # kmock's own request parsing breaks on some valid paths (e.g. POST /api/v1/namespaces);
        # fall back to a plain HTTP-level request: the emulator routes by path itself.
        body = await raw_request.read()
        try:
            request = await kmock.Request._parse(raw_request, id=len(self._requests))
        except ValueError:
            request = kmock.Request(
                id=len(self._requests),
                raw_request=raw_request,
                url=raw_request.url,
                method=raw_request.method,
                params=dict(raw_request.query),
                headers=dict(raw_request.headers),
                body=body,
            )
        self._requests.append(request)
        try:
            return await self._handle(request)
        except Exception as e:
            if self._errors:
                self._errors[-1].append(e)
            return aiohttp.web.Response(text=traceback.format_exc(), status=500)

    @override
    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if self._payloads:
            with contextlib.suppress(NotImplementedError):
                return await super()._handle(request)
        raw_request = request._raw_request
        assert raw_request is not None
        return await self.frontend.serve(raw_request, request.body)


@dataclasses.dataclass
class Emulator:
    api: KubernetesApi
    frontend: HttpFrontend
    handler: EmulatorHandler
    url: str


def build_api(state_file: Path | None = None, omitted_resources: Sequence[str] = ()) -> KubernetesApi:
    store = ObjectStore(state_file=state_file)
    store.load()
    return KubernetesApi(store, ResourceRegistry(omit_resources(BUILTIN_RESOURCES, omitted_resources)))


@contextlib.asynccontextmanager
async def running_emulator(
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    state_file: Path | None = None,
    fake_controllers: bool = True,
    omitted_resources: Sequence[str] = (),
) -> AsyncIterator[Emulator]:
    """Serve the emulator on host:port (0: any free port) for the duration of the context."""
    api = build_api(state_file, omitted_resources)
    frontend = HttpFrontend(api, server_address=f"{host}:{port}")
    handler = EmulatorHandler(frontend=frontend)
    async with handler, kmock.Server(handler, host=host, port=port or None) as server:
        frontend.server_address = f"{server.host}:{server.port}"
        controllers = asyncio.create_task(run_fake_controllers(api)) if fake_controllers else None
        try:
            yield Emulator(api=api, frontend=frontend, handler=handler, url=f"http://{server.host}:{server.port}")
        finally:
            if controllers is not None:
                controllers.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await controllers
