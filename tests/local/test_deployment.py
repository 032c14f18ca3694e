"""The example files and how `up` reads a deployment file."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from splitserve.api.spec import Connector, InferenceDeploymentSpec, Mode
from splitserve.local.deployment import TINY_MODEL_URI, DeploymentFileError, load_deployment, parse_deployment
from splitserve.validation import validate_text
from testkit.upctl import REPO

EXAMPLES = sorted((REPO / "deploy/local").glob("*.yaml"))


def test_there_are_three_examples() -> None:
    assert {path.name for path in EXAMPLES} == {"tiny-disaggregated.yaml", "tiny-aggregated.yaml", "tiny-lora.yaml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.name)
def test_examples_are_valid_for_the_api_models_and_the_crd(path: Path) -> None:
    document = yaml.safe_load(path.read_text())
    spec = InferenceDeploymentSpec.model_validate(document["spec"])
    assert spec.model.source.uri == TINY_MODEL_URI
    running_pools = [spec.decode] + ([spec.prefill] if spec.mode is Mode.DISAGGREGATED else [])
    assert all(pool.resources.gpus == 0 for pool in running_pools)
    assert validate_text(path.read_text()) == []


def test_disaggregated_example_uses_nixl_on_cpu() -> None:
    deployment = load_deployment(REPO / "deploy/local/tiny-disaggregated.yaml")
    assert deployment.spec.mode is Mode.DISAGGREGATED
    assert deployment.spec.kv_transfer.connector is Connector.NIXL
    assert deployment.spec.kv_transfer.buffer_device == "cpu"
    assert (deployment.prefill_replicas, deployment.decode_replicas) == (1, 1)


def test_aggregated_example_has_no_prefill_pool() -> None:
    deployment = load_deployment(REPO / "deploy/local/tiny-aggregated.yaml")
    assert deployment.spec.mode is Mode.AGGREGATED
    assert (deployment.prefill_replicas, deployment.decode_replicas) == (0, 1)


def _doc(**spec: object) -> str:
    body = {"model": {"name": "m", "source": {"uri": TINY_MODEL_URI}}, **spec}
    return yaml.safe_dump(
        {"apiVersion": "splitserve.io/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": "x"}, "spec": body}
    )


def test_every_validation_problem_is_reported() -> None:
    with pytest.raises(DeploymentFileError) as raised:
        parse_deployment(_doc(mode="sideways", prefill={"replicas": -1}))
    text = "\n".join(raised.value.messages)
    assert "spec.mode" in text and "spec.prefill.replicas" in text


def test_zero_decode_replicas_cannot_serve() -> None:
    with pytest.raises(DeploymentFileError, match=r"decode\.replicas is 0"):
        parse_deployment(_doc(decode={"replicas": 0, "minReplicas": 0}))


def test_pvc_source_needs_a_cluster() -> None:
    text = _doc().replace(f"uri: {TINY_MODEL_URI}", "pvc:\n        claimName: models")
    with pytest.raises(DeploymentFileError, match="needs a cluster"):
        parse_deployment(text)


def test_two_deployments_in_one_file_are_refused() -> None:
    with pytest.raises(DeploymentFileError, match="holds 2 InferenceDeployments"):
        parse_deployment(_doc() + "---\n" + _doc().replace("name: x", "name: y"))
