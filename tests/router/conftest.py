"""Helpers for router tests: fault configs and polling. The router on a free loopback port and the
simulated workers' configs (`running_router`, `router_config`, `sim_config`, `metric_value`,
`TIME_SCALE`) are testkit.router, shared with the end-to-end rigs and benchmarks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from splitserve.sim import FaultConfig


def fault(**kwargs: Any) -> FaultConfig:
    return FaultConfig(**kwargs)


async def wait_until(condition: Callable[[], object], within: float = 5.0) -> None:
    """Poll ``condition`` until it is truthy; fail the test after ``within`` seconds."""
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)
