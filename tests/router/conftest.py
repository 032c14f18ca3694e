"""Helpers for router tests: fault configs. Polling (`wait_until`, re-exported here), the router on a
free loopback port and the simulated workers' configs (`running_router`, `router_config`, `sim_config`,
`metric_value`, `TIME_SCALE`) are testkit.router, shared with the end-to-end rigs and benchmarks."""

from __future__ import annotations

from typing import Any

from splitserve.sim import FaultConfig
from testkit.router import wait_until

__all__ = ["fault", "wait_until"]


def fault(**kwargs: Any) -> FaultConfig:
    return FaultConfig(**kwargs)
