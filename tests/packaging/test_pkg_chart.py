"""The Helm chart rendered by Helm's own engine (helm-python-sdk), checked object by object."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from pkg_k8s import RenderChart, manifest_objects, validate_objects
from pkg_sources import CHART_DIR, CLUSTER_WIDE_SCOPES, NAMESPACED_ROLE_SCOPES, policy_rules

NAMESPACED_INSTALL = {"watchNamespaces": ["team-a", "team-b"]}
MONITORING_ON = {"metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}}}
CUSTOM_IMAGES = {
    "image": {"repository": "registry.example.com/ml/splitserve", "tag": "0.2.0-rc1", "pullPolicy": "Always"},
    "routerImage": {"repository": "registry.example.com/ml/router", "tag": "0.2.0-rc1"},
    "workerImage": {"repository": "registry.example.com/ml/worker", "tag": "cuda12-0.2.0"},
    "imagePullSecrets": [{"name": "regcred"}],
}
SINGLE_REPLICA = {"replicaCount": 1, "logLevel": "debug", "extraArgs": ["--standby-check"]}

VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "namespaced": NAMESPACED_INSTALL,
    "monitoring": MONITORING_ON,
    "custom-images": CUSTOM_IMAGES,
    "single-replica": SINGLE_REPLICA,
}


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [obj for obj in objects if obj["kind"] == kind]


def only(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    matches = by_kind(objects, kind)
    assert len(matches) == 1, f"expected one {kind}, got {len(matches)}"
    return matches[0]


def operator_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    containers: list[dict[str, Any]] = only(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["operator"]
    return containers[0]


def env_map(container: dict[str, Any]) -> dict[str, Any]:
    return {var["name"]: var.get("value", var.get("valueFrom")) for var in container["env"]}


def strip_rule(rule: dict[str, Any]) -> dict[str, Any]:
    return {"apiGroups": rule["apiGroups"], "resources": rule["resources"], "verbs": rule["verbs"]}


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_every_rendered_object_is_valid_kubernetes(
    value_set: str, render_chart: RenderChart, shipped_crd_schemas: dict[tuple[str, str, str], dict[str, Any]]
) -> None:
    objects = manifest_objects(render_chart(VALUE_SETS[value_set]))
    report = validate_objects(objects, shipped_crd_schemas)
    assert report.errors == []
    assert report.checked >= 6  # Deployment, Service, SA, ClusterRole(+Binding), peering
    # Only the ServiceMonitor may go unchecked (Prometheus Operator's schema is not bundled).
    assert all(entry.startswith("ServiceMonitor ") for entry in report.skipped), report.skipped


def test_chart_crds_are_valid_customresourcedefinitions(
    shipped_crd_schemas: dict[tuple[str, str, str], dict[str, Any]],
) -> None:
    from pkg_k8s import parse_manifests
    from pkg_sources import CHART_CRD_DIR

    crds = [doc for path in sorted(CHART_CRD_DIR.glob("*.yaml")) for doc in parse_manifests(path.read_text())]
    assert {crd["metadata"]["name"] for crd in crds} >= {"clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"}
    report = validate_objects(crds, custom_schemas={})
    assert report.errors == []
    assert report.checked == len(crds)


def test_defaults_install_a_two_replica_cluster_wide_operator(render_chart: RenderChart) -> None:
    objects = manifest_objects(render_chart())
    deployment = only(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    container = operator_container(objects)
    assert container["image"] == "ghcr.io/splitserve/splitserve:0.1.0"
    assert container["args"] == [
        "operator",
        "--peering",
        "splitserve",
        "--all-namespaces",
        "--liveness",
        "http://0.0.0.0:8080/healthz",
        "--metrics-port",
        "9102",
    ]
    env = env_map(container)
    assert env["SPLITSERVE_ROUTER_IMAGE"] == "ghcr.io/splitserve/splitserve:0.1.0"
    assert env["SPLITSERVE_WORKER_IMAGE"] == "ghcr.io/splitserve/worker:0.1.0"
    assert env["POD_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert only(objects, "ClusterKopfPeering")["metadata"]["name"] == "splitserve"
    assert by_kind(objects, "KopfPeering") == []
    assert by_kind(objects, "Role") == [] and by_kind(objects, "RoleBinding") == []
    assert only(objects, "PodDisruptionBudget")["spec"]["minAvailable"] == 1
    assert by_kind(objects, "ServiceMonitor") == []


def test_operator_pod_is_locked_down(render_chart: RenderChart) -> None:
    objects = manifest_objects(render_chart())
    pod = only(objects, "Deployment")["spec"]["template"]["spec"]
    container = operator_container(objects)
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["securityContext"]["runAsNonRoot"] is True
    tmp_mounts = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
    assert len(tmp_mounts) == 1
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[tmp_mounts[0]["name"]]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"healthz": 8080, "metrics": 9102}
    assert container["resources"]["requests"] and container["resources"]["limits"]


def test_cluster_wide_rbac_is_exactly_the_rules_file(render_chart: RenderChart) -> None:
    objects = manifest_objects(render_chart())
    role = only(objects, "ClusterRole")
    assert [strip_rule(rule) for rule in role["rules"]] == policy_rules(CLUSTER_WIDE_SCOPES)
    binding = only(objects, "ClusterRoleBinding")
    account = only(objects, "ServiceAccount")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": "splitserve-system"}
    ]
    deployment = only(objects, "Deployment")
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == account["metadata"]["name"]


def test_namespaced_install_grants_roles_only_in_the_watched_namespaces(render_chart: RenderChart) -> None:
    objects = manifest_objects(render_chart(NAMESPACED_INSTALL))
    roles = by_kind(objects, "Role")
    assert sorted(role["metadata"]["namespace"] for role in roles) == ["team-a", "team-b"]
    for role in roles:
        assert [strip_rule(rule) for rule in role["rules"]] == policy_rules(NAMESPACED_ROLE_SCOPES)
    bindings = by_kind(objects, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    for binding in bindings:
        assert binding["roleRef"]["kind"] == "Role"
        assert binding["subjects"][0]["namespace"] == "splitserve-system"
    # Cluster-wide, a namespaced install may only read CRDs (kopf scans them).
    cluster_role = only(objects, "ClusterRole")
    assert [strip_rule(rule) for rule in cluster_role["rules"]] == policy_rules(["cluster"])
    assert {r for rule in cluster_role["rules"] for r in rule["resources"]} == {"customresourcedefinitions"}
    peerings = by_kind(objects, "KopfPeering")
    assert sorted(p["metadata"]["namespace"] for p in peerings) == ["team-a", "team-b"]
    assert by_kind(objects, "ClusterKopfPeering") == []
    args = operator_container(objects)["args"]
    assert "--all-namespaces" not in args
    assert [args[i + 1] for i, arg in enumerate(args) if arg == "--namespace"] == ["team-a", "team-b"]


def test_monitoring_values_render_a_service_monitor_on_the_metrics_service(render_chart: RenderChart) -> None:
    objects = manifest_objects(render_chart(MONITORING_ON))
    monitor = only(objects, "ServiceMonitor")
    service = only(objects, "Service")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "30s", "scrapeTimeout": "10s"}
    ]
    assert service["spec"]["ports"][0]["name"] == "metrics" and service["spec"]["ports"][0]["port"] == 9102
    pod_labels = only(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()


def test_custom_images_reach_the_operator_and_its_environment(render_chart: RenderChart) -> None:
    objects = manifest_objects(render_chart(CUSTOM_IMAGES))
    container = operator_container(objects)
    assert container["image"] == "registry.example.com/ml/splitserve:0.2.0-rc1"
    assert container["imagePullPolicy"] == "Always"
    env = env_map(container)
    assert env["SPLITSERVE_ROUTER_IMAGE"] == "registry.example.com/ml/router:0.2.0-rc1"
    assert env["SPLITSERVE_WORKER_IMAGE"] == "registry.example.com/ml/worker:cuda12-0.2.0"
    pod = only(objects, "Deployment")["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]


def test_single_replica_has_no_disruption_budget_and_passes_extra_args(render_chart: RenderChart) -> None:
    objects = manifest_objects(render_chart(SINGLE_REPLICA))
    assert only(objects, "Deployment")["spec"]["replicas"] == 1
    assert by_kind(objects, "PodDisruptionBudget") == []
    container = operator_container(objects)
    assert container["args"][-2:] == ["--verbose", "--standby-check"]


def test_every_object_carries_the_recommended_labels(render_chart: RenderChart) -> None:
    for obj in manifest_objects(render_chart(NAMESPACED_INSTALL | MONITORING_ON)):
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "splitserve", obj["kind"]
        assert labels["app.kubernetes.io/instance"] == "splitserve"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["app.kubernetes.io/version"] == "0.1.0"
        assert labels["helm.sh/chart"] == "splitserve-0.1.0"


def test_notes_tell_the_user_what_to_do_next(render_chart: RenderChart) -> None:
    notes = render_chart(NAMESPACED_INSTALL)["splitserve/templates/NOTES.txt"]
    assert "team-a, team-b" in notes
    assert "kubectl wait --for=condition=Ready idep/" in notes
    assert "kubectl apply --server-side -f" in notes  # the CRD upgrade caveat
    assert "kubectl apply -n team-a" in notes


def test_chart_lints_clean_in_strict_mode(helm: ModuleType) -> None:
    for values in VALUE_SETS.values():
        report = helm.lint(str(CHART_DIR), values, strict=True, namespace="splitserve-system")
        problems = [m for m in report["messages"] if m["severity"] >= 2]
        assert report["errors"] == [] and problems == [], report


WRONG_VALUES: dict[str, dict[str, Any]] = {
    "replicas-as-string": {"replicaCount": "two"},
    "replicas-zero": {"replicaCount": 0},
    "namespaces-as-string": {"watchNamespaces": "team-a"},
    "namespace-not-dns": {"watchNamespaces": ["Team_A"]},
    "tag-as-number": {"image": {"tag": 1.2}},
    "unknown-top-level-key": {"replicas": 2},
    "unknown-nested-key": {"metrics": {"prot": 9102}},
    "port-out-of-range": {"metrics": {"port": 70000}},
    "log-level-typo": {"logLevel": "verbose"},
    "log-level-unsupported": {"logLevel": "warning"},
    "service-monitor-flag-as-string": {"metrics": {"serviceMonitor": {"enabled": "yes"}}},
    "bad-pull-policy": {"image": {"pullPolicy": "Sometimes"}},
}


@pytest.mark.parametrize("case", sorted(WRONG_VALUES))
def test_schema_rejects_wrong_values(case: str, helm: ModuleType, render_chart: RenderChart) -> None:
    chart = helm.Chart.load(str(CHART_DIR))
    merged = chart.merge_values(WRONG_VALUES[case])
    with pytest.raises(helm.HelmValuesError):
        chart.validate_schema(merged)
    with pytest.raises(helm.HelmError):
        render_chart(WRONG_VALUES[case])
    report = helm.lint(str(CHART_DIR), WRONG_VALUES[case])
    assert any(m["severity"] == 3 for m in report["messages"]) or report["errors"], report


def test_schema_accepts_the_documented_defaults(helm: ModuleType) -> None:
    chart = helm.Chart.load(str(CHART_DIR))
    chart.validate_schema(chart.merge_values({}))
    for values in VALUE_SETS.values():
        chart.validate_schema(chart.merge_values(copy.deepcopy(values)))


# Sub-trees of values.yaml that are plain Kubernetes objects (documented by Kubernetes' own API reference).
KUBERNETES_PASSTHROUGH_KEYS = {"resources", "podSecurityContext", "securityContext"}
KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_.-]+):")


def test_every_value_is_documented_and_camel_case() -> None:
    lines = (CHART_DIR / "values.yaml").read_text().splitlines()
    parents: list[tuple[int, str]] = []
    undocumented: list[str] = []
    for number, line in enumerate(lines):
        match = KEY_LINE.match(line)
        if not match:
            continue
        indent = len(match["indent"])
        key = match["key"]
        while parents and parents[-1][0] >= indent:
            parents.pop()
        path = ".".join([name for _, name in parents] + [key])
        parents.append((indent, key))
        assert re.fullmatch(r"[a-z][a-zA-Z0-9]*", key), f"{path}: values are camelCase"
        if any(name in KUBERNETES_PASSTHROUGH_KEYS for _, name in parents[:-1]):
            continue
        previous = lines[number - 1].strip() if number else ""
        if not previous.startswith("#"):
            undocumented.append(path)
    assert undocumented == []


def test_schema_knows_every_default_value(helm: ModuleType) -> None:
    schema_properties = yaml.safe_load((CHART_DIR / "values.schema.json").read_text())["properties"]
    defaults = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    assert set(defaults) <= set(schema_properties)


def test_chart_yaml_is_helm_v3_v4_api(helm: ModuleType) -> None:
    chart = helm.Chart.load(str(CHART_DIR))
    metadata = chart.metadata
    assert metadata["apiVersion"] == "v2"
    assert metadata["appVersion"] == "0.1.0"
    assert Path(CHART_DIR / "templates" / "NOTES.txt").exists()


@pytest.mark.parametrize("value_set", ["defaults", "namespaced", "single-replica"])
def test_operator_cli_accepts_the_command_line_the_chart_renders(value_set: str, render_chart: RenderChart) -> None:
    """The chart's args must parse with the real `splitserve operator` parser, or the pod crash-loops."""
    import argparse

    cli = pytest.importorskip("splitserve.controller.cli", reason="operator CLI not available")
    args = operator_container(manifest_objects(render_chart(VALUE_SETS[value_set])))["args"]
    if value_set == "single-replica":
        args = [arg for arg in args if arg != "--standby-check"]  # an example extraArg, not a real flag
    assert args[0] == "operator"
    parser = argparse.ArgumentParser(prog="splitserve operator", exit_on_error=False)
    cli.configure(parser)
    try:
        parsed, unknown = parser.parse_known_args(args[1:])
    except argparse.ArgumentError as error:
        pytest.fail(f"`splitserve operator` rejects the chart's arguments: {error}")
    assert unknown == [], f"`splitserve operator` does not know {unknown}; the chart passes them"
    assert parsed.peering == "splitserve"
    assert parsed.liveness == "http://0.0.0.0:8080/healthz"
    if value_set == "namespaced":
        assert parsed.namespace == ["team-a", "team-b"]
    else:
        assert parsed.all_namespaces is True
