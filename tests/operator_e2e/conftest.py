"""Fixtures: the real kopf operator (`splitserve operator`) as a subprocess against the API emulator.

The harness itself (`operator_on_emulator`, `OperatorProcess`, `install_crd`, `eventually`, `NAMESPACE`) is
testkit.operator."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from testkit.emulator.client import EmulatorClient
from testkit.emulator.fixtures import EmulatorProcess
from testkit.operator import OperatorProcess, operator_on_emulator


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmulatorProcess, OperatorProcess]]:
    workdir = tmp_path_factory.mktemp("cluster")
    # A state file makes a killed emulator come back with its objects, like an API server over etcd.
    with operator_on_emulator(workdir, state_file=workdir / "state.json") as cluster:
        yield cluster


@pytest.fixture
def client(cluster: tuple[EmulatorProcess, OperatorProcess]) -> Iterator[EmulatorClient]:
    with cluster[0].client() as api:
        yield api
