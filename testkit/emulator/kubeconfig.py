"""A kubeconfig pointing kubectl, kopf and the kubernetes client at the emulator (plain http, dummy token)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

DUMMY_TOKEN = "emulator-token"


def kubeconfig_dict(url: str, *, namespace: str = "default") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "emulator", "cluster": {"server": url}}],
        "users": [{"name": "emulator", "user": {"token": DUMMY_TOKEN}}],
        "contexts": [
            {"name": "emulator", "context": {"cluster": "emulator", "user": "emulator", "namespace": namespace}}
        ],
        "current-context": "emulator",
        "preferences": {},
    }


def write_kubeconfig(path: Path, url: str, *, namespace: str = "default") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(kubeconfig_dict(url, namespace=namespace), sort_keys=False))
    return path
