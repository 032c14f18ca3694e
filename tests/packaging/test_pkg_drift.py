"""Copies of the CRDs and of the RBAC rules must match their single source."""

from __future__ import annotations

import pytest
from pkg_sources import (
    CHART_CRD_DIR,
    KNOWN_SCOPES,
    KUSTOMIZE_CRD_DIR,
    REPO_ROOT,
    expected_generated_files,
    load_rbac_rules,
    source_crd_files,
    stale_copies,
)

REGENERATE = "run `python tests/packaging/pkg_sources.py` and commit the result"


def test_crd_copies_match_crds_folder() -> None:
    if not source_crd_files():
        pytest.skip("crds/ is still empty: `splitserve crd` has not written the InferenceDeployment CRD yet")
    drifted = [
        str(path.relative_to(REPO_ROOT))
        for path, content in expected_generated_files().items()
        if not path.exists() or path.read_text() != content
    ]
    assert drifted == [], f"out of date: {drifted}; {REGENERATE}"


def test_no_stale_crd_copies() -> None:
    expected = {path.name for path in expected_generated_files() if path.parent == CHART_CRD_DIR}
    assert stale_copies(CHART_CRD_DIR, expected) == [], REGENERATE
    expected_kustomize = {path.name for path in expected_generated_files() if path.parent == KUSTOMIZE_CRD_DIR}
    assert stale_copies(KUSTOMIZE_CRD_DIR, expected_kustomize) == [], REGENERATE


def test_rbac_rules_file_is_well_formed() -> None:
    rules = load_rbac_rules()
    seen: set[tuple[str, str]] = set()
    for rule in rules:
        assert set(rule) == {"apiGroups", "resources", "verbs", "scope", "why"}, rule
        assert rule["scope"] in KNOWN_SCOPES, rule
        assert rule["why"].strip(), rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                assert (group, resource) not in seen, f"{group}/{resource} is listed twice"
                seen.add((group, resource))


def verbs_of(group: str, resource: str) -> set[str]:
    return {
        verb
        for rule in load_rbac_rules()
        if group in rule["apiGroups"] and resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_operator_holds_what_it_grants_the_router() -> None:
    # RBAC escalation prevention: a Role the operator creates may only grant what the operator holds.
    # Pods: the router's pod discovery. EndpointSlices: what the router Role of an operator before KV
    # generations granted, which that operator still applies while an upgrade replaces it.
    router_grants = {("discovery.k8s.io", "endpointslices"), ("", "pods")}
    for group, resource in router_grants:
        assert {"get", "list", "watch"} <= verbs_of(group, resource), f"{group}/{resource}"


def test_secrets_are_never_written() -> None:
    assert verbs_of("", "secrets") == {"get", "list", "watch"}
