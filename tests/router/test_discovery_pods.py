"""Pod discovery against the Kubernetes API emulator: worker Pods created, made ready, deleted (with
a finalizer holding them terminating) and gone, each with its role and KV generation."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import Any

from splitserve.kubeconfig import KubeAccess
from splitserve.router.discovery_pods import PodDiscovery
from testkit.emulator.client import AsyncEmulatorClient
from testkit.emulator.server import running_emulator
from tests.router.conftest import wait_until

NAMESPACE = "serving"
A, B = "aaaaaaaaaa", "bbbbbbbbbb"
Snapshot = tuple[set[str], set[str], dict[str, str]]


def worker_pod(name: str, role: str, generation: str, deployment: str = "llama") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": {
                "splitserve.io/deployment": deployment,
                "splitserve.io/role": role,
                "splitserve.io/generation": generation,
            },
            # Holds the Pod in the API after its delete, terminating, as a kubelet does while it drains.
            "finalizers": ["test.splitserve.io/hold"],
        },
        "spec": {"containers": [{"name": "worker", "image": "vllm"}]},
    }


async def make_ready(api: AsyncEmulatorClient, name: str, ip: str) -> None:
    status = {"status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}}
    await api.patch("v1", "pods", name, status, namespace=NAMESPACE, subresource="status")


async def test_pod_discovery_follows_roles_states_and_generations() -> None:
    latest: dict[str, Snapshot] = {}

    def on_update(
        pool: str, ready: set[str], terminating: set[str], generations: Mapping[str, str] | None = None
    ) -> None:
        latest[pool] = (ready, terminating, dict(generations or {}))

    async with running_emulator(fake_controllers=False) as emulator, AsyncEmulatorClient(emulator.url) as api:
        await api.create("v1", "namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        discovery = PodDiscovery(KubeAccess(emulator.url, False, token="t"), NAMESPACE, "llama", 8000)
        assert discovery.selector == "splitserve.io/deployment=llama"
        task = asyncio.create_task(discovery.run(on_update))
        try:
            await wait_until(lambda: latest == {"prefill": (set(), set(), {}), "decode": (set(), set(), {})})
            for pod in (
                worker_pod("p1", "prefill", A),
                worker_pod("d1", "decode", A),
                worker_pod("d2", "aggregated", B),
                worker_pod("r1", "router", A),
                worker_pod("other", "decode", A, deployment="mistral"),
            ):
                await api.create("v1", "pods", pod, namespace=NAMESPACE)
            await asyncio.sleep(0.1)
            assert latest["decode"] == (set(), set(), {})  # created, not ready: no IP, no Ready condition
            for name, ip in (("p1", "10.0.0.1"), ("d1", "10.0.1.1"), ("d2", "10.0.1.2"), ("r1", "10.0.2.1")):
                await make_ready(api, name, ip)
            await make_ready(api, "other", "10.0.3.1")
            await wait_until(lambda: len(latest["decode"][0]) == 2)
            assert latest["prefill"] == ({"http://10.0.0.1:8000"}, set(), {"http://10.0.0.1:8000": A})
            assert latest["decode"] == (
                {"http://10.0.1.1:8000", "http://10.0.1.2:8000"},
                set(),
                {"http://10.0.1.1:8000": A, "http://10.0.1.2:8000": B},
            )
            await api.delete("v1", "pods", "d1", namespace=NAMESPACE)  # finalizer: terminating
            await wait_until(lambda: latest["decode"][1] == {"http://10.0.1.1:8000"})
            decode: Snapshot = latest["decode"]
            assert decode[0] == {"http://10.0.1.2:8000"} and decode[2]["http://10.0.1.1:8000"] == A
            await api.patch("v1", "pods", "d1", {"metadata": {"finalizers": None}}, namespace=NAMESPACE)
            await wait_until(lambda: latest["decode"] == ({"http://10.0.1.2:8000"}, set(), {"http://10.0.1.2:8000": B}))
            await api.patch(
                "v1", "pods", "p1", {"status": {"conditions": [{"type": "Ready", "status": "False"}]}},
                namespace=NAMESPACE, subresource="status",
            )  # fmt: skip
            await wait_until(lambda: latest["prefill"] == (set(), set(), {}))
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
