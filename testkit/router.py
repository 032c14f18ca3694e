"""The router on a free loopback port, its configuration and metrics, and simulated-worker configs:
what tests/router and the rigs in testkit.rigs start their routers and SimWorkers with."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from splitserve.router.app import Router, RouterServer
from splitserve.router.config import RouterConfig
from splitserve.router.discovery import Discovery
from splitserve.sim import Role, SimConfig, SimWorker

# Simulated engines at 1/100 of real CPU-tiny timing: requests take milliseconds.
TIME_SCALE = 0.01


def sim_config(role: Role | str, **overrides: Any) -> SimConfig:
    overrides.setdefault("time_scale", TIME_SCALE)
    overrides.setdefault("model", "sim-model")
    faults = overrides.pop("faults", None)
    config = SimConfig.from_profile("cpu-tiny", role=Role(role), **overrides)
    return dataclasses.replace(config, faults=faults) if faults is not None else config


def router_config(**overrides: Any) -> RouterConfig:
    base: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "model": "sim-model",
        "health_interval": 0.05,
        "eject_min_seconds": 0.1,
        "queue_timeout": 5.0,
    }
    base.update(overrides)
    return RouterConfig(**base)


@contextlib.asynccontextmanager
async def running_router(config: RouterConfig, discovery: Discovery | None = None) -> AsyncIterator[tuple[Router, str]]:
    """A started router and its base URL, served as `splitserve router` serves it."""
    server = RouterServer(Router(config, discovery=discovery))
    port = await server.start("127.0.0.1", 0)
    try:
        yield server.router, f"http://127.0.0.1:{port}"
    finally:
        await server.close()


def metric_value(router: Router, name: str, labels: dict[str, str] | None = None) -> float:
    value = router.metrics.registry.get_sample_value(name, labels or {})
    return 0.0 if value is None else value


def external_kv_tokens(worker: SimWorker) -> float:
    """Prompt tokens a simulated worker took from transferred KV (not computed itself)."""
    for line in worker.metrics_text().splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total") and 'source="external_kv_transfer"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def served(worker: SimWorker) -> float:
    """Requests a simulated worker finished, from its own vLLM-style metrics."""
    total = 0.0
    for line in worker.metrics_text().splitlines():
        if line.startswith("vllm:request_success_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def wait_until(condition: Callable[[], object], within: float = 5.0) -> None:
    """Poll ``condition`` until it is truthy; fail the test after ``within`` seconds."""
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)
