"""Shared helpers for the operator's unit tests."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

from tests.operator.upstream_crds import is_upstream_kind, upstream_problems

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "deploy" / "examples").glob("*.yaml"))
KUBERNETES_VERSION = "1.35.0"
# Kinds kubernetes-validate has no upstream schema for (CRDs of other projects) and whose CRDs are not
# vendored in tests/data/upstream-crds (those are checked against them: upstream_crds.py).
THIRD_PARTY_GROUPS = ("monitoring.coreos.com/", "keda.sh/")
# Spec fields of an aggregated deployment, for minimal(**AGGREGATED, ...): one pool, no KV connector.
AGGREGATED: dict[str, Any] = {"mode": "aggregated", "kvTransfer": {"connector": "None"}}


def load(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(path.read_text())
    return doc


def minimal(**spec_overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"model": {"name": "m", "source": {"uri": "/models/m"}}}
    spec.update(copy.deepcopy(spec_overrides))
    return {
        "apiVersion": "splitserve.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": "demo", "namespace": "ns"},
        "spec": spec,
    }


def assert_valid_kubernetes(obj: dict[str, Any]) -> None:
    """Validate against the real upstream schema (strict: unknown fields fail)."""
    if is_upstream_kind(obj):
        assert upstream_problems(obj) == [], obj
        return
    if obj["apiVersion"].startswith(THIRD_PARTY_GROUPS):
        assert obj["metadata"]["name"] and obj["spec"], obj
        return
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
