"""The process layout `up` derives from a deployment, checked without starting anything."""

from __future__ import annotations

import itertools

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.local.deployment import TINY_MODEL_URI, LocalDeployment, parse_deployment
from splitserve.local.plan import Engine, PlanInputs, plan_processes, resolved_document

SPLITSERVE = ("python", "-m", "splitserve")


def _deployment(
    mode: str = "disaggregated", prefill: int = 1, decode: int = 1, uri: str = TINY_MODEL_URI, **extra: object
) -> LocalDeployment:
    spec = {
        "model": {"name": "tiny", "source": {"uri": uri}},
        "mode": mode,
        "prefill": {"replicas": prefill, "minReplicas": 0, "maxReplicas": max(prefill, 1)},
        "decode": {"replicas": decode, "minReplicas": 1, "maxReplicas": max(decode, 1)},
        **extra,
    }
    document = {"apiVersion": "splitserve.io/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": "t"}}
    return parse_deployment(yaml.safe_dump({**document, "spec": spec}))


def _inputs(
    engine: Engine = Engine.SIM,
    model_path: str | None = None,
    spec_path: str | None = None,
    sim_profile: str | None = None,
) -> PlanInputs:
    ports = itertools.count(20000)
    return PlanInputs(
        engine=engine,
        router_port=8000,
        allocate_port=lambda: next(ports),
        splitserve=SPLITSERVE,
        model_path=model_path,
        spec_path=spec_path,
        sim_profile=sim_profile,
    )


def _arg(argv: tuple[str, ...], flag: str) -> str:
    return argv[argv.index(flag) + 1]


# Parsing runs the full validator (schema + CEL), tens of milliseconds on a loaded machine.
@settings(deadline=None, max_examples=30)
@given(prefill=st.integers(0, 4), decode=st.integers(1, 4), aggregated=st.booleans())
def test_one_process_per_replica_with_distinct_ports_and_names(prefill: int, decode: int, aggregated: bool) -> None:
    deployment = _deployment("aggregated" if aggregated else "disaggregated", prefill, decode)
    plan = plan_processes(deployment, _inputs())
    expected_prefill = 0 if aggregated else prefill
    assert len(plan.workers) == expected_prefill + decode
    assert len({spec.port for spec in plan.processes}) == len(plan.processes)
    assert len({spec.name for spec in plan.processes}) == len(plan.processes)
    roles = [_arg(spec.argv, "--role") for spec in plan.workers]
    if aggregated:
        assert roles == ["aggregated"] * decode
    else:
        assert roles == ["prefill"] * prefill + ["decode"] * decode
    router = plan.router.argv
    decode_urls = _arg(router, "--decode").split(",")
    assert decode_urls == [spec.base_url for spec in plan.workers if _arg(spec.argv, "--role") != "prefill"]
    if expected_prefill:
        assert _arg(router, "--prefill").split(",") == [spec.base_url for spec in plan.workers[:prefill]]
    else:
        assert "--prefill" not in router


def test_sim_workers_and_router_arguments() -> None:
    deployment = _deployment(router={"disaggregationThresholdTokens": 7, "admissionQueueLimit": 9})
    plan = plan_processes(deployment, _inputs(sim_profile="cpu-tiny"))
    prefill = plan.workers[0]
    assert prefill.argv[:4] == (*SPLITSERVE, "sim-worker")
    assert _arg(prefill.argv, "--host") == "127.0.0.1" and _arg(prefill.argv, "--model") == "tiny"
    assert _arg(prefill.argv, "--profile") == "cpu-tiny"
    assert prefill.ready_url == f"http://127.0.0.1:{prefill.port}/health"
    router = plan.router
    assert router.port == 8000 and router.ready_path == "/ready"
    assert plan.endpoint == "http://127.0.0.1:8000/v1"
    assert _arg(router.argv, "--disagg-threshold-tokens") == "7"
    assert _arg(router.argv, "--queue-limit") == "9"
    assert _arg(router.argv, "--prefill-policy") == "prefix-aware"
    assert _arg(router.argv, "--decode-policy") == "least-loaded"


def test_vllm_workers_get_their_own_nixl_port_and_offline_env() -> None:
    deployment = _deployment(prefill=2, decode=2)
    plan = plan_processes(deployment, _inputs(Engine.VLLM, model_path="/models/tiny", spec_path="/run/spec.yaml"))
    nixl_ports = [spec.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] for spec in plan.workers]
    assert len(set(nixl_ports)) == 4
    assert not {int(port) for port in nixl_ports} & {spec.port for spec in plan.processes}
    for spec in plan.workers:
        assert spec.argv[3] == "worker" and "--cpu" in spec.argv
        assert _arg(spec.argv, "-f") == "/run/spec.yaml" and _arg(spec.argv, "--model") == "/models/tiny"
        assert spec.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
        assert spec.env["HF_HUB_OFFLINE"] == "1"
    assert _arg(plan.router.argv, "--tokenizer") == "/models/tiny"


def test_resolved_document_points_at_the_tiny_model_and_cpu_buffers() -> None:
    deployment = _deployment(kvTransfer={"connector": "NixlConnector", "bufferDevice": "cuda"})
    document, notes = resolved_document(deployment, "/models/tiny")
    assert document["spec"]["model"]["source"] == {"uri": "/models/tiny"}
    assert document["spec"]["kvTransfer"]["bufferDevice"] == "cpu"
    assert len(notes) == 2
    assert deployment.document["spec"]["model"]["source"]["uri"] == TINY_MODEL_URI, "the original is untouched"


def test_resolved_document_leaves_a_real_path_alone() -> None:
    deployment = _deployment(uri="/data/llama", kvTransfer={"connector": "NixlConnector", "bufferDevice": "cpu"})
    document, notes = resolved_document(deployment, "/models/tiny")
    assert document["spec"]["model"]["source"] == {"uri": "/data/llama"}
    assert notes == []
    plan = plan_processes(deployment, _inputs(Engine.VLLM, model_path="/data/llama", spec_path="/run/spec.yaml"))
    assert "--tokenizer" not in plan.router.argv, "only the tiny model's tokenizer is known to be local"
