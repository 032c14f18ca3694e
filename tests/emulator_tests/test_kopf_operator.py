"""A real kopf operator (subprocess `kopf run`) against the emulator, including an emulator SIGKILL/restart."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testkit.emulator import rbac
from testkit.emulator.client import EmulatorClient, wait_for
from testkit.emulator.fixtures import EmulatorProcess
from tests.emulator_tests.test_api import widget_crd

pytestmark = [pytest.mark.slow, pytest.mark.emulator]

OPERATOR = Path(__file__).with_name("demo_operator.py")
WIDGETS = ("demo.emulator.io/v1", "widgets")


@pytest.fixture
def persistent_emulator(tmp_path: Path) -> Iterator[EmulatorProcess]:
    process = EmulatorProcess(tmp_path, state_file=tmp_path / "state.json")
    process.start()
    try:
        yield process
    finally:
        process.kill()


def _run_operator(emulator: EmulatorProcess, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    with emulator.client() as client:
        client.create(widget_crd())
    log = (tmp_path / "operator.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "kopf", "run", "--standalone", "--all-namespaces", "--verbose", str(OPERATOR)],
        env=emulator.env(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield process
    finally:
        process.kill()
        process.wait(timeout=10)
        log.close()


@pytest.fixture
def operator(persistent_emulator: EmulatorProcess, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    yield from _run_operator(persistent_emulator, tmp_path)


@pytest.fixture
def forgetful_emulator(tmp_path: Path) -> Iterator[EmulatorProcess]:
    process = EmulatorProcess(tmp_path)
    process.start()
    try:
        yield process
    finally:
        process.kill()


@pytest.fixture
def operator_on_forgetful(forgetful_emulator: EmulatorProcess, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    yield from _run_operator(forgetful_emulator, tmp_path)


def _widget(name: str, size: int) -> dict[str, Any]:
    return {
        "apiVersion": WIDGETS[0],
        "kind": "Widget",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"size": size},
    }


def _child_size(client: EmulatorClient, name: str) -> str | None:
    child = client.get_or_none("v1", "configmaps", f"{name}-child", namespace="default")
    return None if child is None else str(child["data"]["size"])


def test_operator_creates_updates_and_survives_an_emulator_restart(
    persistent_emulator: EmulatorProcess, operator: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    with persistent_emulator.client() as client:
        widget = client.create(_widget("w1", 1))
        wait_for(lambda: _child_size(client, "w1") == "1", timeout=30, message="the child ConfigMap")
        child = client.get("v1", "configmaps", "w1-child", namespace="default")
        assert child["metadata"]["ownerReferences"][0]["uid"] == widget["metadata"]["uid"]

        client.patch(*WIDGETS, "w1", {"spec": {"size": 2}}, namespace="default")
        wait_for(lambda: _child_size(client, "w1") == "2", timeout=30, message="the update")

        used = rbac.used_permissions(client.requests_log(), user_agent_prefix="kopf")
        assert {("watch", "widgets"), ("patch", "widgets")} <= {(p.verb, p.resource) for p in used}
        # The child ConfigMap is created by the kubernetes client inside the handler, not by kopf.
        python_client = rbac.used_permissions(client.requests_log(), user_agent_prefix="OpenAPI-Generator")
        assert rbac.Permission("", "configmaps", "create") in python_client

    persistent_emulator.restart()  # SIGKILL; objects come back from the state file
    with persistent_emulator.client() as client:
        client.patch(*WIDGETS, "w1", {"spec": {"size": 3}}, namespace="default")
        wait_for(lambda: _child_size(client, "w1") == "3", timeout=60, message="an update after the restart")
        client.create(_widget("w2", 5))
        wait_for(lambda: _child_size(client, "w2") == "5", timeout=30, message="a create after the restart")

        # Deleting the owner garbage-collects the child once kopf releases its finalizer.
        client.delete(*WIDGETS, "w1", namespace="default")
        wait_for(
            lambda: client.get_or_none("v1", "configmaps", "w1-child", namespace="default") is None,
            timeout=30,
            message="garbage collection of the child",
        )
    assert operator.poll() is None, (tmp_path / "operator.log").read_text()[-3000:]


def test_operator_recovers_when_a_restart_loses_all_state(
    forgetful_emulator: EmulatorProcess, operator_on_forgetful: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    with forgetful_emulator.client() as client:
        client.create(_widget("before", 1))
        wait_for(lambda: _child_size(client, "before") == "1", timeout=30, message="the first child")

    forgetful_emulator.restart()  # SIGKILL; a fresh, empty API on the same port
    with forgetful_emulator.client() as client:
        assert client.get_or_none(*WIDGETS, "before", namespace="default") is None
        client.create(widget_crd())
        client.create(_widget("after", 4))
        wait_for(lambda: _child_size(client, "after") == "4", timeout=60, message="a child after the reset")
    assert operator_on_forgetful.poll() is None, (tmp_path / "operator.log").read_text()[-3000:]
