"""Fixtures for the autoscaling tests: a real Prometheus and tiny static /metrics exporters."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from testkit.prometheus import PrometheusServer, StaticExporter


@pytest.fixture
async def exporters() -> AsyncIterator[list[StaticExporter]]:
    """A list to append started StaticExporters to; all are stopped after the test."""
    started: list[StaticExporter] = []
    yield started
    for exporter in started:
        await exporter.stop()


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[PrometheusServer]:
    """A PrometheusServer (not started: set `targets`, then `await prometheus.start()`); stopped after."""
    server = PrometheusServer(tmp_path / "prometheus")
    yield server
    server.stop()
