"""A stand-in for vLLM's runtime LoRA API, as the adapter sync sees it: /health, /v1/models with adapter
cards (`root`, `parent`), and load/unload answering as vLLM 0.32 does (its messages and error shape).
A path is loadable when it is in `loadable`; the test flips health, loadability and restarts."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

BASE = "base-model"


def _error(message: str, kind: str, status: int) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(body, status=status)


@dataclass
class FakeLoraEngine:
    loadable: set[str] = field(default_factory=set)
    healthy: bool = True
    loras: dict[str, str] = field(default_factory=dict)  # name -> path
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    url: str = ""

    def restart(self) -> None:
        """As a restarted engine: every runtime-loaded adapter gone."""
        self.loras.clear()

    def calls_to(self, endpoint: str) -> list[dict[str, Any]]:
        return [body for path, body in self.calls if path == endpoint]

    async def health(self, _request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def models(self, _request: web.Request) -> web.Response:
        if not self.healthy:
            return web.Response(status=503)
        cards: list[dict[str, Any]] = [{"id": BASE, "object": "model", "root": "/models/base", "parent": None}]
        cards += [{"id": name, "object": "model", "root": path, "parent": BASE} for name, path in self.loras.items()]
        return web.json_response({"object": "list", "data": cards})

    async def load(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append(("load", body))
        name, path = body["lora_name"], body["lora_path"]
        if name == BASE:
            return _error(f"The lora adapter '{name}' conflicts with a served base model.", "InvalidUserInput", 400)
        if name in self.loras and not body.get("load_inplace"):
            return _error(f"The lora adapter '{name}' has already been loaded.", "InvalidUserInput", 400)
        if path not in self.loadable:
            return _error(f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError", 404)
        self.loras[name] = path
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append(("unload", body))
        name = body["lora_name"]
        if name not in self.loras:
            return _error(f"The lora adapter '{name}' cannot be found.", "NotFoundError", 404)
        del self.loras[name]
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


@contextlib.asynccontextmanager
async def running_fake_engine(engine: FakeLoraEngine | None = None) -> AsyncIterator[FakeLoraEngine]:
    engine = engine or FakeLoraEngine()
    app = web.Application()
    app.router.add_get("/health", engine.health)
    app.router.add_get("/v1/models", engine.models)
    app.router.add_post("/v1/load_lora_adapter", engine.load)
    app.router.add_post("/v1/unload_lora_adapter", engine.unload)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    engine.url = f"http://127.0.0.1:{port}"
    try:
        yield engine
    finally:
        await runner.cleanup()
