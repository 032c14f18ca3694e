"""build_engine_launch: the vLLM command line the operator and `splitserve worker` both run; the
argument-list edits (`--cpu` adaptation, option overrides) `splitserve worker -- ARGS` applies."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from splitserve.api.spec import Connector, InferenceDeploymentSpec, Role
from splitserve.api.topology import publishes_kv_events, role_pool
from splitserve.builders.vllm_args import (
    CPU_DEFAULT_KV_CACHE_BYTES,
    MODEL_MOUNT_PATH,
    EngineLaunch,
    build_engine_launch,
    cpu_engine_args,
    model_location,
    option_value,
    with_option,
)
from splitserve.engine.launcher import engine_environment
from splitserve.engine.wait_settings import EVENTS_ON_CPU, WaitSettings
from tests.engine.specs import ALL_ROLES, make_spec, specs

# Flags the builder emits with a value; all others it emits are bare switches.
VALUED = {
    "--model",
    "--served-model-name",
    "--host",
    "--port",
    "--dtype",
    "--revision",
    "--quantization",
    "--max-model-len",
    "--tensor-parallel-size",
    "--speculative-config",
    "--gpu-memory-utilization",
    "--kv-cache-memory-bytes",
    "--block-size",
    "--max-num-seqs",
    "--kv-transfer-config",
    "--prefix-caching-hash-algo",
    "--kv-events-config",
}


def own_args(launch: EngineLaunch, spec: InferenceDeploymentSpec, role: Role) -> list[str]:
    """The builder's own arguments: everything before the users' extraArgs tail."""
    tail = len(spec.engine.extra_args) + len(role_pool(spec, role).extra_args)
    return launch.args[: len(launch.args) - tail]


def as_options(args: list[str]) -> dict[str, str | None]:
    """Parse the builder's own arguments into flag -> value (None for switches); fails on repeats."""
    options: dict[str, str | None] = {}
    index = 0
    while index < len(args):
        flag = args[index]
        assert flag.startswith("--"), f"expected a flag at {index}: {args}"
        assert flag not in options, f"{flag} given twice: {args}"
        if flag in VALUED:
            options[flag] = args[index + 1]
            index += 2
        else:
            options[flag] = None
            index += 1
    return options


def kv_config(options: dict[str, str | None]) -> dict[str, Any] | None:
    text = options.get("--kv-transfer-config")
    return None if text is None else json.loads(text)


# --------------------------------------------------------------------------- model location


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ({"huggingFace": {"repo": "meta-llama/Llama-3.1-8B"}}, "meta-llama/Llama-3.1-8B"),
        ({"pvc": {"claimName": "weights"}}, MODEL_MOUNT_PATH),
        ({"pvc": {"claimName": "weights", "path": "/llama/8b/"}}, "/models/llama/8b"),
        ({"pvc": {"claimName": "weights", "path": "llama"}}, "/models/llama"),
        ({"uri": "s3://bucket/model"}, "s3://bucket/model"),
    ],
)
def test_model_location(source: dict[str, Any], expected: str) -> None:
    spec = make_spec(model={"name": "m", "source": source})
    assert model_location(spec) == expected


def test_pvc_path_cannot_escape_the_mount() -> None:
    spec = make_spec(model={"name": "m", "source": {"pvc": {"claimName": "w", "path": "/a/../../etc"}}})
    assert model_location(spec).startswith(MODEL_MOUNT_PATH)


# --------------------------------------------------------------------------- fixed examples


def test_defaults_for_prefill_on_gpu() -> None:
    spec = make_spec()
    launch = build_engine_launch(spec, Role.PREFILL)
    assert launch.args[:2] == ["--model", "/models/tiny"]
    options = as_options(launch.args)
    assert options["--served-model-name"] == "tiny"
    assert options["--host"] == "0.0.0.0"
    assert options["--port"] == "8000"
    assert options["--dtype"] == "auto"
    assert options["--tensor-parallel-size"] == "1"
    assert options["--gpu-memory-utilization"] == "0.9"
    assert "--enable-prefix-caching" in options
    assert "--enable-chunked-prefill" in options
    for absent in ("--quantization", "--revision", "--speculative-config", "--enforce-eager", "--block-size"):
        assert absent not in options
    assert kv_config(options) == {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cuda"}
    assert launch.env == {"VLLM_NIXL_SIDE_CHANNEL_PORT": "5600"}


def test_nixl_decode_is_consumer_and_aggregated_has_no_transfer() -> None:
    spec = make_spec(kvTransfer={"bufferDevice": "cpu", "sideChannelPort": 6000})
    decode = as_options(build_engine_launch(spec, Role.DECODE).args)
    assert kv_config(decode) == {"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_buffer_device": "cpu"}
    aggregated = build_engine_launch(spec, Role.AGGREGATED)
    assert "--kv-transfer-config" not in aggregated.args
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in aggregated.env
    assert build_engine_launch(spec, Role.DECODE).env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "6000"


def test_example_connector_shares_a_directory_both_ways() -> None:
    spec = make_spec(kvTransfer={"connector": "ExampleConnector", "sharedStoragePath": "/shared/kv"})
    for role in (Role.PREFILL, Role.DECODE):
        launch = build_engine_launch(spec, role)
        assert kv_config(as_options(launch.args)) == {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": "/shared/kv"},
        }
        assert launch.env == {}


def test_lmcache_and_mooncake_shapes() -> None:
    lmcache = make_spec(kvTransfer={"connector": "LMCacheConnectorV1"})
    producer = kv_config(as_options(build_engine_launch(lmcache, Role.PREFILL).args))
    consumer = kv_config(as_options(build_engine_launch(lmcache, Role.DECODE).args))
    assert producer is not None and consumer is not None
    assert (producer["kv_role"], consumer["kv_role"]) == ("kv_producer", "kv_consumer")
    assert producer["kv_connector_extra_config"]["lmcache_rpc_port"] == "producer1"
    assert consumer["kv_connector_extra_config"]["lmcache_rpc_port"] == "consumer1"
    mooncake = make_spec(kvTransfer={"connector": "MooncakeConnector"})
    assert kv_config(as_options(build_engine_launch(mooncake, Role.DECODE).args)) == {
        "kv_connector": "MooncakeConnector",
        "kv_role": "kv_consumer",
    }


def test_no_connector_means_no_transfer_config() -> None:
    spec = make_spec(mode="aggregated", kvTransfer={"connector": "None"})
    for role in ALL_ROLES:
        assert "--kv-transfer-config" not in build_engine_launch(spec, role).args


def test_speculative_configs() -> None:
    ngram = make_spec(engine={"speculativeDecoding": {"method": "ngram", "numSpeculativeTokens": 5}})
    options = as_options(build_engine_launch(ngram, Role.DECODE).args)
    assert json.loads(options["--speculative-config"] or "") == {
        "method": "ngram",
        "num_speculative_tokens": 5,
        "prompt_lookup_max": 4,
    }
    draft = make_spec(engine={"speculativeDecoding": {"method": "draft", "draftModel": "org/small"}})
    options = as_options(build_engine_launch(draft, Role.DECODE).args)
    assert json.loads(options["--speculative-config"] or "") == {"model": "org/small", "num_speculative_tokens": 3}


def test_draft_without_a_draft_model_is_refused() -> None:
    spec = make_spec(engine={"speculativeDecoding": {"method": "draft"}})
    with pytest.raises(ValueError, match="draftModel"):
        build_engine_launch(spec, Role.DECODE)


def test_hugging_face_revision_and_disabled_features() -> None:
    spec = make_spec(
        model={"name": "m", "source": {"huggingFace": {"repo": "org/m", "revision": "v2"}}, "quantization": "fp8"},
        engine={"prefixCaching": False, "chunkedPrefill": False, "blockSize": 32, "maxNumSeqs": 64},
    )
    options = as_options(build_engine_launch(spec, Role.PREFILL).args)
    assert options["--revision"] == "v2"
    assert options["--quantization"] == "fp8"
    assert options["--block-size"] == "32"
    assert options["--max-num-seqs"] == "64"
    assert "--no-enable-prefix-caching" in options and "--enable-prefix-caching" not in options
    assert "--no-enable-chunked-prefill" in options and "--enable-chunked-prefill" not in options
    # A local copy replaces the hub: no revision to ask for.
    assert "--revision" not in build_engine_launch(spec, Role.PREFILL, model="/tmp/m").args


def test_tensor_parallel_follows_the_role_pool() -> None:
    spec = make_spec(
        prefill={"tensorParallelSize": 2, "resources": {"gpus": 2}},
        decode={"tensorParallelSize": 4, "resources": {"gpus": 4}},
    )
    sizes = {role: as_options(build_engine_launch(spec, role).args)["--tensor-parallel-size"] for role in ALL_ROLES}
    assert sizes == {Role.PREFILL: "2", Role.DECODE: "4", Role.AGGREGATED: "4"}


def test_cpu_mode() -> None:
    spec = make_spec(kvTransfer={"bufferDevice": "cuda"})
    options = as_options(build_engine_launch(spec, Role.PREFILL, cpu=True, port=9100, model="/tmp/tiny").args)
    assert options["--model"] == "/tmp/tiny"
    assert options["--port"] == "9100"
    assert options["--dtype"] == "float32"
    assert "--enforce-eager" in options
    assert options["--kv-cache-memory-bytes"] == CPU_DEFAULT_KV_CACHE_BYTES
    assert "--gpu-memory-utilization" not in options
    config = kv_config(options)
    assert config is not None and config["kv_buffer_device"] == "cpu"
    sized = as_options(build_engine_launch(spec, Role.DECODE, cpu=True, kv_cache_memory_bytes="1G").args)
    assert sized["--kv-cache-memory-bytes"] == "1G"
    # An explicit dtype is kept even on CPU.
    bf16 = make_spec(model={"name": "m", "source": {"uri": "/m"}, "dtype": "bfloat16"})
    assert as_options(build_engine_launch(bf16, Role.DECODE, cpu=True).args)["--dtype"] == "bfloat16"


def test_extra_args_come_last_engine_then_pool() -> None:
    spec = make_spec(
        engine={"extraArgs": ["--max-num-seqs", "8"]},
        prefill={"extraArgs": ["--max-num-seqs", "4", "--seed", "1"]},
    )
    args = build_engine_launch(spec, Role.PREFILL).args
    assert args[-6:] == ["--max-num-seqs", "8", "--max-num-seqs", "4", "--seed", "1"]
    assert build_engine_launch(spec, Role.DECODE).args[-2:] == ["--max-num-seqs", "8"]


def test_engine_env_values_only_and_user_wins() -> None:
    spec = make_spec(
        engine={
            "env": [
                {"name": "A", "value": "1"},
                {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": "7000"},
                {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
            ]
        }
    )
    assert build_engine_launch(spec, Role.PREFILL).env == {"VLLM_NIXL_SIDE_CHANNEL_PORT": "7000", "A": "1"}


CPU_POOL = {"resources": {"gpus": 0, "cpu": "1", "memory": "4Gi"}}


def test_cpu_pools_wait_on_events_and_gpu_pools_keep_vllms_waits_unsaid() -> None:
    spec = make_spec(prefill=CPU_POOL, engine={"waits": {"spinMicroseconds": 20, "nixlPollMicroseconds": 2000}})
    assert WaitSettings.from_env(build_engine_launch(spec, Role.PREFILL).env) == WaitSettings("events", 20, 2000)
    # A GPU pool under Auto gets no variable at all: its pods stay as an older operator rendered them.
    assert not any(name.startswith("SPLITSERVE_") for name in build_engine_launch(spec, Role.DECODE).env)


@pytest.mark.parametrize(("mode", "expected"), [("Spin", "spin"), ("Events", "events")])
def test_an_explicit_wait_mode_holds_on_any_pool(mode: str, expected: str) -> None:
    spec = make_spec(prefill=CPU_POOL, engine={"waits": {"mode": mode}})
    for role in (Role.PREFILL, Role.DECODE):
        assert WaitSettings.from_env(build_engine_launch(spec, role).env).mode == expected


def test_a_spin_pool_overrides_the_cpu_defaults_of_the_local_worker() -> None:
    spec = make_spec(prefill=CPU_POOL, engine={"waits": {"mode": "Spin"}})
    launch = build_engine_launch(spec, Role.PREFILL, cpu=True)
    assert WaitSettings.from_env(engine_environment({}, launch.env, cpu=True)).mode == "spin"
    assert WaitSettings.from_env(engine_environment({}, {}, cpu=True)) == EVENTS_ON_CPU


def test_a_progress_poll_under_a_millisecond_is_refused() -> None:
    with pytest.raises(ValidationError, match="nixlPollMicroseconds"):
        make_spec(engine={"waits": {"nixlPollMicroseconds": 0}})


def _events(launch: EngineLaunch) -> dict[str, Any] | None:
    text = option_value(launch.args, "--kv-events-config")
    return None if text is None else json.loads(text)


@pytest.mark.parametrize(
    ("mode", "policies", "publishing"),
    [
        ("disaggregated", {"prefill": "precise-prefix"}, {Role.PREFILL}),
        ("disaggregated", {"decode": "precise-prefix"}, {Role.DECODE, Role.AGGREGATED}),
        ("disaggregated", {"prefill": "precise-prefix", "decode": "precise-prefix"}, set(ALL_ROLES)),
        ("aggregated", {"decode": "precise-prefix"}, {Role.DECODE, Role.AGGREGATED}),
        ("disaggregated", {"prefill": "kv-aware", "decode": "prefix-aware"}, set()),
    ],
)
def test_pools_routed_precise_prefix_publish_kv_events(
    mode: str, policies: dict[str, str], publishing: set[Role]
) -> None:
    spec = make_spec(mode=mode, router={"routingPolicy": policies})
    for role in ALL_ROLES:
        launch = build_engine_launch(spec, role)
        if role not in publishing:
            assert _events(launch) is None and option_value(launch.args, "--prefix-caching-hash-algo") is None
            continue
        assert option_value(launch.args, "--prefix-caching-hash-algo") == "sha256_cbor"
        assert _events(launch) == {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": "tcp://*:5557",
            "topic": "kv",
        }


def test_kv_events_port_from_the_spec_or_the_caller() -> None:
    spec = make_spec(engine={"kvEventsPort": 6100}, router={"routingPolicy": {"decode": "precise-prefix"}})
    assert (_events(build_engine_launch(spec, Role.DECODE)) or {})["endpoint"] == "tcp://*:6100"
    # `splitserve up` gives each local worker its own port: they share one host.
    local = build_engine_launch(spec, Role.DECODE, kv_events_port=23456, cpu=True)
    assert (_events(local) or {})["endpoint"] == "tcp://*:23456"
    # Only for a role that publishes: the port alone turns nothing on.
    assert _events(build_engine_launch(spec, Role.PREFILL, kv_events_port=23456)) is None


def test_users_extra_args_override_the_kv_events_config() -> None:
    mine = '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:7000","topic":"mine"}'
    spec = make_spec(
        router={"routingPolicy": {"decode": "precise-prefix"}}, decode={"extraArgs": ["--kv-events-config", mine]}
    )
    assert option_value(build_engine_launch(spec, Role.DECODE).args, "--kv-events-config") == mine


# --------------------------------------------------------------------------- properties


@settings(max_examples=150, deadline=None)
@given(spec=specs(), role=st.sampled_from(ALL_ROLES), cpu=st.booleans(), port=st.none() | st.integers(1024, 65535))
def test_generated_specs(spec: InferenceDeploymentSpec, role: Role, cpu: bool, port: int | None) -> None:
    launch = build_engine_launch(spec, role, cpu=cpu, port=port)
    assert launch == build_engine_launch(spec, role, cpu=cpu, port=port), "not deterministic"
    assert launch.args[:2] == ["--model", model_location(spec)]
    options = as_options(own_args(launch, spec, role))  # also: no flag twice, every valued flag has a value
    pool = role_pool(spec, role)
    tail = spec.engine.extra_args + pool.extra_args
    assert launch.args[len(launch.args) - len(tail) :] == tail
    assert options["--port"] == str(spec.engine.port if port is None else port)
    assert options["--served-model-name"] == spec.model.name
    assert options["--tensor-parallel-size"] == str(pool.tensor_parallel_size)
    assert ("--quantization" in options) == (spec.model.quantization != "none")
    assert ("--revision" in options) == (spec.model.source.hugging_face is not None)
    assert ("--enforce-eager" in options) == cpu
    assert ("--gpu-memory-utilization" in options) != cpu
    assert ("--speculative-config" in options) == (spec.engine.speculative_decoding.method != "off")
    if cpu and spec.model.dtype == "auto":
        assert options["--dtype"] == "float32"
    else:
        assert options["--dtype"] == spec.model.dtype

    config = kv_config(options)
    moves_kv = role != Role.AGGREGATED and spec.kv_transfer.connector != Connector.NONE
    assert (config is not None) == moves_kv
    if config is not None:
        assert config["kv_connector"] == spec.kv_transfer.connector.value
        expected_role = {Role.PREFILL: "kv_producer", Role.DECODE: "kv_consumer"}[role]
        assert config["kv_role"] == ("kv_both" if spec.kv_transfer.connector == Connector.EXAMPLE else expected_role)
    events = options.get("--kv-events-config")
    assert (events is not None) == publishes_kv_events(spec, role) == ("--prefix-caching-hash-algo" in options)
    if events is not None:
        assert json.loads(events)["endpoint"] == f"tcp://*:{spec.engine.kv_events_port}"
    nixl = moves_kv and spec.kv_transfer.connector == Connector.NIXL
    user_env = {var.name: var.value for var in spec.engine.env if var.value is not None}
    expected_env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(spec.kv_transfer.side_channel_port)} if nixl else {}
    assert launch.env == expected_env | user_env
    assert all(isinstance(value, str) for value in launch.env.values())


# --------------------------------------------------------------------------- argument lists


def test_option_value_both_spellings_last_wins() -> None:
    assert option_value(["--port", "1", "--x", "--port=2"], "--port") == "2"
    assert option_value(["--port", "1"], "--port") == "1"
    assert option_value(["--portable", "1"], "--port") is None
    assert option_value(["--port"], "--port") is None


def test_with_option_replaces_every_occurrence_or_appends() -> None:
    assert with_option(["--port", "1", "--a", "--port=2"], "--port", "9") == ["--port", "9", "--a", "--port=9"]
    assert with_option(["--a"], "--port", "9") == ["--a", "--port", "9"]


_pair = st.tuples(st.sampled_from(["--port", "--model", "--seed"]), st.sampled_from(["1", "x"]), st.booleans())
# Well-formed argument lists: each option with its value, as `--x v` or `--x=v`.
tokens = st.lists(_pair, max_size=5).map(
    lambda pairs: [part for name, value, joined in pairs for part in ([f"{name}={value}"] if joined else [name, value])]
)


@given(args=tokens, value=st.sampled_from(["80", "9000"]))
def test_with_option_then_option_value_round_trips(args: list[str], value: str) -> None:
    edited = with_option(args, "--model", value)
    assert option_value(edited, "--model") == value
    # Other options are untouched.
    assert option_value(edited, "--port") == option_value(args, "--port")


def test_cpu_engine_args_adds_only_what_is_missing() -> None:
    assert cpu_engine_args(["--model", "m"]) == [
        "--model",
        "m",
        "--enforce-eager",
        "--kv-cache-memory-bytes",
        CPU_DEFAULT_KV_CACHE_BYTES,
    ]
    kept = ["--enforce-eager", "--kv-cache-memory-bytes", "1G"]
    assert cpu_engine_args(kept) == kept
    assert option_value(cpu_engine_args(kept, "512M"), "--kv-cache-memory-bytes") == "512M"
