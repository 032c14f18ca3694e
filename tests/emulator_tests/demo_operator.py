"""A minimal kopf operator for the emulator tests: a Widget owns a ConfigMap mirroring its spec.size.

Run: `kopf run --standalone --all-namespaces tests/emulator_tests/demo_operator.py` with KUBECONFIG set.
"""

from __future__ import annotations

from typing import Any

import kopf
import kubernetes

GROUP, VERSION, PLURAL = "demo.emulator.io", "v1", "widgets"


def _core() -> Any:
    # Built per call: the kubeconfig (and port) may change between operator runs in one process.
    config: Any = kubernetes.config
    config.load_kube_config()
    return kubernetes.client.CoreV1Api()


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.watching.server_timeout = 5
    settings.watching.client_timeout = 10
    settings.watching.connect_timeout = 2
    settings.networking.request_timeout = 5
    settings.persistence.finalizer = "demo.emulator.io/finalizer"


@kopf.on.create(GROUP, VERSION, PLURAL)
def create_child(body: kopf.Body, spec: kopf.Spec, name: str, namespace: str | None, **_: Any) -> dict[str, str]:
    child: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{name}-child"},
        "data": {"size": str(spec.get("size", 0))},
    }
    kopf.adopt(child, owner=body)
    _core().create_namespaced_config_map(namespace, child)
    return {"child": child["metadata"]["name"]}


@kopf.on.update(GROUP, VERSION, PLURAL, field="spec.size")
def update_child(spec: kopf.Spec, name: str, namespace: str | None, **_: Any) -> None:
    _core().patch_namespaced_config_map(f"{name}-child", namespace, {"data": {"size": str(spec.get("size", 0))}})
