"""Fixtures for the local-stack tests: stand-in workers and process/port checks."""

from __future__ import annotations

import io
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from splitserve.local.plan import ProcessSpec
from splitserve.local.ports import PortAllocator
from splitserve.local.supervisor import Progress, Supervisor

STAND_IN = Path(__file__).with_name("stand_in.py")


@pytest.fixture
def stand_in() -> Callable[..., ProcessSpec]:
    ports = PortAllocator()

    def make(name: str, *flags: str, ready_path: str = "/health") -> ProcessSpec:
        port = ports.allocate()
        argv = (sys.executable, str(STAND_IN), "--port", str(port), *flags)
        return ProcessSpec(name=name, argv=argv, port=port, ready_path=ready_path)

    return make


@pytest.fixture
def progress_output() -> io.StringIO:
    return io.StringIO()


@pytest.fixture
def supervisor(tmp_path: Path, progress_output: io.StringIO) -> Iterator[Supervisor]:
    """A supervisor whose children are always stopped, even when a test fails half-way."""
    supervisor = Supervisor(tmp_path, Progress(progress_output), stop_grace_seconds=5.0)
    yield supervisor
    supervisor.stop_all()
