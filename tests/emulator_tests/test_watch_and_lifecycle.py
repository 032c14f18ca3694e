"""Watches (selectors, bookmarks, timeouts, tables), restarts on the same port, in-process fault injection."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from testkit.emulator.client import EmulatorClient
from testkit.emulator.fixtures import EmulatorProcess
from testkit.emulator.server import running_emulator
from tests.emulator_tests.test_api import configmap


def _watch(client: EmulatorClient, path: str, **params: str) -> list[dict[str, Any]]:
    with client.http.stream("GET", path, params={"watch": "true", **params}) as response:
        return [json.loads(line) for line in response.iter_lines() if line]


def test_watch_with_selector_reports_objects_entering_and_leaving(
    shared_client: EmulatorClient, fresh_namespace: str
) -> None:
    start = shared_client.create(configmap("a", fresh_namespace))
    shared_client.patch("v1", "configmaps", "a", {"metadata": {"labels": {"pick": "me"}}}, namespace=fresh_namespace)
    shared_client.patch("v1", "configmaps", "a", {"data": {"x": "1"}}, namespace=fresh_namespace)
    shared_client.patch("v1", "configmaps", "a", {"metadata": {"labels": {"pick": None}}}, namespace=fresh_namespace)
    events = _watch(
        shared_client,
        f"/api/v1/namespaces/{fresh_namespace}/configmaps",
        labelSelector="pick=me",
        resourceVersion=start["metadata"]["resourceVersion"],
        timeoutSeconds="1",
    )
    assert [event["type"] for event in events] == ["ADDED", "MODIFIED", "DELETED"]


def test_watch_without_resource_version_lists_first_and_times_out(
    shared_client: EmulatorClient, fresh_namespace: str
) -> None:
    shared_client.create(configmap("a", fresh_namespace))
    started = time.monotonic()
    events = _watch(
        shared_client,
        f"/api/v1/namespaces/{fresh_namespace}/configmaps",
        timeoutSeconds="1",
        allowWatchBookmarks="true",
    )
    assert 0.9 <= time.monotonic() - started < 30  # honours timeoutSeconds; upper bound loose for loaded CI
    assert [event["type"] for event in events] == ["ADDED", "BOOKMARK"]
    assert int(events[-1]["object"]["metadata"]["resourceVersion"]) > 0


def test_watch_sees_live_events(shared_client: EmulatorClient, fresh_namespace: str) -> None:
    def later() -> None:
        time.sleep(0.3)
        with EmulatorClient(shared_client.base_url) as other:
            other.create(configmap("live", fresh_namespace))

    since = str(shared_client.request("GET", "/emulator/health")["resourceVersion"])
    writer = threading.Thread(target=later)
    writer.start()
    with shared_client.http.stream(
        "GET",
        f"/api/v1/namespaces/{fresh_namespace}/configmaps",
        params={"watch": "true", "resourceVersion": since, "timeoutSeconds": "30"},
    ) as response:
        first_line = next(line for line in response.iter_lines() if line)  # arrives while the watch is open
    writer.join()
    event = json.loads(first_line)
    assert (event["type"], event["object"]["metadata"]["name"]) == ("ADDED", "live")


def test_watch_initial_events_end_with_a_bookmark(shared_client: EmulatorClient, fresh_namespace: str) -> None:
    shared_client.create(configmap("a", fresh_namespace))
    events = _watch(
        shared_client,
        f"/api/v1/namespaces/{fresh_namespace}/configmaps",
        timeoutSeconds="1",
        sendInitialEvents="true",
        allowWatchBookmarks="true",
        resourceVersionMatch="NotOlderThan",
    )
    assert events[0]["type"] == "ADDED"
    assert events[1]["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}


def test_table_watch_for_kubectl(shared_client: EmulatorClient, fresh_namespace: str) -> None:
    shared_client.create(configmap("a", fresh_namespace))
    with shared_client.http.stream(
        "GET",
        f"/api/v1/namespaces/{fresh_namespace}/configmaps",
        params={"watch": "true", "timeoutSeconds": "1"},
        headers={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"},
    ) as response:
        events = [json.loads(line) for line in response.iter_lines() if line]
    assert events[0]["object"]["kind"] == "Table"
    assert events[0]["object"]["rows"][0]["cells"][0] == "a"


@pytest.mark.slow
def test_restart_on_same_port_loses_state_without_a_state_file(tmp_path: Path) -> None:
    process = EmulatorProcess(tmp_path)
    process.start()
    try:
        with process.client() as client:
            client.create(configmap("a", "default"))
        port = process.port
        process.restart()
        assert process.port == port
        with process.client() as client:
            assert client.get_or_none("v1", "configmaps", "a", namespace="default") is None
            assert client.get_or_none("v1", "namespaces", "default") is not None
    finally:
        process.kill()


@pytest.mark.slow
def test_restart_with_state_file_keeps_objects_and_resource_versions(tmp_path: Path) -> None:
    process = EmulatorProcess(tmp_path, state_file=tmp_path / "state.json", fake_controllers=False)
    process.start()
    try:
        with process.client() as client:
            created = client.create(configmap("a", "default"))
        process.restart()
        with process.client() as client:
            kept = client.get("v1", "configmaps", "a", namespace="default")
            assert kept["metadata"]["uid"] == created["metadata"]["uid"]
            newer = client.create(configmap("b", "default"))
            assert int(newer["metadata"]["resourceVersion"]) > int(created["metadata"]["resourceVersion"])
    finally:
        process.kill()


async def test_in_process_emulator_with_injected_faults() -> None:
    async with running_emulator(fake_controllers=False) as emulator:
        path = "/api/v1/namespaces/default/configmaps"
        # kmock's DSL answers first: the first two lists fail, then the emulated API takes over.
        emulator.handler[f"get {path}"][:2] << 503
        async with httpx.AsyncClient(base_url=emulator.url) as client:
            codes = [(await client.get(path)).status_code for _ in range(3)]
            assert codes == [503, 503, 200]
            created = await client.post(path, json={"metadata": {"name": "a"}})
            assert created.status_code == 201
            # An injected failure is the whole answer: the object is not stored behind the error.
            # (No slice here: kmock's slices count matching requests since the start, incl. the POST above.)
            emulator.handler[f"post {path}"] << 500
            assert (await client.post(path, json={"metadata": {"name": "b"}})).status_code == 500
            assert (await client.get(f"{path}/b")).status_code == 404
        assert emulator.api.get(emulator.api.registry.find("", "v1", "configmaps"), "default", "a")  # type: ignore[arg-type]
