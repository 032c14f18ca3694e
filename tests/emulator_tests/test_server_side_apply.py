"""Server-side apply field ownership: "the operator does not fight over replicas"."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from testkit.emulator import managed_fields
from testkit.emulator.client import ApiError, EmulatorClient
from tests.emulator_tests.test_api import deployment

DEPLOY = ("apps/v1", "deployments")


def _without_replicas(obj: dict[str, Any]) -> dict[str, Any]:
    trimmed = copy.deepcopy(obj)
    del trimmed["spec"]["replicas"]
    return trimmed


def _get(client: EmulatorClient, namespace: str) -> dict[str, Any]:
    return client.get(*DEPLOY, "d", namespace=namespace)


def test_apply_records_owner_of_replicas(shared_client: EmulatorClient, fresh_namespace: str) -> None:
    shared_client.apply(deployment("d", fresh_namespace, replicas=2), field_manager="operator")
    assert managed_fields.owners_of(_get(shared_client, fresh_namespace), "spec.replicas") == ["operator"]


def test_scale_takes_replicas_and_reapply_without_them_leaves_them(
    shared_client: EmulatorClient, fresh_namespace: str
) -> None:
    desired = deployment("d", fresh_namespace, replicas=2)
    shared_client.apply(desired, field_manager="operator")
    shared_client.patch(
        *DEPLOY, "d", {"spec": {"replicas": 7}}, namespace=fresh_namespace, subresource="scale", field_manager="hpa"
    )
    scaled = _get(shared_client, fresh_namespace)
    assert managed_fields.owners_of(scaled, "spec.replicas") == ["hpa"]

    shared_client.apply(_without_replicas(desired), field_manager="operator")
    after = _get(shared_client, fresh_namespace)
    assert after["spec"]["replicas"] == 7
    assert managed_fields.owners_of(after, "spec.replicas") == ["hpa"]


def test_reapply_without_a_solely_owned_field_removes_it(shared_client: EmulatorClient, fresh_namespace: str) -> None:
    desired = deployment("d", fresh_namespace, replicas=2)
    desired["metadata"]["labels"] = {"team": "a"}
    shared_client.apply(desired, field_manager="operator")
    desired["metadata"]["labels"] = {}
    shared_client.apply(desired, field_manager="operator")
    assert "team" not in (_get(shared_client, fresh_namespace)["metadata"].get("labels") or {})


def test_apply_of_a_field_owned_by_another_manager_conflicts_unless_forced(
    shared_client: EmulatorClient, fresh_namespace: str
) -> None:
    desired = deployment("d", fresh_namespace, replicas=2)
    shared_client.apply(desired, field_manager="operator")
    shared_client.apply(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "d", "namespace": fresh_namespace},
            "spec": {"replicas": 5},
        },
        field_manager="autoscaler",
        force=True,
    )
    with pytest.raises(ApiError) as error:
        shared_client.apply(desired, field_manager="operator")
    assert error.value.status_code == 409 and "autoscaler" in str(error.value.body["message"])
    shared_client.apply(desired, field_manager="operator", force=True)
    forced = _get(shared_client, fresh_namespace)
    assert forced["spec"]["replicas"] == 2
    assert managed_fields.owners_of(forced, "spec.replicas") == ["operator"]


def test_same_value_is_shared_ownership(shared_client: EmulatorClient, fresh_namespace: str) -> None:
    shared_client.apply(deployment("d", fresh_namespace, replicas=3), field_manager="operator")
    shared_client.apply(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "d", "namespace": fresh_namespace},
            "spec": {"replicas": 3},
        },
        field_manager="other",
    )
    assert sorted(managed_fields.owners_of(_get(shared_client, fresh_namespace), "spec.replicas")) == [
        "operator",
        "other",
    ]
    # The operator drops replicas; the other manager still owns them, so they stay.
    shared_client.apply(_without_replicas(deployment("d", fresh_namespace)), field_manager="operator")
    assert _get(shared_client, fresh_namespace)["spec"]["replicas"] == 3


def test_update_takes_ownership_from_appliers(shared_client: EmulatorClient, fresh_namespace: str) -> None:
    shared_client.apply(deployment("d", fresh_namespace, replicas=2), field_manager="operator")
    shared_client.patch(*DEPLOY, "d", {"spec": {"replicas": 4}}, namespace=fresh_namespace, field_manager="human")
    assert managed_fields.owners_of(_get(shared_client, fresh_namespace), "spec.replicas") == ["human"]


def test_noop_apply_keeps_resource_version(shared_client: EmulatorClient, fresh_namespace: str) -> None:
    # A ConfigMap: the fake controllers would write a Deployment's status between the two applies.
    settings = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "settings", "namespace": fresh_namespace},
        "data": {"a": "b"},
    }
    first = shared_client.apply(settings, field_manager="operator")
    second = shared_client.apply(settings, field_manager="operator")
    assert second["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]


# Pure-logic checks of the ownership rules, without a server.
def test_fields_v1_round_trip() -> None:
    paths = {("spec", "replicas"), ("spec", "template", "spec", "containers"), ("metadata", "labels", "a")}
    assert managed_fields.paths_from_fields_v1(managed_fields.fields_v1(paths)) == paths


def test_server_side_apply_function_conflict_lists_paths() -> None:
    def tracked(path: managed_fields.Path) -> bool:
        return managed_fields.track_main_resource(path, has_status_subresource=True)

    current = managed_fields.server_side_apply(
        None,
        {"spec": {"replicas": 1}},
        manager="a",
        force=False,
        subresource="",
        api_version="v1",
        now="t",
        tracked=tracked,
    )
    with pytest.raises(managed_fields.ApplyConflict) as error:
        managed_fields.server_side_apply(
            current,
            {"spec": {"replicas": 2}},
            manager="b",
            force=False,
            subresource="",
            api_version="v1",
            now="t",
            tracked=tracked,
        )
    assert error.value.conflicts == [(("spec", "replicas"), "a")]
