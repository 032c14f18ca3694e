"""deploy/kustomize rendered by the real kustomize (`kubectl kustomize`), validated object by object."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pkg_k8s import RenderChart, manifest_objects, parse_manifests, validate_objects
from pkg_sources import CLUSTER_WIDE_SCOPES, KUSTOMIZE_DIR, policy_rules

VARIANTS = {
    "base": KUSTOMIZE_DIR / "base",
    "dev": KUSTOMIZE_DIR / "overlays" / "dev",
    "production": KUSTOMIZE_DIR / "overlays" / "production",
}
CLUSTER_SCOPED_KINDS = {
    "Namespace",
    "CustomResourceDefinition",
    "ClusterRole",
    "ClusterRoleBinding",
    "ClusterKopfPeering",
}

Build = Callable[[Path], str]


def build_objects(kustomize_build: Build, variant: str) -> list[dict[str, Any]]:
    return parse_manifests(kustomize_build(VARIANTS[variant]))


def deployment(objects: list[dict[str, Any]]) -> dict[str, Any]:
    [found] = [obj for obj in objects if obj["kind"] == "Deployment"]
    return found


def operator_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    containers: list[dict[str, Any]] = deployment(objects)["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_kustomize_object_is_valid_kubernetes(
    variant: str, kustomize_build: Build, shipped_crd_schemas: dict[tuple[str, str, str], dict[str, Any]]
) -> None:
    objects = build_objects(kustomize_build, variant)
    report = validate_objects(objects, shipped_crd_schemas)
    assert report.errors == []
    assert report.skipped == []
    assert report.checked == len(objects)
    kinds = {obj["kind"] for obj in objects}
    assert {"Namespace", "CustomResourceDefinition", "ServiceAccount", "ClusterRole", "ClusterRoleBinding"} <= kinds
    assert {"Deployment", "Service", "ClusterKopfPeering"} <= kinds


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_namespaced_objects_land_in_the_operator_namespace(variant: str, kustomize_build: Build) -> None:
    for obj in build_objects(kustomize_build, variant):
        namespace = obj["metadata"].get("namespace")
        if obj["kind"] in CLUSTER_SCOPED_KINDS:
            assert namespace is None, obj["kind"]
        else:
            assert namespace == "splitserve-system", obj["kind"]
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "splitserve"


def test_dev_overlay_runs_one_replica_with_debug_logs(kustomize_build: Build) -> None:
    objects = build_objects(kustomize_build, "dev")
    assert deployment(objects)["spec"]["replicas"] == 1
    base_args = operator_container(build_objects(kustomize_build, "base"))["args"]
    assert operator_container(objects)["args"] == [*base_args, "--verbose"]
    env = {var["name"]: var.get("value") for var in operator_container(objects)["env"]}
    assert env["SPLITSERVE_WORKER_IMAGE"] == "ghcr.io/splitserve/worker:0.1.0"
    assert not [obj for obj in objects if obj["kind"] == "PodDisruptionBudget"]


def test_production_overlay_is_highly_available(kustomize_build: Build) -> None:
    objects = build_objects(kustomize_build, "production")
    operator = deployment(objects)
    assert operator["spec"]["replicas"] == 2
    [budget] = [obj for obj in objects if obj["kind"] == "PodDisruptionBudget"]
    assert budget["spec"]["minAvailable"] == 1
    pod_labels = operator["spec"]["template"]["metadata"]["labels"]
    assert budget["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    resources = operator_container(objects)["resources"]
    assert resources["requests"] == {"cpu": "200m", "memory": "256Mi"}
    assert resources["limits"] == {"memory": "1Gi"}
    assert operator["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    # Base settings survive the patch.
    assert operator_container(objects)["securityContext"]["readOnlyRootFilesystem"] is True


def test_kustomize_rbac_is_the_rules_file(kustomize_build: Build) -> None:
    objects = build_objects(kustomize_build, "base")
    [role] = [obj for obj in objects if obj["kind"] == "ClusterRole"]
    assert role["rules"] == policy_rules(CLUSTER_WIDE_SCOPES)
    [binding] = [obj for obj in objects if obj["kind"] == "ClusterRoleBinding"]
    [account] = [obj for obj in objects if obj["kind"] == "ServiceAccount"]
    assert binding["subjects"][0]["name"] == account["metadata"]["name"]
    assert deployment(objects)["spec"]["template"]["spec"]["serviceAccountName"] == account["metadata"]["name"]


def test_kustomize_and_chart_run_the_operator_the_same_way(kustomize_build: Build, render_chart: RenderChart) -> None:
    """The two install paths must not drift apart: same command line, probes, ports, security."""
    kustomized = operator_container(build_objects(kustomize_build, "production"))
    charted = operator_container(manifest_objects(render_chart()))
    for key in ("image", "args", "ports", "startupProbe", "livenessProbe", "readinessProbe", "securityContext"):
        assert kustomized[key] == charted[key], key
    assert {v["name"] for v in kustomized["env"]} == {v["name"] for v in charted["env"]}
