"""The process layout `up` derives from a deployment, checked without starting anything."""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable
from pathlib import Path

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.api.topology import Owner
from splitserve.builders.router import build_router_deployment
from splitserve.builders.target import Target
from splitserve.builders.vllm_args import option_value
from splitserve.engine import cli as worker_cli
from splitserve.gateway import epp as epp_cli
from splitserve.gateway import sidecar as sidecar_cli
from splitserve.local.changes import Change
from splitserve.local.deployment import TINY_MODEL_URI, LocalDeployment, load_deployment, parse_deployment
from splitserve.local.gateway import LocalGateway, fail_open, refusal
from splitserve.local.plan import Engine, PlanInputs, ProcessSpec, plan_processes, resolved_document
from splitserve.local.supervisor import Progress, Supervisor
from splitserve.router import cli as router_cli
from splitserve.router.config import DiscoveryKind
from testkit.upctl import REPO

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
        endpoints_file="/run/endpoints.json",
        generation="g1",
    )


def _arg(argv: tuple[str, ...], flag: str) -> str:
    """The value of `flag`, written `--flag value` or `--flag=value`."""
    for index, arg in enumerate(argv):
        if arg.startswith(flag + "="):
            return arg[len(flag) + 1 :]
        if arg == flag:
            return argv[index + 1]
    raise AssertionError(f"{flag} not in {argv}")


def _has(argv: tuple[str, ...], flag: str) -> bool:
    return any(arg == flag or arg.startswith(flag + "=") for arg in argv)


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
    assert [spec.role for spec in plan.workers] == roles
    assert [spec.pool for spec in plan.workers] == ["prefill" if role == "prefill" else "decode" for role in roles]
    assert all(spec.generation == "g1" and _arg(spec.argv, "--generation") == "g1" for spec in plan.workers)
    # The router follows the endpoints file `up` writes (a rollout changes it), not static URLs.
    router = plan.router.argv
    assert _arg(router, "--discovery") == "file" and _arg(router, "--endpoints-file") == "/run/endpoints.json"
    assert not _has(router, "--prefill") and not _has(router, "--decode")
    assert ("--no-prefill-pool" in router) is aggregated


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


def test_router_command_line_is_the_routers_own_and_the_clusters() -> None:
    timeouts = {"queueSeconds": 7, "connectSeconds": 2.5, "prefillSeconds": 40, "firstTokenSeconds": 50}
    deployment = _deployment(router={"admissionQueueLimit": 9, "timeouts": timeouts}, prefill=2)
    plan = plan_processes(deployment, _inputs())
    flags = plan.router.argv[len(SPLITSERVE) + 1 :]
    assert plan.router.argv[len(SPLITSERVE)] == "router"
    parser = argparse.ArgumentParser()
    router_cli.configure(parser)
    config = router_cli.config_from_args(parser.parse_args(list(flags)))
    assert config.discovery is DiscoveryKind.FILE and config.endpoints_file == "/run/endpoints.json"
    assert config.prefill_pool is True
    assert (config.host, config.port, config.model) == ("127.0.0.1", 8000, "tiny")
    assert (config.queue_limit, config.queue_timeout, config.connect_timeout) == (9, 7, 2.5)
    assert (config.prefill_timeout, config.decode_timeout, config.drain_seconds) == (40, 50, 5)
    # The routing, admission and timeout flags are the ones the cluster's router Deployment runs with.
    target = Target(Owner("t", "default"), deployment.spec)
    in_cluster = build_router_deployment(target)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert in_cluster[0] == "router"
    local_only = ("--host", "--port", "--discovery", "--endpoints-file", "--drain-seconds", "--tokenizer", "--workers")
    cluster_only = ("--host", "--port", "--discovery", "--deployment", "--namespace", "--prefill-service")
    shared = [flag for flag in in_cluster[1:] if not flag.startswith((*cluster_only, "--worker-port", "--workers"))]
    assert [flag for flag in flags if not flag.startswith(local_only)] == shared
    # Locally one router process (the engines need the other cores); in a cluster one per requested core.
    assert "--workers=1" in flags and "--workers=1" in in_cluster


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
    assert not _has(plan.router.argv, "--tokenizer"), "only the tiny model's tokenizer is known to be local"


# --------------------------------------------------------------------------- precise-prefix routing


def _events(argv: tuple[str, ...]) -> dict[str, object] | None:
    text = option_value(argv, "--kv-events-config")
    return None if text is None else json.loads(text)


def test_sim_workers_of_a_precise_prefix_pool_publish_kv_events_on_their_own_ports() -> None:
    deployment = _deployment(prefill=2, decode=3, router={"routingPolicy": {"decode": "precise-prefix"}})
    plan = plan_processes(deployment, _inputs())
    decode = [w for w in plan.workers if w.name.startswith("decode-")]
    prefill = [w for w in plan.workers if w.name.startswith("prefill-")]
    assert all(_events(w.argv) is None for w in prefill), "prefill is routed prefix-aware: no events"
    endpoints = [(_events(w.argv) or {}).get("endpoint") for w in decode]
    ports = {int(str(endpoint).removeprefix("tcp://*:")) for endpoint in endpoints}
    assert len(ports) == 3, f"one publisher port per worker: {endpoints}"
    assert not ports & {p.port for p in plan.processes}, "never an HTTP port"
    assert {(_events(w.argv) or {}).get("topic") for w in decode} == {"kv"}
    assert _arg(plan.router.argv, "--decode-policy") == "precise-prefix"


def test_vllm_workers_of_a_precise_prefix_pool_get_a_kv_events_port_their_spec_turns_into_vllm_flags(
    tmp_path: Path,
) -> None:
    deployment = _deployment(prefill=1, decode=2, router={"routingPolicy": {"prefill": "precise-prefix"}})
    document, _ = resolved_document(deployment, "/models/tiny")
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(document))
    plan = plan_processes(deployment, _inputs(Engine.VLLM, model_path="/models/tiny", spec_path=str(spec_file)))
    prefill, *decode = plan.workers
    port = int(_arg(prefill.argv, "--kv-events-port"))
    taken = {p.port for p in plan.processes} | {int(w.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) for w in plan.workers}
    assert port not in taken
    assert not any(_has(w.argv, "--kv-events-port") for w in decode), "decode is routed least-loaded"
    # What `splitserve worker` then starts: vLLM with the spec's events config on this worker's port.
    parser = argparse.ArgumentParser()
    worker_cli.configure(parser)
    launch = worker_cli.build_plan(parser.parse_args(list(prefill.argv[len(SPLITSERVE) + 1 :])), {})
    assert (_events(tuple(launch.vllm_args)) or {}).get("endpoint") == f"tcp://*:{port}"
    assert option_value(launch.vllm_args, "--prefix-caching-hash-algo") == "sha256_cbor"
    assert _arg(plan.router.argv, "--tokenizer") == "/models/tiny", "the router tokenizes as the engine"


def test_no_kv_events_without_precise_prefix() -> None:
    for engine in (Engine.SIM, Engine.VLLM):
        plan = plan_processes(_deployment(prefill=1, decode=1), _inputs(engine, "/models/tiny", "/run/spec.yaml"))
        for worker in plan.workers:
            assert not _has(worker.argv, "--kv-events-config") and not _has(worker.argv, "--kv-events-port")


# --------------------------------------------------------------------------- --gateway envoy


def _plan(file: str, tmp_path: Path, inputs: PlanInputs) -> tuple[list[ProcessSpec], list[ProcessSpec], Path]:
    """(workers, the gateway's processes, the bootstrap file) of a deployment file, planned."""
    deployment: LocalDeployment = load_deployment(REPO / "deploy/local" / file)
    workers = list(plan_processes(deployment, inputs).workers)
    supervisor = Supervisor(tmp_path, Progress())
    local = LocalGateway(supervisor, inputs.allocate_port, "/opt/envoy")
    return workers, local.plan(deployment, inputs, workers), local.bootstrap_path


def _parse(configure: Callable[[argparse.ArgumentParser], None], spec: ProcessSpec) -> argparse.Namespace:
    assert spec.argv[: len(SPLITSERVE)] == SPLITSERVE
    parser = argparse.ArgumentParser()
    configure(parser)
    return parser.parse_args(list(spec.argv[len(SPLITSERVE) + 1 :]))


def test_disaggregated_a_sidecar_per_decode_worker_the_picker_targets_it_envoy_pools_them(tmp_path: Path) -> None:
    workers, planned, bootstrap = _plan("tiny-disaggregated.yaml", tmp_path, _inputs())
    decode = next(worker for worker in workers if worker.role == "decode")
    sidecar, epp, envoy = planned
    assert [spec.name for spec in planned] == ["decode-0-sidecar", "epp", "envoy"]

    assert sidecar.argv[len(SPLITSERVE)] == "sidecar" and sidecar.ready_path == "/ready"
    config, local, generation = sidecar_cli.config_from_args(_parse(sidecar_cli.configure, sidecar))
    assert (local, generation, config.port) == (decode.base_url, "g1", sidecar.port)
    assert config.discovery is DiscoveryKind.FILE and config.endpoints_file == "/run/endpoints.json"

    assert epp.argv[len(SPLITSERVE)] == "epp" and epp.ready_path == "/ready"
    config, options = epp_cli.options_from_args(_parse(epp_cli.configure, epp))
    assert config.discovery is DiscoveryKind.FILE and config.endpoints_file == "/run/endpoints.json"
    assert (config.model, config.port) == ("tiny-llama", epp.port)
    assert options.target_endpoints == {decode.base_url: f"127.0.0.1:{sidecar.port}"}
    assert options.grpc_port not in {epp.port, sidecar.port, envoy.port}

    assert envoy.argv == ("/opt/envoy", "-c", str(bootstrap), "--base-id", str(envoy.ready_port), "--log-level", "warn")
    assert envoy.ready_url == f"http://127.0.0.1:{envoy.ready_port}/ready" != f"{envoy.base_url}/ready"
    text = bootstrap.read_text()
    config_doc = yaml.safe_load(text)
    assert config_doc["admin"]["address"]["socket_address"]["port_value"] == envoy.ready_port
    assert f"port_value: {sidecar.port}" in text and f"port_value: {options.grpc_port}" in text
    assert f"port_value: {decode.port}" not in text, "Envoy reaches the decode worker only through its sidecar"
    assert "failure_mode_allow: false" in text, "FailClose by default"


def test_aggregated_no_sidecar_the_picker_names_the_workers_themselves(tmp_path: Path) -> None:
    workers, planned, bootstrap = _plan("tiny-aggregated.yaml", tmp_path, _inputs())
    assert [spec.name for spec in planned] == ["epp", "envoy"]
    config, options = epp_cli.options_from_args(_parse(epp_cli.configure, planned[0]))
    assert options.target_endpoints == {} and config.prefill_pool is False
    assert f"port_value: {workers[0].port}" in bootstrap.read_text()


def test_vllm_the_picker_and_sidecars_get_the_routers_tokenizer(tmp_path: Path) -> None:
    inputs = _inputs(Engine.VLLM, model_path="/models/tiny", spec_path="/run/spec.yaml")
    _, planned, _ = _plan("tiny-disaggregated.yaml", tmp_path, inputs)
    for spec in planned[:2]:
        assert "--tokenizer=/models/tiny" in spec.argv, spec.name


def test_the_gateway_fails_closed_unless_the_file_says_fail_open() -> None:
    assert fail_open(_deployment()) is False
    assert fail_open(_deployment(gateway={"failureMode": "FailClose"})) is False
    assert fail_open(_deployment(gateway={"failureMode": "FailOpen"})) is True


def test_a_running_gateway_refuses_changes_of_the_decode_workers_only() -> None:
    assert refusal(Change("g1", "g1", replicas={"prefill": (1, 2)})) is None
    assert refusal(Change("g1", "g1")) is None
    assert "decode replicas" in str(refusal(Change("g1", "g1", replicas={"decode": (1, 2)})))
    assert "aggregated replicas" in str(refusal(Change("g1", "g1", replicas={"aggregated": (1, 2)})))
    assert "new KV generation" in str(refusal(Change("g1", "g2")))
