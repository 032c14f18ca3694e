"""The committed CRD is the generator's output, and it is a valid, structural CRD."""

from __future__ import annotations

from typing import Any

import yaml

from splitserve.api.crd import CRD_FILE_NAME, build_crd, render_crd_yaml
from tests.operator.helpers import REPO, assert_valid_kubernetes


def test_committed_crd_matches_generator() -> None:
    committed = (REPO / "crds" / CRD_FILE_NAME).read_text()
    assert committed == render_crd_yaml(), "crds/ drifted from the API models: run `splitserve crd -o crds/...`"


def test_chart_crd_matches_generator() -> None:
    chart_copy = REPO / "charts" / "splitserve" / "crds" / CRD_FILE_NAME
    assert chart_copy.read_text() == render_crd_yaml(), "charts/splitserve/crds drifted from crds/"


def test_crd_is_a_valid_apiextensions_object() -> None:
    assert_valid_kubernetes(yaml.safe_load(render_crd_yaml()))


def _walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found: list[tuple[str, dict[str, Any]]] = []
    if isinstance(node, dict):
        found.append((path, node))
        for key, value in node.items():
            found.extend(_walk(value, f"{path}.{key}"))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found.extend(_walk(value, f"{path}[{index}]"))
    return found


def test_schema_is_structural() -> None:
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema):
        assert "$ref" not in node, path
        assert "title" not in node or path.endswith(".properties"), path
        if "anyOf" in node:
            assert node.get("x-kubernetes-int-or-string") is True, f"only int-or-string may use anyOf: {path}"
        for bound in ("exclusiveMinimum", "exclusiveMaximum"):
            if bound in node and not path.endswith(".properties"):
                assert isinstance(node[bound], bool), f"OpenAPI v3.0 exclusive bounds are booleans: {path}"
        if "properties" in node and not path.endswith(".properties"):
            assert node.get("type") == "object", path
        if node.get("type") == "array":
            assert "items" in node, path


def test_crd_names_subresources_and_columns() -> None:
    crd = build_crd()
    assert crd["spec"]["names"]["shortNames"] == ["idep"]
    version = crd["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = [column["name"] for column in version["additionalPrinterColumns"]]
    assert columns[:6] == ["Ready", "Mode", "Prefill", "Decode", "Rollout", "Endpoint"]
    assert columns[-1] == "Age"


def test_defaults_are_written_out() -> None:
    spec = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["properties"]["mode"]["default"] == "disaggregated"
    assert spec["properties"]["kvTransfer"]["properties"]["connector"]["default"] == "NixlConnector"
    assert spec["properties"]["engine"]["properties"]["prefixCaching"]["default"] is True
    assert spec["properties"]["prefill"]["default"] == {}, "empty object default lets nested defaults apply"
    assert "default" not in spec["properties"]["model"]["properties"]["source"]["properties"]["pvc"]
