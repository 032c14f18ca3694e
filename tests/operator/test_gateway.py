"""spec.gateway (Gateway API Inference Extension): the InferencePool, the endpoint picker and its Service,
RBAC, PDB, NetworkPolicy and monitor, the decode pods' pd-sidecar, the HTTPRoute; in both modes, checked
against upstream schemas (vendored CRDs for InferencePool and HTTPRoute); the CEL rules that reject what
cannot work; the operator's prune when the block goes; render and diff."""

from __future__ import annotations

import argparse
import copy
import io
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import yaml

from splitserve.api.spec import PD_SIDECAR_PORT
from splitserve.api.topology import LABEL_DEPLOYMENT, LABEL_GENERATION, LABEL_ROLE
from splitserve.builders.bundle import build_children
from splitserve.commands import diff as diff_command
from splitserve.commands import render as render_command
from splitserve.controller.plan import plan_prune, stale_pd_sidecar_ops
from splitserve.validation import validate_object
from splitserve.validation.advice import object_advice
from tests.operator.fake_cluster import FakeCluster
from tests.operator.helpers import AGGREGATED, REPO, assert_valid_kubernetes, load, minimal
from tests.operator.test_builders import _by_name, _container, _option, _worker, target_of
from tests.operator.test_plan import OWNER, cluster_for, desired, spec_of
from tests.operator.test_reconcile_calls import (
    NAMESPACE,
    decode_pool,
    deployment,
    owner_of,
    reconciler_for,
    watch_catches_up,
)
from tests.operator.upstream_crds import upstream_problems

EXAMPLE = REPO / "deploy" / "examples" / "gateway-disaggregated.yaml"
ROUTE = {
    "parentRefs": [{"name": "gw", "namespace": "gateway-ns", "sectionName": "http"}],
    "hostnames": ["llm.example.com"],
}
GATEWAY_KINDS = {"InferencePool", "HTTPRoute"}


def gateway_doc(mode: str = "disaggregated", **gateway: Any) -> dict[str, Any]:
    spec: dict[str, Any] = AGGREGATED if mode == "aggregated" else {}
    return minimal(**spec, gateway=gateway)


def epp(children: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return _container(children["Deployment/demo-epp"])


def sidecar(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["initContainers"]
    assert container["name"] == "pd-sidecar"
    return dict(container)


# --------------------------------------------------------------------------- what is rendered


def test_without_gateway_nothing_of_it_is_rendered() -> None:
    children = _by_name(minimal())
    assert not [key for key in children if key.split("/")[0] in GATEWAY_KINDS or "epp" in key or "sidecar" in key]
    assert "initContainers" not in _worker(children, "decode")["spec"]["template"]["spec"]


@pytest.mark.parametrize(
    ("mode", "role", "port"), [("disaggregated", "decode", PD_SIDECAR_PORT), ("aggregated", "aggregated", 8100)]
)
def test_inference_pool_selects_the_pods_that_serve_and_names_the_picker(mode: str, role: str, port: int) -> None:
    doc = gateway_doc(mode, failureMode="FailOpen", endpointPicker={"port": 9100})
    doc["spec"]["engine"] = {"port": 8100}
    children = _by_name(doc)  # every object validated, InferencePool against its upstream CRD
    pool = children["InferencePool/demo"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"] == {
        "selector": {"matchLabels": {LABEL_DEPLOYMENT: "demo", LABEL_ROLE: role}},
        "targetPorts": [{"number": port}],
        "appProtocol": "http",
        "endpointPickerRef": {
            "group": "",
            "kind": "Service",
            "name": "demo-epp",
            "port": {"number": 9100},
            "failureMode": "FailOpen",
        },
    }
    # The selector matches the serving pods' own labels, and the picker's Service has that port.
    template = _worker(children, role)["spec"]["template"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    service_ports = {p["port"]: p for p in children["Service/demo-epp"]["spec"]["ports"]}
    assert service_ports[9100]["name"] == "grpc" and service_ports[9100]["appProtocol"] == "kubernetes.io/h2c"
    # The pool's target port is a port the selected pods really listen on.
    pod = template["spec"]
    listening = {p["containerPort"] for c in [*pod["containers"], *pod.get("initContainers", [])] for p in c["ports"]}
    assert port in listening


@pytest.mark.parametrize("mode", ["disaggregated", "aggregated"])
def test_picker_gets_the_routers_flags_plus_its_ports(mode: str) -> None:
    doc = gateway_doc(mode, endpointPicker={"port": 9002, "metricsPort": 9091})
    doc["spec"]["router"] = {
        "routingPolicy": {"prefill": "round-robin", "decode": "kv-aware"},
        "disaggregationThresholdTokens": 77,
        "timeouts": {"prefillSeconds": 33},
    }
    children = _by_name(doc)
    args = epp(children)["args"]
    router = _container(children["Deployment/demo-router"])["args"]
    assert args[0] == "epp" and router[0] == "router"
    # The same flags as the router, but for the HTTP port and its process count, plus the picker's own.
    mirrored = [a for a in router[1:] if not a.startswith(("--port=", "--workers="))]
    assert [a for a in args[1:] if not a.startswith(("--port=", "--grpc-port=", "--target-port="))] == mirrored
    assert (_option(args, "--port"), _option(args, "--grpc-port")) == ("9091", "9002")
    assert _option(args, "--target-port") == ("8200" if mode == "disaggregated" else "8000")
    assert ("--no-prefill-pool" in args) == (mode == "aggregated")
    assert (_option(args, "--prefill-policy"), _option(args, "--decode-policy")) == ("round-robin", "kv-aware")
    assert (_option(args, "--disagg-threshold-tokens"), _option(args, "--model")) == ("77", "m")
    assert (_option(args, "--discovery"), _option(args, "--deployment"), _option(args, "--namespace")) == (
        "pods",
        "demo",
        "ns",
    )


def test_picker_reads_the_tokenizer_from_the_claim_like_the_router() -> None:
    model = {"name": "m", "source": {"pvc": {"claimName": "weights", "path": "/llama"}}}
    children = _by_name(minimal(model=model, router={"routingPolicy": {"decode": "precise-prefix"}}, gateway={}))
    picker = children["Deployment/demo-epp"]["spec"]["template"]["spec"]
    router = children["Deployment/demo-router"]["spec"]["template"]["spec"]
    assert _option(picker["containers"][0]["args"], "--tokenizer") == "/models/llama"
    assert picker["volumes"] == router["volumes"]
    assert picker["containers"][0]["volumeMounts"] == router["containers"][0]["volumeMounts"]


def test_picker_pod_probes_ports_account_and_budget() -> None:
    children = _by_name(gateway_doc(endpointPicker={"replicas": 2, "cpu": "2", "memory": "2Gi"}))
    deployment = children["Deployment/demo-epp"]
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == _container(children["Deployment/demo-router"])["image"]
    assert container["readinessProbe"]["grpc"] == {"port": 9002, "service": "readiness"}
    assert container["livenessProbe"]["grpc"] == {"port": 9002, "service": "liveness"}
    assert container["ports"] == [
        {"name": "grpc", "containerPort": 9002, "protocol": "TCP"},
        {"name": "http-metrics", "containerPort": 9090, "protocol": "TCP"},
    ]
    assert container["resources"] == {"requests": {"cpu": "2", "memory": "2Gi"}, "limits": {"memory": "2Gi"}}
    assert pod["serviceAccountName"] == "demo-epp"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert children["Service/demo-epp"]["spec"]["selector"].items() <= labels.items()
    assert children["PodDisruptionBudget/demo-epp"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert children["Role/demo-epp"]["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    binding = children["RoleBinding/demo-epp"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "demo-epp", "namespace": "ns"}]
    assert binding["roleRef"]["name"] == "demo-epp"


def test_decode_pods_carry_the_pd_sidecar_as_a_native_sidecar() -> None:
    doc = gateway_doc(sidecar={"cpu": "2", "memory": "1Gi"})
    doc["spec"]["engine"] = {"port": 8100}
    doc["spec"]["decode"] = {"terminationGracePeriodSeconds": 120}
    children = _by_name(doc)
    decode = _worker(children, "decode")
    container = sidecar(decode)
    assert container["restartPolicy"] == "Always"
    assert container["args"][:8] == [
        "sidecar",
        f"--port={PD_SIDECAR_PORT}",
        "--local=http://127.0.0.1:8100",
        "--discovery=pods",
        "--deployment=demo",
        "--namespace=ns",
        "--worker-port=8100",
        "--generation=$(SPLITSERVE_GENERATION)",
    ]
    assert _option(container["args"], "--prefill-timeout") == "120"
    # $(SPLITSERVE_GENERATION) is the pod's own generation label, which the template really carries.
    (env,) = container["env"]
    assert env == {
        "name": "SPLITSERVE_GENERATION",
        "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{LABEL_GENERATION}']"}},
    }
    template = decode["spec"]["template"]
    assert template["metadata"]["labels"][LABEL_GENERATION] == target_of(doc).generation
    assert container["ports"] == [{"name": "pd-proxy", "containerPort": PD_SIDECAR_PORT, "protocol": "TCP"}]
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "pd-proxy"}
    assert container["resources"] == {"requests": {"cpu": "2", "memory": "1Gi"}, "limits": {"memory": "1Gi"}}
    # It reads the Pods with an account of its own; the pod's grace covers the engine, then its drain.
    pod = template["spec"]
    assert pod["serviceAccountName"] == "demo-decode-sidecar"
    assert children["Role/demo-decode-sidecar"]["rules"][0]["resources"] == ["pods"]
    assert pod["terminationGracePeriodSeconds"] == 120 + int(_option(container["args"], "--drain-seconds") or 0)
    assert _option(container["args"], "--drain-seconds") == "30"
    # Prefill pods are untouched.
    prefill = _worker(children, "prefill")["spec"]["template"]["spec"]
    assert "initContainers" not in prefill and "serviceAccountName" not in prefill


def test_aggregated_mode_has_no_sidecar_and_no_sidecar_account() -> None:
    children = _by_name(gateway_doc("aggregated"))
    pod = _worker(children, "aggregated")["spec"]["template"]["spec"]
    assert "initContainers" not in pod and "serviceAccountName" not in pod
    assert "ServiceAccount/demo-decode-sidecar" not in children
    assert "ServiceAccount/demo-epp" in children


@pytest.mark.parametrize(("mode", "rolled"), [("disaggregated", {"decode"}), ("aggregated", set())])
def test_turning_the_gateway_on_rolls_decode_pods_only_and_keeps_the_generation(mode: str, rolled: set[str]) -> None:
    before, after = (minimal(**(AGGREGATED if mode == "aggregated" else {})), gateway_doc(mode))
    assert target_of(before).generation == target_of(after).generation
    old, new = _by_name(before), _by_name(after)
    templates = {
        key: (old[key]["spec"]["template"], new[key]["spec"]["template"])
        for key in old
        if key.startswith("Deployment/")
    }
    assert {key.split("-")[1] for key, (a, b) in templates.items() if a != b} == rolled
    # The router stays the default front: rendered, and unchanged.
    assert old["Deployment/demo-router"] == new["Deployment/demo-router"]


def test_http_route_sends_every_path_of_its_hosts_to_the_pool() -> None:
    children = _by_name(gateway_doc(httpRoute=ROUTE))
    route = children["HTTPRoute/demo"]
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"] == {
        "parentRefs": [{"name": "gw", "namespace": "gateway-ns", "sectionName": "http"}],
        "hostnames": ["llm.example.com"],
        "rules": [
            {
                "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                "backendRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "demo"}],
            }
        ],
    }
    assert "HTTPRoute/demo" not in _by_name(gateway_doc())


def test_monitoring_scrapes_the_picker_and_the_worker_monitor_leaves_it_out() -> None:
    doc = gateway_doc()
    doc["spec"]["monitoring"] = {"enabled": True}
    children = _by_name(doc)
    monitor = children["ServiceMonitor/demo-epp"]
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= children["Service/demo-epp"]["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("http-metrics", "/metrics")
    excluded = children["PodMonitor/demo-workers"]["spec"]["selector"]["matchExpressions"][0]
    assert excluded == {"key": LABEL_ROLE, "operator": "NotIn", "values": ["router", "epp"]}


# --------------------------------------------------------------------------- network policies


def _rules_by_port(policy: dict[str, Any]) -> dict[Any, list[dict[str, Any]]]:
    rules: dict[Any, list[dict[str, Any]]] = {}
    for rule in policy["spec"]["ingress"]:
        for port in rule["ports"]:
            rules.setdefault(port["port"], []).extend(rule["from"])
    return rules


ROUTER_PODS = {"podSelector": {"matchLabels": {LABEL_DEPLOYMENT: "demo", LABEL_ROLE: "router"}}}
EPP_PODS = {"podSelector": {"matchLabels": {LABEL_DEPLOYMENT: "demo", LABEL_ROLE: "epp"}}}
DECODE_PODS = {"podSelector": {"matchLabels": {LABEL_DEPLOYMENT: "demo", LABEL_ROLE: "decode"}}}
GATEWAY_PODS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway-ns"}}}


def test_network_policy_disaggregated() -> None:
    doc = gateway_doc(allowedFrom=[GATEWAY_PODS])
    doc["spec"]["router"] = {"routingPolicy": {"prefill": "precise-prefix"}}
    children = _by_name(doc)
    rules = _rules_by_port(children["NetworkPolicy/demo-workers"])
    # The pickers poll the engines and follow their KV events; the decode pods' sidecars run prefill legs.
    assert ROUTER_PODS in rules["http"] and EPP_PODS in rules["http"] and DECODE_PODS in rules["http"]
    assert rules["kv-events"] == [ROUTER_PODS, EPP_PODS]
    # Only the Gateway's pods reach the sidecar port, which only decode pods declare; not the engines.
    assert rules["pd-proxy"] == [GATEWAY_PODS]
    assert GATEWAY_PODS not in rules["http"]
    picker = _rules_by_port(children["NetworkPolicy/demo-epp"])
    assert picker["grpc"] == [GATEWAY_PODS]
    assert [peer["podSelector"] for peer in picker["http-metrics"]] == [
        {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}
    ]
    assert children["NetworkPolicy/demo-epp"]["spec"]["podSelector"] == EPP_PODS["podSelector"]


def test_network_policy_aggregated_admits_the_gateway_to_the_engines() -> None:
    children = _by_name(gateway_doc("aggregated"))
    rules = _rules_by_port(children["NetworkPolicy/demo-workers"])
    anywhere = {"namespaceSelector": {}}  # allowedFrom unset: the Gateway's pods may be in any namespace
    assert anywhere in rules["http"] and EPP_PODS in rules["http"]
    assert "pd-proxy" not in rules and DECODE_PODS not in rules["http"]


# --------------------------------------------------------------------------- upstream schemas, examples


def test_upstream_crds_reject_what_their_api_server_would() -> None:
    pool = _by_name(gateway_doc(httpRoute=ROUTE))["InferencePool/demo"]
    assert upstream_problems(pool) == []
    broken = copy.deepcopy(pool)
    del broken["spec"]["endpointPickerRef"]["port"]
    broken["spec"]["targetPorts"] = [{"number": 8200}, {"number": 8200}]
    problems = upstream_problems(broken)
    assert any("port is required when kind is 'Service'" in p for p in problems), problems
    assert any("port number must be unique" in p for p in problems), problems
    unknown = copy.deepcopy(pool)
    unknown["spec"]["endpointPickerRef"]["failureMod"] = "FailOpen"
    assert any("'failureMod' was unexpected" in p for p in upstream_problems(unknown))
    route = _by_name(gateway_doc(httpRoute=ROUTE))["HTTPRoute/demo"]
    service_without_port = copy.deepcopy(route)
    service_without_port["spec"]["rules"][0]["backendRefs"] = [{"name": "demo-router"}]  # kind Service by default
    assert any("Must have port for Service reference" in p for p in upstream_problems(service_without_port))


def test_example_renders_every_gateway_object_valid() -> None:
    doc = load(EXAMPLE)
    assert validate_object(doc) == []
    children = build_children(target_of(doc))
    kinds = {child["kind"] for child in children}
    assert {"InferencePool", "HTTPRoute", "ServiceMonitor"} <= kinds
    for child in children:
        assert_valid_kubernetes(child)


# --------------------------------------------------------------------------- CEL and schema rejections

# Joined to test_validation.INVALID, whose test asserts each one's path and message.
GATEWAY_INVALID: list[tuple[str, dict[str, Any], str, str]] = [
    ("route without parentRefs", {"gateway": {"httpRoute": {}}}, "spec.gateway.httpRoute.parentRefs",
     "needs at least one entry in parentRefs"),
    ("route with empty parentRefs", {"gateway": {"httpRoute": {"parentRefs": []}}},
     "spec.gateway.httpRoute.parentRefs", "needs at least one entry in parentRefs"),
    ("same listener twice",
     {"gateway": {"httpRoute": {"parentRefs": [{"name": "gw", "sectionName": "a"}] * 2}}},
     "spec.gateway.httpRoute.parentRefs", "lists the same Gateway listener twice"),
    ("duplicate hostnames",
     {"gateway": {"httpRoute": {"parentRefs": [{"name": "gw"}], "hostnames": ["a.example", "a.example"]}}},
     "spec.gateway.httpRoute.hostnames", "lists a hostname twice"),
    ("bad hostname", {"gateway": {"httpRoute": {"parentRefs": [{"name": "gw"}], "hostnames": ["A_B"]}}},
     "spec.gateway.httpRoute.hostnames[0]", "does not match"),
    ("unknown failure mode", {"gateway": {"failureMode": "FailSafe"}}, "spec.gateway.failureMode", "is not one of"),
    ("no picker and fail close", {"gateway": {"endpointPicker": {"replicas": 0}}},
     "spec.gateway.endpointPicker.replicas", "fails every request through the Gateway"),
    ("picker ports clash", {"gateway": {"endpointPicker": {"port": 9090}}},
     "spec.gateway.endpointPicker.metricsPort", "must differ from gateway.endpointPicker.port"),
    ("engine on the sidecar port", {"engine": {"port": PD_SIDECAR_PORT}, "gateway": {}}, "spec.gateway",
     f"pd-sidecar listens on port {PD_SIDECAR_PORT}"),
    ("side channel on the sidecar port", {"kvTransfer": {"sideChannelPort": PD_SIDECAR_PORT}, "gateway": {}},
     "spec.gateway", "kvTransfer.sideChannelPort"),
    ("kv events of decode on the sidecar port",
     {"engine": {"kvEventsPort": PD_SIDECAR_PORT}, "router": {"routingPolicy": {"decode": "precise-prefix"}},
      "gateway": {}}, "spec.gateway", "engine.kvEventsPort must differ from it"),
    ("unknown gateway field", {"gateway": {"inferencePol": {}}}, "spec.gateway", "unknown field(s): 'inferencePol'"),
]  # fmt: skip


@pytest.mark.parametrize(
    "overrides",
    [
        {"gateway": {}},
        {"gateway": {"endpointPicker": {"replicas": 0}, "failureMode": "FailOpen"}},
        # Aggregated pods have no sidecar: the engine may use its port.
        {**AGGREGATED, "engine": {"port": PD_SIDECAR_PORT}, "gateway": {"httpRoute": ROUTE}},
        # kvEventsPort is only opened where a pool publishes events (decode is not precise-prefix here).
        {"engine": {"kvEventsPort": PD_SIDECAR_PORT}, "gateway": {}},
        {
            "gateway": {
                "httpRoute": {"parentRefs": [{"name": "gw", "sectionName": "a"}, {"name": "gw", "sectionName": "b"}]}
            }
        },
    ],
)
def test_workable_gateway_specs_are_accepted(overrides: dict[str, Any]) -> None:
    assert validate_object(minimal(**overrides)) == []


def test_scale_to_zero_behind_the_gateway_is_warned_about() -> None:
    doc = minimal(gateway={}, autoscaling={"enabled": True}, decode={"minReplicas": 0})
    assert validate_object(doc) == []  # accepted: the router still serves it
    (warning,) = [w for w in object_advice(doc) if w.path == "spec.decode.minReplicas"]
    assert "requests through the Gateway fail" in warning.message
    assert not [w for w in object_advice(minimal(autoscaling={"enabled": True}, decode={"minReplicas": 0}))
                if w.path == "spec.decode.minReplicas"]  # fmt: skip


# --------------------------------------------------------------------------- the operator's reconcile


def test_removing_the_gateway_prunes_exactly_its_children() -> None:
    with_gateway = spec_of(gateway={"httpRoute": ROUTE})
    cluster = dict(cluster_for(with_gateway))
    pruned = plan_prune(
        cluster, {(c["apiVersion"], c["kind"], c["metadata"]["name"]) for c in desired(spec_of())}, OWNER
    )
    assert sorted(f"{o['kind']}/{o['metadata']['name']}" for o in pruned) == [
        "Deployment/demo-epp",
        "HTTPRoute/demo",
        "InferencePool/demo",
        "NetworkPolicy/demo-epp",
        "PodDisruptionBudget/demo-epp",
        "Role/demo-decode-sidecar",
        "Role/demo-epp",
        "RoleBinding/demo-decode-sidecar",
        "RoleBinding/demo-epp",
        "Service/demo-epp",
        "ServiceAccount/demo-decode-sidecar",
        "ServiceAccount/demo-epp",
    ]


async def test_reconcile_creates_the_gateway_children_and_deletes_them_when_the_block_goes() -> None:
    cluster = FakeCluster()
    reconciler, _ = reconciler_for(cluster)
    await reconciler.reconcile(cluster.put(deployment(gateway={"httpRoute": ROUTE})))
    kinds = {kind for verb, kind, _ in cluster.calls if verb == "apply"}
    assert {"InferencePool", "HTTPRoute"} <= kinds
    assert ("inference.networking.k8s.io/v1", "InferencePool", NAMESPACE, "demo") in cluster.objects
    watch_catches_up(reconciler, cluster)

    body = owner_of(cluster)
    body["spec"].pop("gateway")
    body["metadata"]["generation"] = 2
    cluster.put(body)
    cluster.calls.clear()
    await reconciler.reconcile(owner_of(cluster))
    deleted = sorted(f"{kind}/{name}" for verb, kind, name in cluster.calls if verb == "delete")
    assert "InferencePool/demo" in deleted and "HTTPRoute/demo" in deleted and "Deployment/demo-epp" in deleted
    assert ("inference.networking.k8s.io/v1", "InferencePool", NAMESPACE, "demo") not in cluster.objects
    # The decode pool loses its sidecar and account (a JSON patch: the pool was created by the scaler's
    # manager, which an apply that leaves them out would not take them from); the router is never touched.
    decode = decode_pool(owner_of(cluster))
    assert ("patch", "Deployment", decode) in cluster.calls
    pod = cluster.objects[("apps/v1", "Deployment", NAMESPACE, decode)]["spec"]["template"]["spec"]
    assert "initContainers" not in pod and "serviceAccountName" not in pod
    assert not [call for call in cluster.calls if call[2] == "demo-router"]
    # Nothing more to do after that.
    watch_catches_up(reconciler, cluster)
    cluster.calls.clear()
    await reconciler.reconcile(owner_of(cluster))
    assert cluster.calls == []


def test_only_the_operators_own_sidecar_and_account_are_removed() -> None:
    with_gateway = _worker(_by_name(gateway_doc()), "decode")
    without = _worker(_by_name(minimal()), "decode")
    assert stale_pd_sidecar_ops(with_gateway, with_gateway) == []
    assert stale_pd_sidecar_ops(without, without) == []
    # The only init container: the list goes with it.
    assert stale_pd_sidecar_ops(with_gateway, without)[:2] == [
        {"op": "test", "path": "/spec/template/spec/initContainers/0/name", "value": "pd-sidecar"},
        {"op": "remove", "path": "/spec/template/spec/initContainers"},
    ]
    observed = copy.deepcopy(with_gateway)
    pod = observed["spec"]["template"]["spec"]
    pod["initContainers"].insert(0, {"name": "someone-elses", "image": "x"})
    assert stale_pd_sidecar_ops(observed, without) == [
        {"op": "test", "path": "/spec/template/spec/initContainers/1/name", "value": "pd-sidecar"},
        {"op": "remove", "path": "/spec/template/spec/initContainers/1"},
        {"op": "test", "path": "/spec/template/spec/serviceAccountName", "value": "demo-decode-sidecar"},
        {"op": "remove", "path": "/spec/template/spec/serviceAccountName"},
    ]
    pod["serviceAccountName"] = "set-by-someone-else"
    del pod["initContainers"][1]
    assert stale_pd_sidecar_ops(observed, without) == []


# --------------------------------------------------------------------------- render and diff


def test_render_prints_the_gateway_objects(tmp_path: Path) -> None:
    out = io.StringIO()
    with redirect_stdout(out):
        code = render_command.run(argparse.Namespace(filename=str(EXAMPLE), namespace="ml", from_filename=None))
    assert code == 0
    rendered = [doc for doc in yaml.safe_load_all(out.getvalue()) if doc]
    by_kind = {(doc["kind"], doc["metadata"]["name"]) for doc in rendered}
    assert {
        ("InferencePool", "llama-8b-gw"),
        ("HTTPRoute", "llama-8b-gw"),
        ("Deployment", "llama-8b-gw-epp"),
    } <= by_kind
    for doc in rendered:
        assert_valid_kubernetes(doc)


def test_diff_says_turning_the_gateway_on_rolls_decode_in_the_same_generation(tmp_path: Path) -> None:
    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old.write_text(yaml.safe_dump(minimal()))
    new.write_text(yaml.safe_dump(gateway_doc(httpRoute=ROUTE)))
    out = io.StringIO()
    with redirect_stdout(out):
        code = diff_command.run(argparse.Namespace(old=str(old), new=str(new), worker_image="w:1", exit_code=True))
    text = out.getvalue()
    assert code == 0, text  # no new generation
    assert "generation fields changed: none" in text
    assert "gateway.failureMode: (unset) -> FailClose" in text
    assert "pods that roll: decode" in text


@pytest.mark.parametrize("mode", ["disaggregated", "aggregated"])
def test_rendered_picker_and_sidecar_commands_are_what_their_clis_accept(mode: str) -> None:
    """The args the operator renders go through the real `splitserve epp` / `splitserve sidecar` parsers
    and the checks their `run` makes, so a flag renamed on one side fails here, not in a crash-looping pod."""
    from splitserve.gateway import epp as epp_cli
    from splitserve.gateway import sidecar as sidecar_cli

    children = _by_name(gateway_doc(mode))
    parser = argparse.ArgumentParser()
    epp_cli.configure(parser)
    picker_args = epp(children)["args"]
    config, options = epp_cli.options_from_args(parser.parse_args(picker_args[1:]))
    assert options.target_port == (PD_SIDECAR_PORT if mode == "disaggregated" else 8000)
    assert config.deployment == "demo" and config.has_prefill_source == (mode == "disaggregated")
    if mode == "aggregated":
        return
    (decode,) = [child for key, child in children.items() if key.startswith("Deployment/demo-decode-")]
    container = sidecar(decode)
    # The kubelet expands $(SPLITSERVE_GENERATION) from the pod's own label.
    rendered = [a.replace("$(SPLITSERVE_GENERATION)", "gen-1") for a in container["args"][1:]]
    parser = argparse.ArgumentParser()
    sidecar_cli.configure(parser)
    sidecar_config, local, generation = sidecar_cli.config_from_args(parser.parse_args(rendered))
    assert (local, generation) == ("http://127.0.0.1:8000", "gen-1")
    assert sidecar_config.prefill_from_header and sidecar_config.port == PD_SIDECAR_PORT
