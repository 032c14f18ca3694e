"""Helpers shared by the simulator tests (a uniquely named module, importable from test files)."""

from __future__ import annotations

from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from splitserve.sim import Role, SimConfig

PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def fast_config(role: Role = Role.AGGREGATED, time_scale: float = 0.05, **overrides: Any) -> SimConfig:
    """cpu-tiny at a twentieth of its latency, so a 24-token answer takes ~10 ms."""
    return SimConfig.from_profile("cpu-tiny", role=role, time_scale=time_scale, **overrides)


async def post(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with session.post(url, json=body) as reply:
        answer: Any = await reply.json(content_type=None)
        return reply.status, answer


def sample(metrics_text: str, name: str, **labels: str) -> float:
    """Value of the one sample called ``name`` whose labels include ``labels``."""
    found = [
        s.value
        for family in text_string_to_metric_families(metrics_text)
        for s in family.samples
        if s.name == name and labels.items() <= s.labels.items()
    ]
    assert len(found) == 1, f"{name}{labels}: {found}"
    return float(found[0])


def plain_values(metrics_text: str) -> dict[str, float]:
    """Sample name -> value for samples with only the default labels (one parse for many reads)."""
    return {
        s.name: float(s.value)
        for family in text_string_to_metric_families(metrics_text)
        for s in family.samples
        if set(s.labels) == {"model_name", "engine"}
    }
