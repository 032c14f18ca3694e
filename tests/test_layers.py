"""The import-linter contracts in pyproject.toml hold on the tree, and each one breaks when a wrong-way
import is put back into a copy of it (so a contract that checks nothing would fail here)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
CONFIG: dict[str, Any] = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
CONTRACTS = {contract["id"]: contract for contract in CONFIG["contracts"]}


def lint(cwd: Path, config: Path | None = None) -> subprocess.CompletedProcess[str]:
    command = [str(LINT_IMPORTS), "--no-cache"] + (["--config", str(config)] if config else [])
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_the_tree_keeps_every_contract() -> None:
    result = lint(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"Contracts: {len(CONTRACTS)} kept, 0 broken." in result.stdout


def _copy_of_the_package(root: Path) -> Path:
    """splitserve as installed: operator/splitserve with the five workers/ packages inside it."""
    package = root / "splitserve"
    shutil.copytree(REPO / "operator" / "splitserve", package, ignore=shutil.ignore_patterns("__pycache__"))
    for sub in ("router", "sim", "engine", "local", "gateway"):
        shutil.copytree(REPO / "workers" / sub, package / sub, ignore=shutil.ignore_patterns("__pycache__"))
    return package


def _config_for(root: Path, contract_id: str, root_packages: list[str]) -> Path:
    contract = CONTRACTS[contract_id]
    lines = ["[tool.importlinter]", f"root_packages = {root_packages!r}", "include_external_packages = true", ""]
    lines.append("[[tool.importlinter.contracts]]")
    for key, value in contract.items():
        lines.append(f"{key} = {value!r}" if not isinstance(value, str) else f'{key} = "{value}"')
    config = root / "importlinter.toml"
    config.write_text("\n".join(lines).replace("'", '"') + "\n")
    return config


# (contract, module in the copy, import put back, the line the broken contract must report)
WRONG_WAY = [
    # The cycle a review found: the autoscaler's decision reached into the builders for `role_pool`.
    (
        "layers",
        "autoscaling/decision.py",
        "from splitserve.builders.vllm_args import build_engine_launch",
        "splitserve.autoscaling is not allowed to import splitserve.builders",
    ),
    # A pure builder reaching the Prometheus client (and so httpx), as bundle -> keda -> signals did.
    (
        "pure",
        "builders/monitoring.py",
        "from splitserve.io.prometheus import PrometheusClient",
        "splitserve.builders is not allowed to import splitserve.io",
    ),
    ("pure", "diagnosis/questions.py", "import httpx", "splitserve.diagnosis is not allowed to import httpx"),
    # The rollout plan must stay a function of the cache: reading the cluster itself belongs to reconcile.py.
    (
        "pure",
        "controller/rollout.py",
        "from splitserve.io.kube import KubeClient",
        "splitserve.controller.rollout is not allowed to import splitserve.io",
    ),
    (
        "data-plane",
        "router/discovery.py",
        "from splitserve.controller.reconcile import Reconciler",
        "splitserve.router is not allowed to import splitserve.controller",
    ),
]


@pytest.mark.parametrize(("contract", "module", "statement", "reported"), WRONG_WAY)
def test_a_wrong_way_import_breaks_its_contract(
    tmp_path: Path, contract: str, module: str, statement: str, reported: str
) -> None:
    package = _copy_of_the_package(tmp_path)
    config = _config_for(tmp_path, contract, ["splitserve"])
    assert lint(tmp_path, config).returncode == 0, "the unmodified copy should keep the contract"
    target = package / module
    source = target.read_text()
    marker = "from __future__ import annotations\n"
    target.write_text(source.replace(marker, marker + f"\n{statement}  # noqa\n", 1))
    result = lint(tmp_path, config)
    assert result.returncode != 0
    assert reported in result.stdout, result.stdout


def test_a_benchmark_importing_a_test_breaks_its_contract(tmp_path: Path) -> None:
    for package in ("benchmarks", "tests", "testkit"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "tests" / "test_something.py").write_text("VALUE = 1\n")
    (tmp_path / "benchmarks" / "bench.py").write_text("import testkit\n")
    config = _config_for(tmp_path, "benchmarks", ["benchmarks", "tests", "testkit"])
    assert lint(tmp_path, config).returncode == 0
    (tmp_path / "benchmarks" / "bench.py").write_text("from tests.test_something import VALUE\n")
    result = lint(tmp_path, config)
    assert result.returncode != 0
    assert "benchmarks is not allowed to import tests" in result.stdout, result.stdout
