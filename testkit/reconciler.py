"""The real Reconciler against an in-process API emulator, for tests that drive it (or a loop) without kopf.

Such a test fills the Reconciler's cache itself before each step (testkit.cache.fill_cache).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import yaml

from splitserve.api.crd import render_crd_yaml
from splitserve.controller.reconcile import Reconciler
from splitserve.io.kube import KubeClient
from splitserve.kubeconfig import KubeAccess
from testkit.emulator.client import AsyncEmulatorClient
from testkit.emulator.server import running_emulator


@dataclass
class ReconcilerOnEmulator:
    api: AsyncEmulatorClient
    reconciler: Reconciler
    events: list[tuple[str, str, str]]  # (kind, reason, message) of every Event the Reconciler posted


@contextlib.asynccontextmanager
async def reconciler_on_emulator(namespace: str) -> AsyncIterator[ReconcilerOnEmulator]:
    """An emulator (its fake controllers on) holding the CRD and `namespace`, a client of it, and a
    Reconciler on it whose Events are recorded; its Kubernetes client is closed on the way out."""
    async with running_emulator() as emulator, AsyncEmulatorClient(emulator.url) as api:
        await api.create("apiextensions.k8s.io/v1", "customresourcedefinitions", yaml.safe_load(render_crd_yaml()))
        await api.create("v1", "namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
        events: list[tuple[str, str, str]] = []
        kube = KubeClient(KubeAccess(emulator.url, False))
        reconciler = Reconciler(kube, lambda _body, kind, reason, message: events.append((kind, reason, message)))
        try:
            yield ReconcilerOnEmulator(api, reconciler, events)
        finally:
            await kube.aclose()
