"""Pure logic of the emulator: selectors, patches, JSONPath/Table rendering, status of fake controllers."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from testkit.emulator import controllers, managed_fields, patching, rbac, selectors, tables
from testkit.emulator.resources import PrinterColumn, ResourceInfo

label_keys = st.sampled_from(["app", "tier", "zone", "team"])
label_values = st.sampled_from(["a", "b", "c"])
label_sets = st.dictionaries(label_keys, label_values, max_size=4)


def _obj(labels: dict[str, str]) -> dict[str, Any]:
    return {"metadata": {"name": "x", "namespace": "ns", "labels": labels}}


@given(labels=label_sets, key=label_keys, value=label_values)
def test_equality_and_inequality_are_complements(labels: dict[str, str], key: str, value: str) -> None:
    equal = selectors.labels_match(selectors.parse_label_selector(f"{key}={value}"), _obj(labels))
    unequal = selectors.labels_match(selectors.parse_label_selector(f"{key}!={value}"), _obj(labels))
    assert equal != unequal
    assert equal == (labels.get(key) == value)


@given(labels=label_sets, key=label_keys, values=st.lists(label_values, min_size=1, max_size=3))
def test_in_and_notin_are_complements(labels: dict[str, str], key: str, values: list[str]) -> None:
    joined = ",".join(values)
    inside = selectors.labels_match(selectors.parse_label_selector(f"{key} in ({joined})"), _obj(labels))
    outside = selectors.labels_match(selectors.parse_label_selector(f"{key} notin ({joined})"), _obj(labels))
    assert inside != outside
    assert inside == (labels.get(key) in values)


@given(labels=label_sets, key=label_keys)
def test_exists_and_not_exists(labels: dict[str, str], key: str) -> None:
    assert selectors.labels_match(selectors.parse_label_selector(key), _obj(labels)) == (key in labels)
    assert selectors.labels_match(selectors.parse_label_selector(f"!{key}"), _obj(labels)) == (key not in labels)


def test_malformed_selector_is_an_error() -> None:
    with pytest.raises(selectors.SelectorError):
        selectors.parse_label_selector("a in b")


def test_field_selector_on_names() -> None:
    requirements = selectors.parse_field_selector("metadata.name=x,metadata.namespace!=other")
    assert selectors.fields_match(requirements, _obj({}))
    assert not selectors.fields_match(selectors.parse_field_selector("metadata.name=y"), _obj({}))


def test_structured_selector_rendering() -> None:
    rendered = selectors.selector_from_label_selector(
        {"matchLabels": {"b": "2", "a": "1"}, "matchExpressions": [{"key": "c", "operator": "In", "values": ["x"]}]}
    )
    assert rendered == "a=1,b=2,c in (x)"


json_values = st.recursive(
    st.none() | st.integers() | st.text(max_size=3),
    lambda children: st.dictionaries(st.text(min_size=1, max_size=3), children, max_size=3),
    max_leaves=8,
)
json_objects = st.dictionaries(st.text(min_size=1, max_size=3), json_values, max_size=4)


@given(target=json_objects, patch=json_objects)
def test_merge_patch_is_idempotent(target: dict[str, Any], patch: dict[str, Any]) -> None:
    once = patching.merge_patch(target, patch)
    assert patching.merge_patch(once, patch) == once


@given(target=json_objects)
def test_empty_merge_patch_changes_nothing_but_nulls(target: dict[str, Any]) -> None:
    assert patching.merge_patch(target, {}) == target


def test_json_patch_operations_and_failures() -> None:
    document = {"a": {"b": [1, 2]}}
    patched = patching.json_patch(
        document,
        [
            {"op": "add", "path": "/a/b/-", "value": 3},
            {"op": "replace", "path": "/a/b/0", "value": 0},
            {"op": "copy", "from": "/a/b", "path": "/c"},
            {"op": "move", "from": "/c", "path": "/d"},
            {"op": "remove", "path": "/a/b/1"},
            {"op": "test", "path": "/d", "value": [0, 2, 3]},
        ],
    )
    assert patched == {"a": {"b": [0, 3]}, "d": [0, 2, 3]}
    assert document == {"a": {"b": [1, 2]}}  # not mutated
    for bad in (
        [{"op": "test", "path": "/a", "value": 1}],
        [{"op": "remove", "path": "/zzz"}],
        [{"op": "replace", "path": "/a/b/9", "value": 1}],
        {"op": "add"},
    ):
        with pytest.raises(patching.PatchError):
            patching.json_patch(document, bad)


def test_strategic_merge_directives() -> None:
    current = {"containers": [{"name": "a", "image": "1"}, {"name": "b", "image": "1"}], "args": ["x", "y"]}
    patch = {
        "containers": [{"name": "b", "$patch": "delete"}, {"name": "c", "image": "2"}],
        "$setElementOrder/containers": [{"name": "c"}, {"name": "a"}],
        "$deleteFromPrimitiveList/args": ["x"],
    }
    assert patching.strategic_merge_patch(current, patch) == {
        "containers": [{"name": "c", "image": "2"}, {"name": "a", "image": "1"}],
        "args": ["y"],
    }


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        (".spec.size", [3]),
        ("{.spec.size}", [3]),
        (".status.conditions[1].type", ["Ready"]),
        ('.status.conditions[?(@.type=="Ready")].status', ["True"]),
        (".status.conditions[*].type", ["Synced", "Ready"]),
        (".spec.missing", []),
    ],
)
def test_json_path_subset(path: str, expected: list[Any]) -> None:
    obj = {
        "spec": {"size": 3},
        "status": {"conditions": [{"type": "Synced", "status": "False"}, {"type": "Ready", "status": "True"}]},
    }
    assert tables.evaluate_json_path(obj, path) == expected


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [
        (5, "5s"),
        (119, "119s"),
        (150, "2m30s"),
        (600, "10m"),
        (3 * 3600 + 60, "3h1m"),
        (30 * 3600, "30h"),
        (3 * 86400, "3d"),
        (20 * 86400, "20d"),
    ],
)
def test_human_duration(seconds: int, expected: str) -> None:
    assert tables.human_duration(seconds) == expected


def test_table_default_and_printer_columns() -> None:
    now = datetime.datetime(2026, 1, 1, 0, 10, tzinfo=datetime.UTC)
    obj = {"metadata": {"name": "w", "creationTimestamp": "2026-01-01T00:00:00Z"}, "spec": {"size": 2}}
    plain = tables.to_table([obj], None, resource_version="1", now=now)
    assert [c["name"] for c in plain["columnDefinitions"]] == ["Name", "Age"]
    assert plain["rows"][0]["cells"] == ["w", "10m"]
    assert plain["rows"][0]["object"]["kind"] == "PartialObjectMetadata"
    info = ResourceInfo(
        group="g",
        version="v1",
        plural="ws",
        kind="W",
        namespaced=True,
        printer_columns=(
            PrinterColumn("Size", "integer", ".spec.size"),
            PrinterColumn("Phase", "string", ".status.phase"),
        ),
    )
    custom = tables.to_table([obj], info, resource_version="1", now=now, include_object="None")
    assert custom["rows"] == [{"cells": ["w", 2, None]}]


def test_wants_table_only_when_table_is_preferred() -> None:
    assert tables.wants_table("application/json;as=Table;v=v1;g=meta.k8s.io,application/json")
    assert not tables.wants_table("application/json")
    assert not tables.wants_table("application/json, application/json;as=Table;v=v1;g=meta.k8s.io")


@pytest.mark.parametrize(
    ("annotations", "ready"),
    [
        ({}, 3),
        ({controllers.READY_ANNOTATION: "false"}, 0),
        ({controllers.READY_REPLICAS_ANNOTATION: "2"}, 2),
        ({controllers.READY_REPLICAS_ANNOTATION: "9"}, 3),
    ],
)
def test_fake_controller_status(annotations: dict[str, str], ready: int) -> None:
    deployment = {
        "kind": "Deployment",
        "metadata": {"generation": 4, "annotations": annotations},
        "spec": {"replicas": 3},
    }
    status = controllers.desired_status(deployment)
    assert status.get("readyReplicas", 0) == ready and status["replicas"] == 3
    assert status["observedGeneration"] == 4
    assert status["conditions"][0]["status"] == ("True" if ready == 3 else "False")


def test_rbac_from_request_log() -> None:
    records = [
        {"user_agent": "kopf/1.45", "group": "apps", "resource": "deployments", "subresource": "", "verb": "watch"},
        {"user_agent": "kopf/1.45", "group": "apps", "resource": "deployments", "subresource": "", "verb": "list"},
        {
            "user_agent": "kopf/1.45",
            "group": "apps",
            "resource": "deployments",
            "subresource": "status",
            "verb": "patch",
        },
        {"user_agent": "kopf/1.45", "group": "", "resource": "", "subresource": "", "verb": "get"},  # discovery
        {"user_agent": "kubectl/v1.37", "group": "", "resource": "pods", "subresource": "", "verb": "delete"},
    ]
    used = rbac.used_permissions(records, user_agent_prefix="kopf")
    assert rbac.as_rules(used) == [
        {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["list", "watch"]},
        {"apiGroups": ["apps"], "resources": ["deployments/status"], "verbs": ["patch"]},
    ]
    role = [{"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["*"]}]
    assert rbac.missing_permissions(used, role) == {rbac.Permission("apps", "deployments/status", "patch")}


spec_fields = st.dictionaries(st.sampled_from(["replicas", "image", "port", "mode"]), st.integers(0, 3), max_size=4)


def _track_all(path: managed_fields.Path) -> bool:
    return managed_fields.track_main_resource(path, has_status_subresource=True)


def _apply(current: dict[str, Any] | None, spec: dict[str, int], manager: str, *, force: bool = False) -> Any:
    return managed_fields.server_side_apply(
        current,
        {"spec": spec},
        manager=manager,
        force=force,
        subresource="",
        api_version="v1",
        now="t",
        tracked=_track_all,
    )


@given(first=spec_fields, second=spec_fields)
def test_reapply_by_one_manager_converges_to_the_last_config(first: dict[str, int], second: dict[str, int]) -> None:
    result = _apply(_apply(None, first, "op"), second, "op")
    assert result.get("spec", {}) == second
    for field in second:
        assert managed_fields.owners_of(result, f"spec.{field}") == ["op"]


@given(config=spec_fields, replicas=st.integers(2, 9))  # a scale to the applied value changes nothing
def test_fields_another_manager_took_survive_the_appliers_omission(config: dict[str, int], replicas: int) -> None:
    applied = _apply(None, {**config, "replicas": 1}, "op")
    scaled = dict(applied, spec={**applied["spec"], "replicas": replicas})
    managed_fields.record_update(
        applied, scaled, manager="hpa", subresource="scale", api_version="v1", now="t", tracked=_track_all
    )
    without_replicas = {key: value for key, value in config.items() if key != "replicas"}
    result = _apply(scaled, without_replicas, "op")
    assert result["spec"]["replicas"] == replicas
    assert managed_fields.owners_of(result, "spec.replicas") == ["hpa"]
