"""The adapter sync's pod condition, against the Kubernetes API emulator: set on the worker's own Pod
beside the kubelet's conditions, retried after a failed patch, and off without the downward-API env."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from splitserve.engine import pod_condition
from splitserve.engine.adapter_plan import AdaptersState
from splitserve.engine.adapters import run_adapter_sync
from splitserve.engine.pod_condition import PodConditionReporter
from splitserve.kubeconfig import KubeAccess
from testkit.emulator.client import AsyncEmulatorClient
from testkit.emulator.server import running_emulator
from tests.engine.fake_lora_engine import FakeLoraEngine, running_fake_engine

NAMESPACE = "serving"
TYPE = "splitserve.io/AdaptersReady"


async def make_worker_pod(api: AsyncEmulatorClient, name: str) -> None:
    await api.create("v1", "namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {"containers": [{"name": "w"}]}}
    await api.create("v1", "pods", pod, namespace=NAMESPACE)
    ready = {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}  # the kubelet's
    await api.patch("v1", "pods", name, ready, namespace=NAMESPACE, subresource="status")


def conditions(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in pod.get("status", {}).get("conditions", [])}


async def wait_for_condition(api: AsyncEmulatorClient, pod: str, reason: str) -> dict[str, Any]:
    """The Pod's AdaptersReady condition once it has `reason` (within 5 s)."""
    for _ in range(250):
        found = conditions(await api.get("v1", "pods", pod, namespace=NAMESPACE)).get(TYPE)
        if found is not None and found["reason"] == reason:
            return found
        await asyncio.sleep(0.02)
    raise AssertionError(f"no {TYPE} condition with reason {reason} on {pod}: {found}")


async def test_the_condition_follows_the_state_and_survives_a_failed_patch() -> None:
    async with running_emulator(fake_controllers=False) as emulator, AsyncEmulatorClient(emulator.url) as api:
        await make_worker_pod(api, "w1")
        path = f"/api/v1/namespaces/{NAMESPACE}/pods/w1/status"
        emulator.handler[f"patch {path}"][1:2] << 500  # the reporter's first patch (the 0th was the kubelet's)
        reporter = PodConditionReporter(KubeAccess(emulator.url, False, token="t"), NAMESPACE, "w1", retry_s=0.1)
        stop = asyncio.Event()
        task = asyncio.create_task(reporter.run(stop))

        try:
            reporter.update(AdaptersState(loaded=("a",), pending=("b",)))
            loading = await wait_for_condition(api, "w1", "AdaptersLoading")  # after a failed patch
            assert (loading["status"], loading["message"]) == ("False", "loading b")

            failed = AdaptersState(loaded=("a",), failed={"b": "Loading lora b failed: No adapter found for /b"})
            reporter.update(failed)
            reporter.update(failed)
            found = await wait_for_condition(api, "w1", "AdapterLoadFailed")
            assert (found["status"], found["message"]) == ("False", "b: Loading lora b failed: No adapter found for /b")
            assert found["lastTransitionTime"] == loading["lastTransitionTime"]  # still False: no transition

            reporter.update(AdaptersState(loaded=("a", "b")))
            found = await wait_for_condition(api, "w1", "AdaptersLoaded")
            assert (found["status"], found["message"]) == ("True", "loaded a, b")
            pod = await api.get("v1", "pods", "w1", namespace=NAMESPACE)
            assert conditions(pod)["Ready"]["status"] == "True"  # the kubelet's condition untouched
        finally:
            stop.set()
            await asyncio.wait_for(task, 5)
        patches = list(emulator.handler[f"patch {path}"])
        assert {r.headers.get("Content-Type") for r in patches[1:]} == {"application/strategic-merge-patch+json"}
        assert {r.headers.get("Authorization") for r in patches[1:]} == {"Bearer t"}
        assert len(patches) == 5  # the kubelet's, the failed one, and one per new condition


def test_off_without_the_downward_api_env() -> None:
    assert PodConditionReporter.from_environ({}) is None
    assert PodConditionReporter.from_environ({"POD_NAME": "w1"}) is None


async def test_run_adapter_sync_reports_on_its_own_pod(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    adapters = tmp_path / "adapters.json"
    adapters.write_text(json.dumps({"adapters": [{"name": "a", "path": "/adapters/a"}]}))
    async with (
        running_emulator(fake_controllers=False) as emulator,
        AsyncEmulatorClient(emulator.url) as api,
        running_fake_engine(FakeLoraEngine(loadable={"/adapters/a"})) as engine,
    ):
        await make_worker_pod(api, "w2")
        monkeypatch.setattr(pod_condition, "load_access", lambda: KubeAccess(emulator.url, False, token="t"))
        seen: list[AdaptersState] = []
        stop = asyncio.Event()
        environ = {"POD_NAME": "w2", "POD_NAMESPACE": NAMESPACE}
        task = asyncio.create_task(
            run_adapter_sync(engine.url, adapters, stop_event=stop, on_change=seen.append, environ=environ)
        )
        try:
            found = await wait_for_condition(api, "w2", "AdaptersLoaded")
            assert (found["status"], found["message"]) == ("True", "loaded a")
            assert seen[-1] == AdaptersState(loaded=("a",))
        finally:
            stop.set()
            await asyncio.wait_for(task, 5)
