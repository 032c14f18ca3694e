"""The install path end to end against the project's Kubernetes API emulator (testkit/emulator).

What a real cluster would do that this checks: real kubectl server-side-applies the chart's CRDs and
rendered manifests; two operator replicas started with the chart's exact command line share one kopf
peering object; the install script's deploy (apply + `kubectl wait --for=condition=Ready`), scale
(`kubectl patch` + wait) and uninstall steps run unmodified; and every API call the operator made is
allowed by the chart's RBAC. The emulator grants everything, so the RBAC check is done from its
request log. Not checked: port-forward and the request step (the emulator runs no pods), Helm itself
(stubbed in the script; the chart is rendered by the Helm engine and applied with kubectl instead).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from pkg_k8s import RenderChart, manifest_objects
from pkg_sources import CHART_CRD_DIR, CLUSTER_WIDE_SCOPES, REPO_ROOT, load_rbac_rules

pytestmark = [pytest.mark.slow, pytest.mark.emulator]

SCRIPT = REPO_ROOT / "deploy" / "install-on-cluster.sh"
EXAMPLE = REPO_ROOT / "deploy" / "examples" / "llama-8b-disaggregated.yaml"
OPERATOR_NAMESPACE = "splitserve-system"
UNSERVED_KINDS = {"ClusterRole", "ClusterRoleBinding"}
WORKLOAD_NAMESPACE = "default"
KUBECTL_WRAPPER = """#!/usr/bin/env bash
# The emulator serves no OpenAPI documents, so kubectl's client-side schema validation is switched off.
for arg in "$@"; do
  if [[ "$arg" == apply ]]; then exec "{kubectl}" "$@" --validate=false; fi
done
exec "{kubectl}" "$@"
"""
HELM_STUB = """#!/usr/bin/env bash
# Stands in for helm: the chart is already applied by the test (rendered by Helm's engine).
echo "helm $*" >> "{log}"
"""


def wait_until(condition: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")


class Cluster:
    def __init__(self, emulator: Any, workdir: Path, kubectl: str) -> None:
        self.emulator = emulator
        self.workdir = workdir
        self.kubectl_path = kubectl
        self.operators: list[subprocess.Popen[bytes]] = []
        self.operator_logs: list[Path] = []
        self.bin_dir = workdir / "bin"
        self.bin_dir.mkdir()
        wrapper = self.bin_dir / "kubectl"
        wrapper.write_text(KUBECTL_WRAPPER.format(kubectl=kubectl))
        helm = self.bin_dir / "helm"
        helm.write_text(HELM_STUB.format(log=workdir / "helm.log"))
        for tool in (wrapper, helm):
            tool.chmod(0o755)

    def env(self, **extra: str) -> dict[str, str]:
        environment: dict[str, str] = dict(self.emulator.env())
        environment["PATH"] = f"{self.bin_dir}{os.pathsep}{environment.get('PATH', '')}"
        environment.update(extra)
        return environment

    def kubectl(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(self.bin_dir / "kubectl"), *args],
            input=stdin,
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
            env=self.env(),
        )
        assert result.returncode == 0, f"kubectl {' '.join(args)}: {result.stderr}"
        return result

    def get(self, *args: str) -> dict[str, Any]:
        loaded: dict[str, Any] = yaml.safe_load(self.kubectl("get", *args, "-o", "yaml").stdout)
        return loaded

    def start_operator(self, args: list[str], env: dict[str, str], pod_name: str) -> None:
        log_path = self.workdir / f"{pod_name}.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "splitserve", *args],
                env=self.env(**env, POD_ID=pod_name),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.operators.append(process)
        self.operator_logs.append(log_path)

    def stop(self) -> None:
        for process in self.operators:
            process.terminate()
        for process in self.operators:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
        self.emulator.kill()

    def logs(self) -> str:
        return "\n".join(f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}" for path in self.operator_logs)


def fixtures_module() -> ModuleType:
    module: ModuleType = pytest.importorskip(
        "testkit.emulator.fixtures", reason="API emulator (testkit/emulator) not available"
    )
    return module


def operator_args_the_cli_knows(args: list[str]) -> list[str]:
    """The chart's arguments, minus flags `splitserve operator` does not have yet (test_pkg_chart flags those)."""
    from splitserve.controller import cli

    parser = argparse.ArgumentParser(exit_on_error=False)
    cli.configure(parser)
    _, unknown = parser.parse_known_args(args[1:])
    return [arg for arg in args if arg not in unknown]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, helm: ModuleType) -> Iterator[Cluster]:
    fixtures = fixtures_module()
    pytest.importorskip("splitserve.controller.cli", reason="operator not available")
    workdir = tmp_path_factory.mktemp("emulated-cluster")
    emulator = fixtures.EmulatorProcess(workdir)
    emulator.start()
    cluster = Cluster(emulator, workdir, fixtures.find_kubectl())
    try:
        yield cluster
    finally:
        cluster.stop()
        sys.stderr.write(cluster.logs())


@pytest.fixture(scope="module")
def installed(cluster: Cluster, render_chart: RenderChart) -> Cluster:
    cluster.kubectl("apply", "--server-side", "-f", str(CHART_CRD_DIR))
    cluster.kubectl("create", "namespace", OPERATOR_NAMESPACE)
    objects = manifest_objects(render_chart(namespace=OPERATOR_NAMESPACE))
    # The emulator grants every request and serves no cluster-scoped RBAC kinds; RBAC is checked from
    # its request log instead (last test).
    storable = [obj for obj in objects if obj["kind"] not in UNSERVED_KINDS]
    cluster.kubectl("apply", "--server-side", "-f", "-", stdin=yaml.safe_dump_all(storable))
    [deployment] = [obj for obj in objects if obj["kind"] == "Deployment"]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    literal_env = {var["name"]: var["value"] for var in container["env"] if "value" in var}
    args = operator_args_the_cli_knows(container["args"])
    liveness = args.index("--liveness") + 1
    assert args[liveness] == "http://0.0.0.0:8080/healthz"
    metrics = args.index("--metrics-port") + 1 if "--metrics-port" in args else None
    for replica in range(deployment["spec"]["replicas"]):
        # Pods each have their own network namespace; processes on one host need their own ports.
        args[liveness] = f"http://127.0.0.1:{fixtures_module().free_port()}/healthz"
        if metrics is not None:
            args[metrics] = str(fixtures_module().free_port())
        cluster.start_operator(list(args), literal_env, pod_name=f"splitserve-operator-{replica}")
    return cluster


def test_two_replicas_share_the_charts_peering_object(installed: Cluster) -> None:
    def peers() -> dict[str, Any]:
        status: dict[str, Any] = installed.get("clusterkopfpeering", "splitserve").get("status") or {}
        return status if len(status) == 2 else {}

    status = wait_until(peers, 60, "both operator replicas in the ClusterKopfPeering")
    assert set(status) == {"splitserve-operator-0", "splitserve-operator-1"}
    priorities = {peer["priority"] for peer in status.values()}
    assert len(priorities) == 2, f"equal priorities pause both replicas: {status}"
    assert all(process.poll() is None for process in installed.operators), installed.logs()


def run_script(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        env=cluster.env(NAMESPACE=WORKLOAD_NAMESPACE, READY_TIMEOUT="120s", DRY_RUN="0"),
    )


def test_script_deploys_waits_for_ready_and_scales(installed: Cluster) -> None:
    if not EXAMPLE.exists():
        pytest.skip(f"{EXAMPLE.name} not written yet")
    installed.kubectl(
        "create", "secret", "generic", "hf-token", "--from-literal=token=hf_test", "-n", WORKLOAD_NAMESPACE
    )
    deployed = run_script(installed, "deploy", str(EXAMPLE))
    assert deployed.returncode == 0, deployed.stderr + installed.logs()
    idep = installed.get("idep", "llama-8b", "-n", WORKLOAD_NAMESPACE)
    ready = [c for c in idep["status"]["conditions"] if c["type"] == "Ready"]
    assert ready and ready[0]["status"] == "True"

    scaled = run_script(installed, "scale", "llama-8b", "2")
    assert scaled.returncode == 0, scaled.stderr + installed.logs()
    # One decode Deployment, `llama-8b-decode-<KV generation>`: found by its labels, not its name.
    selector = "splitserve.io/deployment=llama-8b,splitserve.io/role=decode"
    (decode,) = installed.get("deployment", "-l", selector, "-n", WORKLOAD_NAMESPACE)["items"]
    assert decode["metadata"]["name"] == f"llama-8b-decode-{decode['metadata']['labels']['splitserve.io/generation']}"
    assert decode["spec"]["replicas"] == 2
    assert installed.get("idep", "llama-8b", "-n", WORKLOAD_NAMESPACE)["status"]["decode"]["readyReplicas"] == 2


def test_script_uninstall_removes_the_inference_deployment(installed: Cluster) -> None:
    removed = run_script(installed, "uninstall", "llama-8b")
    assert removed.returncode == 0, removed.stderr + installed.logs()
    listed = installed.get("idep", "-n", WORKLOAD_NAMESPACE)
    assert listed["items"] == []
    helm_calls = (installed.workdir / "helm.log").read_text()
    assert f"helm uninstall splitserve --namespace {OPERATOR_NAMESPACE} --wait --ignore-not-found" in helm_calls


def allowed(verb: str, group: str, resource: str) -> bool:
    wanted = set(CLUSTER_WIDE_SCOPES)
    return any(
        rule["scope"] in wanted
        and group in rule["apiGroups"]
        and resource in rule["resources"]
        and verb in rule["verbs"]
        for rule in load_rbac_rules()
    )


def test_every_call_the_operator_made_is_allowed_by_the_charts_rbac(installed: Cluster) -> None:
    with installed.emulator.client() as client:
        log = client.requests_log()
    operator_calls = [
        record
        for record in log
        if str(record.get("user_agent", "")).startswith(("kopf/", "splitserve-operator/"))
        and record.get("resource")  # discovery (/api, /apis) needs no RBAC rule
    ]
    assert operator_calls, "the operator made no API calls"
    denied = sorted(
        {
            f"{record['verb']} {record.get('group') or 'core'}/{record['resource']}"
            + (f"/{record['subresource']}" if record.get("subresource") else "")
            for record in operator_calls
            if not allowed(
                record["verb"],
                record.get("group") or "",
                record["resource"] + (f"/{record['subresource']}" if record.get("subresource") else ""),
            )
        }
    )
    assert denied == [], f"RBAC would forbid these operator calls: {denied}"


def test_namespaced_install_needs_nothing_outside_its_namespaces(
    tmp_path_factory: pytest.TempPathFactory, render_chart: RenderChart
) -> None:
    """watchNamespaces: the operator's calls must fit the per-namespace Role plus the CRD-only ClusterRole."""
    fixtures = fixtures_module()
    workdir = tmp_path_factory.mktemp("namespaced-cluster")
    emulator = fixtures.EmulatorProcess(workdir)
    emulator.start()
    cluster = Cluster(emulator, workdir, fixtures.find_kubectl())
    try:
        cluster.kubectl("apply", "--server-side", "-f", str(CHART_CRD_DIR))
        for namespace in (OPERATOR_NAMESPACE, "team-a"):
            cluster.kubectl("create", "namespace", namespace)
        objects = manifest_objects(
            render_chart({"watchNamespaces": ["team-a"], "replicaCount": 1}, namespace=OPERATOR_NAMESPACE)
        )
        storable = [obj for obj in objects if obj["kind"] not in UNSERVED_KINDS]
        cluster.kubectl("apply", "--server-side", "-f", "-", stdin=yaml.safe_dump_all(storable))
        roles = {obj["kind"]: obj for obj in objects if obj["kind"] in ("Role", "ClusterRole")}
        [deployment] = [obj for obj in objects if obj["kind"] == "Deployment"]
        [container] = deployment["spec"]["template"]["spec"]["containers"]
        args = operator_args_the_cli_knows(container["args"])
        args[args.index("--liveness") + 1] = f"http://127.0.0.1:{fixtures.free_port()}/healthz"
        if "--metrics-port" in args:
            args[args.index("--metrics-port") + 1] = str(fixtures.free_port())
        cluster.start_operator(args, {}, pod_name="splitserve-operator-0")
        example = yaml.safe_load((REPO_ROOT / "deploy" / "examples" / "small-aggregated.yaml").read_text())
        cluster.kubectl("apply", "-n", "team-a", "-f", "-", stdin=yaml.safe_dump(example))
        name = example["metadata"]["name"]
        wait_until(
            lambda: any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in (cluster.get("idep", name, "-n", "team-a").get("status") or {}).get("conditions", [])
            ),
            90,
            "the InferenceDeployment in the watched namespace to become Ready",
        )
        with emulator.client() as client:
            log = client.requests_log()
    finally:
        cluster.stop()
        sys.stderr.write(cluster.logs())

    def role_allows(role: dict[str, Any], verb: str, group: str, resource: str) -> bool:
        return any(
            group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]
            for rule in role["rules"]
        )

    denied = set()
    operator_calls = [
        record
        for record in log
        if str(record.get("user_agent", "")).startswith(("kopf/", "splitserve-operator/")) and record.get("resource")
    ]
    assert operator_calls
    for record in operator_calls:
        resource = record["resource"] + (f"/{record['subresource']}" if record.get("subresource") else "")
        group = record.get("group") or ""
        if record.get("namespace") == "team-a":
            ok = role_allows(roles["Role"], record["verb"], group, resource)
        else:
            ok = role_allows(roles["ClusterRole"], record["verb"], group, resource)
        if not ok:
            denied.add(
                f"{record['verb']} {group or 'core'}/{resource} in {record.get('namespace') or 'all namespaces'}"
            )
    # kopf tries to list and watch namespaces even with exact names; when that is forbidden it logs a warning
    # and uses the given names (kopf/_core/reactor/observation.py). A namespaced install does not get a
    # cluster-wide read of every namespace name just to silence that warning.
    kopf_falls_back = {"list core/namespaces in all namespaces", "watch core/namespaces in all namespaces"}
    assert sorted(denied - kopf_falls_back) == []
