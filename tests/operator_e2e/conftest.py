"""The real kopf operator (`splitserve operator`) as a subprocess against the API emulator."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from splitserve.api.crd import render_crd_yaml
from tests.emulator.client import EmulatorClient
from tests.emulator.fixtures import EmulatorProcess

NAMESPACE = "serving"


class OperatorProcess:
    def __init__(self, emulator: EmulatorProcess, workdir: Path) -> None:
        self.emulator = emulator
        self.log_path = workdir / "operator.log"
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "splitserve", "operator", "--standalone", "--namespace", NAMESPACE],
                # A fast diagnosis timer so status.diagnosis shows up within the test's patience.
                env={**self.emulator.env(), "SPLITSERVE_DIAGNOSIS_INTERVAL_SECONDS": "3"},
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def install_crd(client: EmulatorClient) -> None:
    client.apply(yaml.safe_load(render_crd_yaml()), field_manager="test", force=True)
    client.create_namespace(NAMESPACE)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmulatorProcess, OperatorProcess]]:
    workdir = tmp_path_factory.mktemp("cluster")
    # A state file makes a killed emulator come back with its objects, like an API server over etcd.
    emulator = EmulatorProcess(workdir, state_file=workdir / "state.json")
    emulator.start()
    with emulator.client() as client:
        install_crd(client)
    operator = OperatorProcess(emulator, workdir)
    operator.start()
    try:
        yield emulator, operator
    finally:
        operator.stop()
        emulator.kill()
        sys.stderr.write(operator.log()[-4000:])


@pytest.fixture
def client(cluster: tuple[EmulatorProcess, OperatorProcess]) -> Iterator[EmulatorClient]:
    with cluster[0].client() as api:
        yield api
