"""The chart's RBAC (charts/splitserve/files/rbac-rules.yaml) against what the operator really does.

The operator's own tables say which kinds it reads and writes (splitserve.io.kube.PLURALS,
reconcile.PRUNABLE_KINDS), and its builders say which children an InferenceDeployment gets. Server-side
apply needs get + create + patch; pruning needs list + delete; a Role the operator creates may only
grant what the operator holds (Kubernetes' RBAC escalation check).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pkg_sources import REPO_ROOT, load_rbac_rules

EXAMPLES = sorted((REPO_ROOT / "deploy" / "examples").glob("*.yaml"))

kube = pytest.importorskip("splitserve.io.kube", reason="operator's kube module not available")
reconcile = pytest.importorskip("splitserve.controller.reconcile", reason="operator's reconcile module not available")


def group_of(api_version: str) -> str:
    return api_version.split("/")[0] if "/" in api_version else ""


def granted(group: str, resource: str) -> set[str]:
    return {
        verb
        for rule in load_rbac_rules()
        if group in rule["apiGroups"] and resource in rule["resources"]
        for verb in rule["verbs"]
    }


def plural(api_version: str, kind: str) -> str:
    name: str = kube.PLURALS[(api_version, kind)]
    return name


def test_every_kind_the_operator_knows_is_granted() -> None:
    missing = [
        f"{group_of(api_version) or 'core'}/{resource}"
        for (api_version, _kind), resource in kube.PLURALS.items()
        if not granted(group_of(api_version), resource)
    ]
    assert missing == []


def test_pruned_kinds_can_be_listed_and_deleted() -> None:
    for api_version, kind in reconcile.PRUNABLE_KINDS:
        verbs = granted(group_of(api_version), plural(api_version, kind))
        assert {"list", "delete"} <= verbs, f"{kind}: {verbs}"


def test_the_inference_deployment_itself_is_watched_and_its_status_written() -> None:
    api_version, kind = reconcile.IDEP
    group = group_of(api_version)
    assert {"get", "list", "watch", "patch"} <= granted(group, plural(api_version, kind))
    assert {"get", "patch"} <= granted(group, plural(api_version, kind) + "/status")


def children_of(example: Path) -> list[dict[str, Any]]:
    from splitserve.api.spec import InferenceDeploymentSpec
    from splitserve.api.topology import Owner
    from splitserve.builders.bundle import build_children
    from splitserve.builders.target import Target

    document = yaml.safe_load(example.read_text())
    spec = InferenceDeploymentSpec.model_validate(document["spec"])
    children: list[dict[str, Any]] = build_children(Target(owner=Owner(document["metadata"]["name"], "ml"), spec=spec))
    return children


@pytest.mark.parametrize("example", EXAMPLES, ids=[path.stem for path in EXAMPLES])
def test_operator_may_server_side_apply_every_child(example: Path) -> None:
    children = children_of(example)
    assert children
    for child in children:
        verbs = granted(group_of(child["apiVersion"]), plural(child["apiVersion"], child["kind"]))
        assert {"get", "create", "patch"} <= verbs, f"{child['kind']}: {verbs}"


@pytest.mark.parametrize("example", EXAMPLES, ids=[path.stem for path in EXAMPLES])
def test_operator_holds_every_permission_it_grants(example: Path) -> None:
    roles = [child for child in children_of(example) if child["kind"] == "Role"]
    assert roles, "the router needs a Role to discover workers"
    for role in roles:
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    held = granted(group, resource)
                    assert set(rule["verbs"]) <= held, f"escalation: grants {group}/{resource} {rule['verbs']}"
