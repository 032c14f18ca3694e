"""Builders: every object validates against upstream Kubernetes schemas, over examples and
hypothesis-generated specs; ownership, labels and rollout scope hold for every spec."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitserve.api.generation import generation_inputs
from splitserve.api.spec import DEFAULT_WORKER_IMAGE, InferenceDeploymentSpec, RoutingPolicy
from splitserve.api.topology import (
    ANNOTATION_GENERATION_INPUTS,
    LABEL_DEPLOYMENT,
    LABEL_GENERATION,
    LABEL_ROLE,
    Owner,
)
from splitserve.builders.bundle import build_children, child_key
from splitserve.builders.target import Target
from splitserve.validation import validate_object
from tests.operator.helpers import AGGREGATED, EXAMPLES, assert_valid_kubernetes, load, minimal

OWNER = Owner("demo", "ns", "0b3f5a8e-1111-2222-3333-444455556666")


def target_of(doc: dict[str, Any], owner: Owner = OWNER) -> Target:
    return Target(owner, InferenceDeploymentSpec.model_validate(doc["spec"]))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_children_validate_against_upstream_schemas(path: Path) -> None:
    children = build_children(target_of(load(path)))
    for child in children:
        assert_valid_kubernetes(child)
    assert len({child_key(c) for c in children}) == len(children), "duplicate child names"


def _pool() -> st.SearchStrategy[dict[str, Any]]:
    return st.tuples(
        st.integers(0, 3), st.integers(0, 3), st.sampled_from([1, 2, 4]), st.integers(0, 2), st.booleans()
    ).map(
        lambda t: {
            "minReplicas": t[0],
            "maxReplicas": t[0] + t[1],
            "replicas": t[0] + t[1] // 2,
            "tensorParallelSize": t[2],
            "resources": {"gpus": t[2] * t[3], "cpu": "2", "memory": "8Gi"},
            "extraArgs": ["--max-num-batched-tokens", "8192"] if t[4] else [],
            "nodeSelector": {"pool": "gpu"} if t[4] else {},
            "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}] if t[4] else [],
        }
    )


specs = st.fixed_dictionaries(
    {
        "model": st.fixed_dictionaries(
            {
                "name": st.from_regex(r"[a-z][a-z0-9.-]{0,20}", fullmatch=True),
                "source": st.sampled_from(
                    [
                        {"uri": "s3://bucket/model"},
                        {"pvc": {"claimName": "weights", "path": "/llama"}},
                        {"huggingFace": {"repo": "org/model", "tokenSecretRef": {"name": "hf"}}},
                    ]
                ),
                "quantization": st.sampled_from(["none", "fp8", "int8", "awq", "gptq"]),
                "dtype": st.sampled_from(["auto", "bfloat16", "float16"]),
            }
        ),
        "mode": st.sampled_from(["disaggregated", "aggregated"]),
        "kvTransfer": st.fixed_dictionaries(
            {
                "connector": st.sampled_from(
                    ["NixlConnector", "ExampleConnector", "LMCacheConnectorV1", "MooncakeConnector"]
                )
            }
        ),
        "engine": st.fixed_dictionaries(
            {
                "speculativeDecoding": st.sampled_from(
                    [{"method": "off"}, {"method": "ngram"}, {"method": "draft", "draftModel": "org/draft"}]
                ),
                "prefixCaching": st.booleans(),
                "env": st.sampled_from([[], [{"name": "A", "value": "1"}]]),
            }
        ),
        "prefill": _pool(),
        "decode": _pool(),
        "router": st.fixed_dictionaries(
            {
                "serviceType": st.sampled_from(["ClusterIP", "LoadBalancer"]),
                "port": st.integers(1, 65535),
                "routingPolicy": st.fixed_dictionaries(
                    {"prefill": st.sampled_from(list(RoutingPolicy)), "decode": st.sampled_from(list(RoutingPolicy))}
                ),
            }
        ),
        "monitoring": st.fixed_dictionaries({"enabled": st.booleans()}),
        "autoscaling": st.fixed_dictionaries({"enabled": st.booleans()}),
    },
    optional={
        "gateway": st.sampled_from(
            [
                {},
                {"failureMode": "FailOpen", "endpointPicker": {"replicas": 0}},
                {"httpRoute": {"parentRefs": [{"name": "gw", "namespace": "infra"}], "hostnames": ["*.example.com"]}},
            ]
        )
    },
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs)
def test_generated_specs_build_valid_owned_children(spec: dict[str, Any]) -> None:
    doc = minimal(**spec)
    assert validate_object(doc) == [], "the strategy only generates valid specs"
    target = target_of(doc)
    children = build_children(target)
    for child in children:
        assert_valid_kubernetes(child)
        meta = child["metadata"]
        assert meta["ownerReferences"][0]["uid"] == OWNER.uid
        assert meta["labels"][LABEL_DEPLOYMENT] == "demo"
        assert len(meta["name"]) <= 63
        if child["kind"] == "Deployment":
            template_labels = child["spec"]["template"]["metadata"]["labels"]
            assert child["spec"]["selector"]["matchLabels"].items() <= template_labels.items()
    kinds = [c["kind"] for c in children]
    gateway = "gateway" in spec
    assert kinds.count("Deployment") == (2 if spec["mode"] == "aggregated" else 3) + gateway
    assert ("ServiceMonitor" in kinds) == spec["monitoring"]["enabled"]
    assert kinds.count("InferencePool") == gateway


def _deployments(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The Deployments by role (`prefill`, `decode`, `aggregated`, `router`): a worker Deployment's
    name carries its KV generation, so the role is what stays comparable across specs."""
    return {c["metadata"]["labels"][LABEL_ROLE]: c for c in build_children(target_of(doc)) if c["kind"] == "Deployment"}


def _templates(doc: dict[str, Any]) -> dict[str, Any]:
    return {role: deployment["spec"]["template"] for role, deployment in _deployments(doc).items()}


def _names(doc: dict[str, Any]) -> dict[str, str]:
    return {role: deployment["metadata"]["name"] for role, deployment in _deployments(doc).items()}


@pytest.mark.parametrize(
    ("change", "rolled"),
    [
        ({"decode": {"extraArgs": ["--max-num-seqs", "64"]}}, {"decode"}),
        ({"prefill": {"resources": {"cpu": "9", "memory": "40Gi"}}}, {"prefill"}),
        ({"prefill": {"extraArgs": ["--max-num-batched-tokens", "4096"]}}, {"prefill"}),
        ({"router": {"routingPolicy": {"prefill": "round-robin"}}}, {"router"}),
        ({"engine": {"prefixCaching": False}}, {"prefill", "decode"}),
        # precise-prefix turns on KV events in the pool it routes, and gives the router its policy.
        ({"router": {"routingPolicy": {"prefill": "precise-prefix"}}}, {"prefill", "router"}),
        ({"router": {"routingPolicy": {"decode": "precise-prefix"}}}, {"decode", "router"}),
        ({"engine": {"kvEventsPort": 6000}}, set()),  # no pool publishes events: the port is unused
        ({"router": {"port": 9000}}, set()),
        ({"decode": {"replicas": 2, "maxReplicas": 4}}, set()),
    ],
)
def test_a_spec_change_rolls_only_the_pods_it_affects(change: dict[str, Any], rolled: set[str]) -> None:
    before, after = minimal(), minimal(**change)
    # Within one KV generation: the same Deployments, only the affected templates change.
    assert _names(before) == _names(after)
    before_templates, after_templates = _templates(before), _templates(after)
    assert {role for role in before_templates if before_templates[role] != after_templates[role]} == rolled


@pytest.mark.parametrize(
    "change",
    [
        {"prefill": {"tensorParallelSize": 2, "resources": {"gpus": 2}}},
        {"model": {"name": "m", "source": {"uri": "/models/m-v2"}}},
        {"engine": {"kvCacheDtype": "fp8"}},
    ],
)
def test_a_generation_change_names_new_worker_deployments_and_leaves_the_router(change: dict[str, Any]) -> None:
    before, after = _names(minimal()), _names(minimal(**change))
    # Both pools of the new generation are new Deployments (the controller runs them beside the old),
    # even where only one pool's settings changed: a pair is of one generation.
    assert {role for role in before if before[role] != after[role]} == {"prefill", "decode"}
    assert _templates(minimal())["router"] == _templates(minimal(**change))["router"]


def test_worker_deployments_carry_their_generation_and_its_inputs() -> None:
    doc = minimal()
    target = target_of(doc)
    generation = target.generation
    assert len(generation) == 10
    for role in ("prefill", "decode"):
        deployment = _deployments(doc)[role]
        assert deployment["metadata"]["name"] == f"demo-{role}-{generation}"
        assert deployment["spec"]["selector"]["matchLabels"] == {
            LABEL_DEPLOYMENT: "demo",
            LABEL_ROLE: role,
            LABEL_GENERATION: generation,
        }
        template = deployment["spec"]["template"]
        assert template["metadata"]["labels"][LABEL_GENERATION] == generation
        env = {var["name"]: var.get("value") for var in template["spec"]["containers"][0]["env"]}
        assert env["SPLITSERVE_GENERATION"] == generation
        inputs = json.loads(deployment["metadata"]["annotations"][ANNOTATION_GENERATION_INPUTS])
        assert inputs == generation_inputs(target.spec, DEFAULT_WORKER_IMAGE)
        # The inputs belong to the Deployment: in the template they would roll pods for nothing.
        assert "annotations" not in template["metadata"]
        assert ANNOTATION_GENERATION_INPUTS not in json.dumps(template)


def test_aggregated_mode_has_one_worker_pool_behind_the_decode_service() -> None:
    doc = minimal(mode="aggregated", kvTransfer={"connector": "None"})
    children = build_children(target_of(doc))
    deployments = {c["metadata"]["name"]: c for c in children if c["kind"] == "Deployment"}
    aggregated = f"demo-aggregated-{target_of(doc).generation}"
    assert set(deployments) == {aggregated, "demo-router"}
    services = {c["metadata"]["name"]: c for c in children if c["kind"] == "Service"}
    assert set(services) == {"demo-decode", "demo-router"}
    pod_labels = deployments[aggregated]["spec"]["template"]["metadata"]["labels"]
    assert services["demo-decode"]["spec"]["selector"].items() <= pod_labels.items()
    router_args = deployments["demo-router"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--no-prefill-pool" in router_args
    assert not any(arg.startswith("--prefill-service") for arg in router_args)


def test_router_discovers_worker_pods_and_may_only_read_pods() -> None:
    children = _by_name(minimal(engine={"port": 8100}))
    args = _container(children["Deployment/demo-router"])["args"]
    assert _option(args, "--discovery") == "pods"
    assert (_option(args, "--deployment"), _option(args, "--namespace")) == ("demo", "ns")
    assert _option(args, "--worker-port") == "8100"
    # Disaggregated: the router has a prefill pool to find; EndpointSlice flags are gone.
    assert "--no-prefill-pool" not in args
    assert not any(arg.startswith(("--prefill-service", "--decode-service")) for arg in args)
    assert children["Role/demo-router"]["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]


def test_worker_pools_leave_replicas_to_the_scale_subresource() -> None:
    deployments = _deployments(minimal(decode={"replicas": 3, "maxReplicas": 4}))
    for role in ("prefill", "decode"):
        assert "replicas" not in deployments[role]["spec"], "the apply set must never own a pool's size"
    annotations = deployments["decode"]["metadata"]["annotations"]
    assert set(annotations) == {"splitserve.io/declared-replicas", ANNOTATION_GENERATION_INPUTS}
    assert annotations["splitserve.io/declared-replicas"] == "3"
    assert deployments["router"]["spec"]["replicas"] == 2


@pytest.mark.parametrize("backend", ["keda", "hpa"])
def test_autoscalers_scale_the_serving_generation_and_pdbs_span_generations(backend: str) -> None:
    doc = minimal(autoscaling={"enabled": True, "backend": backend}, decode={"minReplicas": 1, "maxReplicas": 4})
    children = build_children(target_of(doc))
    workers = {
        c["metadata"]["name"]: c
        for c in children
        if c["kind"] == "Deployment" and "router" not in c["metadata"]["name"]
    }
    autoscalers = [c for c in children if c["kind"] in ("ScaledObject", "HorizontalPodAutoscaler")]
    assert autoscalers
    for autoscaler in autoscalers:
        target_name = autoscaler["spec"]["scaleTargetRef"]["name"]
        assert target_name in workers and autoscaler["metadata"]["name"] == target_name
        assert autoscaler["metadata"]["labels"][LABEL_GENERATION] == target_of(doc).generation
    # A PDB guards a role across generations: its name and selector carry no generation.
    pdbs = {c["metadata"]["name"]: c for c in children if c["kind"] == "PodDisruptionBudget"}
    assert set(pdbs) == {"demo-prefill", "demo-decode", "demo-router"}
    assert pdbs["demo-decode"]["spec"]["selector"]["matchLabels"] == {LABEL_DEPLOYMENT: "demo", LABEL_ROLE: "decode"}


def test_network_policy_admits_router_to_http_and_pools_to_kv_ports() -> None:
    children = build_children(target_of(minimal()))
    policy = next(c for c in children if c["kind"] == "NetworkPolicy")
    http_rule, kv_rule = policy["spec"]["ingress"]
    assert {
        "podSelector": {"matchLabels": {"splitserve.io/deployment": "demo", "splitserve.io/role": "router"}}
    } in http_rule["from"]
    assert http_rule["ports"] == [{"protocol": "TCP", "port": "http"}]
    assert kv_rule["ports"][0]["port"] == 5600


def test_secret_and_pvc_sources_reach_the_pod() -> None:
    doc = minimal(model={"name": "m", "source": {"huggingFace": {"repo": "o/m", "tokenSecretRef": {"name": "hf"}}}})
    engine = next(c for c in build_children(target_of(doc)) if c["kind"] == "Deployment")["spec"]["template"]["spec"][
        "containers"
    ][0]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in engine["env"]
    doc = minimal(model={"name": "m", "source": {"pvc": {"claimName": "weights", "path": "/llama"}}})
    pod = next(c for c in build_children(target_of(doc)) if c["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert pod["volumes"][-1] == {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}}
    assert "/models/llama" in pod["containers"][0]["args"]


# --------------------------------------------------------------------------- precise-prefix routing

PVC_MODEL = {"name": "m", "source": {"pvc": {"claimName": "weights", "path": "/llama"}}}


def _by_name(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    children = build_children(target_of(doc))
    for child in children:
        assert_valid_kubernetes(child)
    return {f"{c['kind']}/{c['metadata']['name']}": c for c in children}


def _worker(children: dict[str, dict[str, Any]], role: str) -> dict[str, Any]:
    """The one worker Deployment of `role` (its name ends in the spec's KV generation)."""
    (deployment,) = (c for key, c in children.items() if key.startswith(f"Deployment/demo-{role}-"))
    return deployment


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return container


def _option(args: list[str], name: str) -> str | None:
    values = [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == name]
    values += [arg.split("=", 1)[1] for arg in args if arg.startswith(name + "=")]
    assert len(values) <= 1, f"{name} given twice: {args}"
    return values[0] if values else None


def test_precise_prefix_pool_publishes_kv_events_on_a_named_port() -> None:
    children = _by_name(minimal(engine={"kvEventsPort": 5999}, router={"routingPolicy": {"decode": "precise-prefix"}}))
    decode = _container(_worker(children, "decode"))
    prefill = _container(_worker(children, "prefill"))
    assert {"name": "kv-events", "containerPort": 5999, "protocol": "TCP"} in decode["ports"]
    assert _option(decode["args"], "--prefix-caching-hash-algo") == "sha256_cbor"
    events = json.loads(_option(decode["args"], "--kv-events-config") or "null")
    assert events == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5999", "topic": "kv"}
    # The prefill pool is routed prefix-aware (the default): no events, no port, vLLM's default hash.
    assert all(port["name"] != "kv-events" for port in prefill["ports"])
    assert _option(prefill["args"], "--kv-events-config") is None
    assert _option(prefill["args"], "--prefix-caching-hash-algo") is None
    router = _container(children["Deployment/demo-router"])["args"]
    assert (_option(router, "--prefill-policy"), _option(router, "--decode-policy")) == (
        "prefix-aware",
        "precise-prefix",
    )


def test_aggregated_pool_follows_the_decode_policy() -> None:
    children = _by_name(minimal(**AGGREGATED, router={"routingPolicy": {"decode": "precise-prefix"}}))
    assert _option(_container(_worker(children, "aggregated"))["args"], "--kv-events-config") is not None
    # The prefill policy routes no pool in aggregated mode: asking it for precise-prefix changes no worker.
    children = _by_name(minimal(**AGGREGATED, router={"routingPolicy": {"prefill": "precise-prefix"}}))
    assert _option(_container(_worker(children, "aggregated"))["args"], "--kv-events-config") is None
    assert len(children["NetworkPolicy/demo-workers"]["spec"]["ingress"]) == 1


def test_network_policy_admits_only_the_router_to_kv_events() -> None:
    policy = _by_name(minimal(router={"routingPolicy": {"prefill": "precise-prefix"}}))["NetworkPolicy/demo-workers"]
    http_rule, kv_rule, events_rule = policy["spec"]["ingress"]
    assert http_rule["ports"] == [{"protocol": "TCP", "port": "http"}]
    assert kv_rule["ports"][0]["port"] == 5600
    # Not Prometheus, not the other pool: the router's pods alone, on the port only publishers declare.
    assert events_rule == {
        "from": [
            {"podSelector": {"matchLabels": {"splitserve.io/deployment": "demo", "splitserve.io/role": "router"}}}
        ],
        "ports": [{"protocol": "TCP", "port": "kv-events"}],
    }


def test_router_reads_the_tokenizer_from_the_model_claim_read_only() -> None:
    children = _by_name(minimal(model=PVC_MODEL, router={"routingPolicy": {"decode": "precise-prefix"}}))
    pod = children["Deployment/demo-router"]["spec"]["template"]["spec"]
    assert _option(pod["containers"][0]["args"], "--tokenizer") == "/models/llama"
    assert pod["volumes"] == [{"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}}]
    assert pod["containers"][0]["volumeMounts"] == [{"name": "model", "mountPath": "/models", "readOnly": True}]
    worker_pod = _worker(children, "decode")["spec"]["template"]["spec"]
    assert pod["volumes"][0] in worker_pod["volumes"], "the router mounts the workers' own volume"
    assert "/models/llama" in worker_pod["containers"][0]["args"], "the tokenizer is in the directory vLLM loads"


@pytest.mark.parametrize(
    ("model", "policy"),
    [
        ({"name": "m", "source": {"uri": "s3://bucket/m"}}, "precise-prefix"),  # vLLM reads it; the router cannot
        ({"name": "m", "source": {"huggingFace": {"repo": "o/m"}}}, "precise-prefix"),  # downloaded per worker
        (PVC_MODEL, "prefix-aware"),  # no exact tokens needed: the router keeps off the claim
    ],
)
def test_router_gets_no_tokenizer_or_volume_otherwise(model: dict[str, Any], policy: str) -> None:
    children = _by_name(minimal(model=model, router={"routingPolicy": {"decode": policy}}))
    pod = children["Deployment/demo-router"]["spec"]["template"]["spec"]
    assert _option(pod["containers"][0]["args"], "--tokenizer") is None
    assert "volumes" not in pod and "volumeMounts" not in pod["containers"][0]


@pytest.mark.parametrize(("cpu", "processes"), [("1", 1), ("500m", 1), ("2", 2), ("1.5", 2), ("2500m", 3), (4, 4)])
def test_router_runs_one_process_per_requested_core(cpu: str | int, processes: int) -> None:
    from splitserve.builders.router import router_processes

    # The router has no CPU limit, so it cannot find its share from a cgroup quota: it is told.
    assert router_processes(cpu) == processes
