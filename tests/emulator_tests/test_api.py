"""API semantics over HTTP against one emulator subprocess per module (each test in its own namespace)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from testkit.emulator.client import ApiError, EmulatorClient, wait_for

CM = ("v1", "configmaps")
DEPLOY = ("apps/v1", "deployments")
CRD_GROUP = "demo.emulator.io"


def configmap(name: str, namespace: str, **labels: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "data": {"key": "value"},
    }


def deployment(name: str, namespace: str, replicas: int = 2) -> dict[str, Any]:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {"containers": [{"name": "c", "image": "x"}]}},
        },
    }


def widget_crd(plural: str = "widgets", kind: str = "Widget") -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{CRD_GROUP}"},
        "spec": {
            "group": CRD_GROUP,
            "scope": "Namespaced",
            "names": {"plural": plural, "singular": kind.lower(), "kind": kind, "shortNames": [plural[:3]]},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.size",
                            "statusReplicasPath": ".status.size",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": [
                        {"name": "Size", "type": "integer", "jsonPath": ".spec.size"},
                        {
                            "name": "Ready",
                            "type": "string",
                            "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
                        },
                    ],
                }
            ],
        },
    }


@pytest.fixture
def widgets(shared_client: EmulatorClient) -> str:
    if (
        shared_client.get_or_none("apiextensions.k8s.io/v1", "customresourcedefinitions", f"widgets.{CRD_GROUP}")
        is None
    ):
        shared_client.create(widget_crd())
    return f"{CRD_GROUP}/v1"


def test_create_sets_server_metadata_and_answers_201(shared_client: EmulatorClient, fresh_namespace: str) -> None:
    response = shared_client.http.post(
        f"/api/v1/namespaces/{fresh_namespace}/configmaps", json={"metadata": {"name": "a"}, "data": {}}
    )
    assert response.status_code == 201
    created = response.json()
    metadata = created["metadata"]
    assert metadata["namespace"] == fresh_namespace
    assert metadata["uid"] and metadata["creationTimestamp"].endswith("Z")
    assert (created["apiVersion"], created["kind"]) == ("v1", "ConfigMap")
    assert int(metadata["resourceVersion"]) > 0


def test_resource_versions_increase(shared_client: EmulatorClient, fresh_namespace: str) -> None:
    first = shared_client.create(configmap("a", fresh_namespace))
    second = shared_client.patch(*CM, "a", {"data": {"key": "other"}}, namespace=fresh_namespace)
    assert int(second["metadata"]["resourceVersion"]) > int(first["metadata"]["resourceVersion"])


def test_missing_object_is_a_404_status(shared_client: EmulatorClient, fresh_namespace: str) -> None:
    response = shared_client.http.get(f"/api/v1/namespaces/{fresh_namespace}/configmaps/nope")
    assert response.status_code == 404
    body = response.json()
    assert (body["kind"], body["reason"], body["code"]) == ("Status", "NotFound", 404)
    assert body["details"]["name"] == "nope"


def test_duplicate_create_is_409_already_exists(shared_client: EmulatorClient, fresh_namespace: str) -> None:
    shared_client.create(configmap("a", fresh_namespace))
    with pytest.raises(ApiError) as error:
        shared_client.create(configmap("a", fresh_namespace))
    assert (error.value.status_code, error.value.reason) == (409, "AlreadyExists")


def test_stale_resource_version_is_409_conflict(shared_client: EmulatorClient, fresh_namespace: str) -> None:
    created = shared_client.create(configmap("a", fresh_namespace))
    shared_client.patch(*CM, "a", {"data": {"key": "2"}}, namespace=fresh_namespace)
    with pytest.raises(ApiError) as error:
        shared_client.replace(*CM, created)
    assert (error.value.status_code, error.value.reason) == (409, "Conflict")
    with pytest.raises(ApiError) as error:
        shared_client.patch(
            *CM,
            "a",
            {"metadata": {"resourceVersion": created["metadata"]["resourceVersion"]}},
            namespace=fresh_namespace,
        )
    assert error.value.status_code == 409


def test_put_replaces_and_404s_when_missing(shared_client: EmulatorClient, fresh_namespace: str) -> None:
    created = shared_client.create(configmap("a", fresh_namespace))
    created["data"] = {"new": "x"}
    replaced = shared_client.replace(*CM, created)
    assert replaced["data"] == {"new": "x"}
    with pytest.raises(ApiError) as error:
        shared_client.replace(*CM, configmap("missing", fresh_namespace))
    assert error.value.status_code == 404


def test_json_patch_failed_test_is_422(shared_client: EmulatorClient, fresh_namespace: str) -> None:
    shared_client.create(configmap("a", fresh_namespace))
    with pytest.raises(ApiError) as error:
        shared_client.patch(
            *CM,
            "a",
            [{"op": "test", "path": "/data/key", "value": "wrong"}],
            namespace=fresh_namespace,
            patch_type="json",
        )
    assert error.value.status_code == 422
    patched = shared_client.patch(
        *CM,
        "a",
        [{"op": "test", "path": "/data/key", "value": "value"}, {"op": "add", "path": "/data/more", "value": "1"}],
        namespace=fresh_namespace,
        patch_type="json",
    )
    assert patched["data"] == {"key": "value", "more": "1"}


def test_merge_patch_null_deletes(shared_client: EmulatorClient, fresh_namespace: str) -> None:
    shared_client.create(configmap("a", fresh_namespace, tier="x"))
    patched = shared_client.patch(
        *CM, "a", {"metadata": {"labels": {"tier": None, "new": "y"}}}, namespace=fresh_namespace
    )
    assert patched["metadata"]["labels"] == {"new": "y"}


def test_strategic_merge_merges_containers_by_name(shared_client: EmulatorClient, fresh_namespace: str) -> None:
    shared_client.create(deployment("d", fresh_namespace))
    patch = {"spec": {"template": {"spec": {"containers": [{"name": "sidecar", "image": "s"}]}}}}
    patched = shared_client.patch(*DEPLOY, "d", patch, namespace=fresh_namespace, patch_type="strategic")
    names = [c["name"] for c in patched["spec"]["template"]["spec"]["containers"]]
    assert names == ["c", "sidecar"]


def test_generation_bumps_on_spec_changes_only(shared_client: EmulatorClient, fresh_namespace: str) -> None:
    created = shared_client.create(deployment("d", fresh_namespace))
    assert created["metadata"]["generation"] == 1
    labelled = shared_client.patch(*DEPLOY, "d", {"metadata": {"labels": {"a": "b"}}}, namespace=fresh_namespace)
    assert labelled["metadata"]["generation"] == 1
    status = shared_client.patch(
        *DEPLOY, "d", {"status": {"observedGeneration": 1}}, namespace=fresh_namespace, subresource="status"
    )
    assert status["metadata"]["generation"] == 1
    assert int(status["metadata"]["resourceVersion"]) > int(labelled["metadata"]["resourceVersion"])
    scaled = shared_client.patch(*DEPLOY, "d", {"spec": {"replicas": 5}}, namespace=fresh_namespace)
    assert scaled["metadata"]["generation"] == 2


def test_status_subresource_separates_status(shared_client: EmulatorClient, fresh_namespace: str, widgets: str) -> None:
    shared_client.create(
        {
            "apiVersion": widgets,
            "kind": "Widget",
            "metadata": {"name": "w", "namespace": fresh_namespace},
            "spec": {"size": 1},
            "status": {"ignored": True},
        }
    )
    found = shared_client.get(widgets, "widgets", "w", namespace=fresh_namespace)
    assert "status" not in found  # dropped on create: the CRD has a status subresource
    shared_client.patch(
        widgets,
        "widgets",
        "w",
        {"status": {"phase": "Ok"}, "spec": {"size": 9}},
        namespace=fresh_namespace,
        subresource="status",
    )
    found = shared_client.get(widgets, "widgets", "w", namespace=fresh_namespace)
    assert found["status"] == {"phase": "Ok"} and found["spec"]["size"] == 1
    main = shared_client.patch(widgets, "widgets", "w", {"status": {"phase": "Hacked"}}, namespace=fresh_namespace)
    assert main["status"] == {"phase": "Ok"}


def test_scale_subresource_of_deployment(shared_client: EmulatorClient, fresh_namespace: str) -> None:
    shared_client.create(deployment("d", fresh_namespace, replicas=2))
    scale = shared_client.get(*DEPLOY, "d", namespace=fresh_namespace, subresource="scale")
    assert (scale["kind"], scale["apiVersion"], scale["spec"]["replicas"]) == ("Scale", "autoscaling/v1", 2)
    assert scale["status"]["selector"] == "app=d"
    shared_client.patch(*DEPLOY, "d", {"spec": {"replicas": 4}}, namespace=fresh_namespace, subresource="scale")
    assert shared_client.get(*DEPLOY, "d", namespace=fresh_namespace)["spec"]["replicas"] == 4


def test_scale_subresource_of_custom_resource(
    shared_client: EmulatorClient, fresh_namespace: str, widgets: str
) -> None:
    shared_client.create(
        {
            "apiVersion": widgets,
            "kind": "Widget",
            "metadata": {"name": "w", "namespace": fresh_namespace},
            "spec": {"size": 1},
        }
    )
    shared_client.patch(
        widgets,
        "widgets",
        "w",
        {"status": {"size": 1, "selector": "app=w"}},
        namespace=fresh_namespace,
        subresource="status",
    )
    scale = shared_client.get(widgets, "widgets", "w", namespace=fresh_namespace, subresource="scale")
    assert scale["spec"]["replicas"] == 1 and scale["status"] == {"replicas": 1, "selector": "app=w"}
    scale["spec"]["replicas"] = 3
    shared_client.request("PUT", f"/apis/{widgets}/namespaces/{fresh_namespace}/widgets/w/scale", json=scale)
    assert shared_client.get(widgets, "widgets", "w", namespace=fresh_namespace)["spec"]["size"] == 3


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("tier=web", ["a"]),
        ("tier!=web", ["b", "c"]),
        ("tier in (web,db)", ["a", "b"]),
        ("tier notin (web)", ["b", "c"]),
        ("tier", ["a", "b"]),
        ("!tier", ["c"]),
        ("tier=db,zone=z1", ["b"]),
    ],
)
def test_label_selectors(
    shared_client: EmulatorClient, fresh_namespace: str, selector: str, expected: list[str]
) -> None:
    shared_client.create(configmap("a", fresh_namespace, tier="web"))
    shared_client.create(configmap("b", fresh_namespace, tier="db", zone="z1"))
    shared_client.create(configmap("c", fresh_namespace))
    found = shared_client.list(*CM, namespace=fresh_namespace, label_selector=selector)
    assert sorted(obj["metadata"]["name"] for obj in found) == expected


def test_field_selectors_and_cluster_wide_list(shared_client: EmulatorClient, fresh_namespace: str) -> None:
    shared_client.create(configmap("a", fresh_namespace))
    shared_client.create(configmap("b", fresh_namespace))
    by_name = shared_client.list(*CM, field_selector="metadata.name=a")
    assert [
        (o["metadata"]["namespace"], o["metadata"]["name"])
        for o in by_name
        if o["metadata"]["namespace"] == fresh_namespace
    ] == [(fresh_namespace, "a")]
    in_namespace = shared_client.list(*CM, field_selector=f"metadata.namespace={fresh_namespace},metadata.name!=a")
    assert [o["metadata"]["name"] for o in in_namespace] == ["b"]


def test_list_has_resource_version(shared_client: EmulatorClient, fresh_namespace: str) -> None:
    body = shared_client.request("GET", f"/api/v1/namespaces/{fresh_namespace}/configmaps")
    assert body["kind"] == "ConfigMapList" and int(body["metadata"]["resourceVersion"]) > 0


def test_finalizers_delay_deletion(shared_client: EmulatorClient, fresh_namespace: str) -> None:
    obj = configmap("a", fresh_namespace)
    obj["metadata"]["finalizers"] = ["example.com/hold"]
    shared_client.create(obj)
    deleting = shared_client.delete(*CM, "a", namespace=fresh_namespace)
    assert deleting["metadata"]["deletionTimestamp"]
    assert shared_client.get_or_none(*CM, "a", namespace=fresh_namespace) is not None
    shared_client.patch(*CM, "a", {"metadata": {"finalizers": None}}, namespace=fresh_namespace)
    assert shared_client.get_or_none(*CM, "a", namespace=fresh_namespace) is None


def test_owner_garbage_collection_cascades(shared_client: EmulatorClient, fresh_namespace: str) -> None:
    owner = shared_client.create(configmap("owner", fresh_namespace))

    def owned_by(parent: dict[str, Any], name: str) -> dict[str, Any]:
        child = configmap(name, fresh_namespace)
        child["metadata"]["ownerReferences"] = [
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "name": parent["metadata"]["name"],
                "uid": parent["metadata"]["uid"],
            }
        ]
        return shared_client.create(child)

    child = owned_by(owner, "child")
    owned_by(child, "grandchild")
    shared_client.create(configmap("bystander", fresh_namespace))
    shared_client.delete(*CM, "owner", namespace=fresh_namespace)
    names = sorted(o["metadata"]["name"] for o in shared_client.list(*CM, namespace=fresh_namespace))
    assert names == ["bystander"]


def test_orphan_propagation_keeps_dependents(shared_client: EmulatorClient, fresh_namespace: str) -> None:
    owner = shared_client.create(configmap("owner", fresh_namespace))
    child = configmap("child", fresh_namespace)
    child["metadata"]["ownerReferences"] = [
        {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"]}
    ]
    shared_client.create(child)
    shared_client.delete(*CM, "owner", namespace=fresh_namespace, propagation="Orphan")
    kept = shared_client.get(*CM, "child", namespace=fresh_namespace)
    assert kept["metadata"]["ownerReferences"] == []


def test_crd_registers_discovery(shared_client: EmulatorClient, widgets: str) -> None:
    groups = shared_client.request("GET", "/apis")["groups"]
    assert CRD_GROUP in [group["name"] for group in groups]
    resources = shared_client.request("GET", f"/apis/{widgets}")["resources"]
    by_name = {resource["name"]: resource for resource in resources}
    assert by_name["widgets"]["shortNames"] == ["wid"] and by_name["widgets"]["namespaced"] is True
    assert {"widgets/status", "widgets/scale"} <= set(by_name)


def test_deleting_a_crd_unregisters_it(shared_client: EmulatorClient) -> None:
    shared_client.create(widget_crd("gadgets", "Gadget"))
    assert shared_client.request("GET", f"/apis/{CRD_GROUP}/v1")
    shared_client.delete("apiextensions.k8s.io/v1", "customresourcedefinitions", f"gadgets.{CRD_GROUP}")
    names = [r["name"] for r in shared_client.request("GET", f"/apis/{CRD_GROUP}/v1")["resources"]]
    assert "gadgets" not in names


def test_builtin_discovery(shared_client: EmulatorClient) -> None:
    expected = {
        "/api/v1": {
            "pods",
            "services",
            "endpoints",
            "serviceaccounts",
            "secrets",
            "configmaps",
            "persistentvolumeclaims",
            "events",
            "namespaces",
        },
        "/apis/apps/v1": {"deployments", "statefulsets", "deployments/scale"},
        "/apis/policy/v1": {"poddisruptionbudgets"},
        "/apis/networking.k8s.io/v1": {"networkpolicies"},
        "/apis/rbac.authorization.k8s.io/v1": {"roles", "rolebindings"},
        "/apis/discovery.k8s.io/v1": {"endpointslices"},
        "/apis/autoscaling/v2": {"horizontalpodautoscalers"},
        "/apis/coordination.k8s.io/v1": {"leases"},
        "/apis/events.k8s.io/v1": {"events"},
        "/apis/monitoring.coreos.com/v1": {"servicemonitors", "podmonitors"},
        "/apis/keda.sh/v1alpha1": {"scaledobjects"},
        "/apis/inference.networking.k8s.io/v1": {"inferencepools"},
        "/apis/gateway.networking.k8s.io/v1": {"httproutes"},
        "/apis/kopf.dev/v1": {"kopfpeerings", "clusterkopfpeerings"},
    }
    for path, names in expected.items():
        served = {resource["name"] for resource in shared_client.request("GET", path)["resources"]}
        assert names <= served, path
    assert shared_client.request("GET", "/version")["minor"] == "37"


def test_generate_name(shared_client: EmulatorClient, fresh_namespace: str) -> None:
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"generateName": "gen-", "namespace": fresh_namespace}}
    first, second = shared_client.create(body), shared_client.create(body)
    assert first["metadata"]["name"].startswith("gen-")
    assert first["metadata"]["name"] != second["metadata"]["name"]


def test_delete_collection_with_selector(shared_client: EmulatorClient, fresh_namespace: str) -> None:
    shared_client.create(configmap("a", fresh_namespace, drop="yes"))
    shared_client.create(configmap("b", fresh_namespace))
    shared_client.request(
        "DELETE", f"/api/v1/namespaces/{fresh_namespace}/configmaps", params={"labelSelector": "drop=yes"}
    )
    assert [o["metadata"]["name"] for o in shared_client.list(*CM, namespace=fresh_namespace)] == ["b"]


def fresh_namespaces_must_exist_and_deleting_one_empties_it(shared_client: EmulatorClient) -> None:
    with pytest.raises(ApiError) as error:
        shared_client.create(configmap("a", "does-not-exist"))
    assert error.value.status_code == 404
    shared_client.create_namespace("doomed")
    shared_client.create(configmap("a", "doomed"))
    shared_client.delete("v1", "namespaces", "doomed")
    assert shared_client.list(*CM, namespace="doomed") == []


def test_events_are_accepted(shared_client: EmulatorClient, fresh_namespace: str) -> None:
    core = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": "e-", "namespace": fresh_namespace},
        "reason": "Test",
        "message": "hello",
        "involvedObject": {"kind": "ConfigMap", "name": "a"},
    }
    shared_client.create(core)
    modern = {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {"generateName": "e-", "namespace": fresh_namespace},
        "reason": "Test",
        "note": "hi",
        "eventTime": "2026-01-01T00:00:00.000000Z",
        "reportingController": "x",
        "reportingInstance": "y",
        "action": "Testing",
    }
    shared_client.create(modern)
    assert len(shared_client.list("v1", "events", namespace=fresh_namespace)) == 1
    assert len(shared_client.list("events.k8s.io/v1", "events", namespace=fresh_namespace)) == 1


def test_request_log_records_verbs(shared_client: EmulatorClient, fresh_namespace: str) -> None:
    shared_client.clear_requests_log()
    shared_client.create(configmap("a", fresh_namespace))
    shared_client.list(*CM, namespace=fresh_namespace)
    shared_client.delete(*CM, "a", namespace=fresh_namespace)
    log = [
        (r["verb"], r["resource"], r["namespace"])
        for r in shared_client.requests_log()
        if r["resource"] == "configmaps"
    ]
    assert log == [
        ("create", "configmaps", fresh_namespace),
        ("list", "configmaps", fresh_namespace),
        ("delete", "configmaps", fresh_namespace),
    ]
    assert all(r["user_agent"].startswith("emulator-test-client") for r in shared_client.requests_log())


def test_table_for_crd_printer_columns(shared_client: EmulatorClient, fresh_namespace: str, widgets: str) -> None:
    shared_client.create(
        {
            "apiVersion": widgets,
            "kind": "Widget",
            "metadata": {"name": "w", "namespace": fresh_namespace},
            "spec": {"size": 3},
        }
    )
    shared_client.patch(
        widgets,
        "widgets",
        "w",
        {"status": {"conditions": [{"type": "Other", "status": "False"}, {"type": "Ready", "status": "True"}]}},
        namespace=fresh_namespace,
        subresource="status",
    )
    table = shared_client.request(
        "GET",
        f"/apis/{widgets}/namespaces/{fresh_namespace}/widgets",
        headers={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"},
    )
    assert table["kind"] == "Table"
    assert [c["name"] for c in table["columnDefinitions"]] == ["Name", "Size", "Ready"]
    assert table["rows"][0]["cells"] == ["w", 3, "True"]


def test_deployments_get_status_from_fake_controllers(shared_client: EmulatorClient, fresh_namespace: str) -> None:
    shared_client.create(deployment("ready", fresh_namespace, replicas=3))
    held = deployment("held", fresh_namespace, replicas=2)
    held["metadata"]["annotations"] = {"emulator.splitserve.io/ready": "false"}
    shared_client.create(held)

    def status_of(name: str) -> dict[str, Any]:
        return dict(shared_client.get(*DEPLOY, name, namespace=fresh_namespace).get("status") or {})

    ready = wait_for(lambda: status_of("ready").get("readyReplicas") == 3 and status_of("ready"))
    assert ready["availableReplicas"] == 3 and ready["observedGeneration"] == 1
    held_status = wait_for(lambda: status_of("held").get("replicas") == 2 and status_of("held"))
    assert held_status.get("readyReplicas", 0) == 0


def test_server_side_apply_creates_and_tracks_owners(shared_client: EmulatorClient, fresh_namespace: str) -> None:
    response = shared_client.http.patch(
        f"/apis/apps/v1/namespaces/{fresh_namespace}/deployments/d",
        params={"fieldManager": "operator"},
        content=yaml.safe_dump(deployment("d", fresh_namespace)).encode(),
        headers={"Content-Type": "application/apply-patch+yaml"},
    )
    assert response.status_code == 201
    managers = {e["manager"]: e for e in response.json()["metadata"]["managedFields"]}
    assert managers["operator"]["operation"] == "Apply"
    assert "f:replicas" in managers["operator"]["fieldsV1"]["f:spec"]


def test_watch_resumes_from_resource_version(shared_client: EmulatorClient, fresh_namespace: str) -> None:
    first = shared_client.create(configmap("a", fresh_namespace))
    shared_client.create(configmap("b", fresh_namespace))
    shared_client.patch(*CM, "a", {"data": {"x": "y"}}, namespace=fresh_namespace)
    with shared_client.http.stream(
        "GET",
        f"/api/v1/namespaces/{fresh_namespace}/configmaps",
        params={"watch": "true", "resourceVersion": first["metadata"]["resourceVersion"], "timeoutSeconds": "1"},
    ) as response:
        assert response.headers["content-type"].startswith("application/json")
        events = [json.loads(line) for line in response.iter_lines() if line]
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "b"), ("MODIFIED", "a")]


def test_watch_with_old_resource_version_is_410(shared_client: EmulatorClient, fresh_namespace: str) -> None:
    first = shared_client.create(configmap("a", fresh_namespace))
    shared_client.patch(*CM, "a", {"data": {"x": "y"}}, namespace=fresh_namespace)
    shared_client.compact()

    with shared_client.http.stream(
        "GET",
        f"/api/v1/namespaces/{fresh_namespace}/configmaps",
        params={"watch": "true", "resourceVersion": first["metadata"]["resourceVersion"], "timeoutSeconds": "1"},
    ) as response:
        events = [json.loads(line) for line in response.iter_lines() if line]
    assert events[0]["type"] == "ERROR" and events[0]["object"]["code"] == 410
