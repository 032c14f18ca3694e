"""The built command line parses with vLLM's own server argument parser (every connector x role)."""

from __future__ import annotations

import argparse
import importlib.util
import itertools
from typing import Any

import pytest

from splitserve.api.spec import Connector, Role
from splitserve.builders.vllm_args import build_engine_launch
from tests.engine.specs import ALL_CONNECTORS, ALL_ROLES, make_spec

pytestmark = [
    pytest.mark.slow,  # importing vLLM takes 10-25 s on these machines
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]


@pytest.fixture(scope="module")
def vllm_parser() -> Any:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())  # type: ignore[no-untyped-call]


def parse(parser: Any, args: list[str]) -> argparse.Namespace:
    namespace: argparse.Namespace = parser.parse_args(args)
    return namespace


@pytest.mark.parametrize(
    ("connector", "role", "cpu"), list(itertools.product(ALL_CONNECTORS, ALL_ROLES, [False, True]))
)
def test_every_connector_and_role_parses(vllm_parser: Any, connector: Connector, role: Role, cpu: bool) -> None:
    mode = "aggregated" if connector == Connector.NONE else "disaggregated"
    spec = make_spec(
        mode=mode,
        kvTransfer={"connector": connector.value, "bufferDevice": "cuda"},
        model={"name": "tiny", "source": {"huggingFace": {"repo": "org/m", "revision": "v1"}}, "maxModelLen": 2048},
        engine={
            "prefixCaching": False,
            "speculativeDecoding": {"method": "ngram", "numSpeculativeTokens": 4},
            "blockSize": 128,
            "maxNumSeqs": 16,
            "extraArgs": ["--seed", "7"],
        },
        decode={"extraArgs": ["--max-num-seqs", "32"]},
    )
    launch = build_engine_launch(spec, role, cpu=cpu, port=9123)
    ns = parse(vllm_parser, launch.args)
    assert ns.model == "org/m"
    assert ns.revision == "v1"
    assert ns.served_model_name == ["tiny"]
    assert ns.port == 9123
    assert ns.max_model_len == 2048
    assert ns.enable_prefix_caching is False
    assert ns.enable_chunked_prefill is True
    assert ns.speculative_config == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    assert ns.block_size == 128
    assert ns.seed == 7
    # The pool's extraArgs come last and win over the engine's own setting.
    assert ns.max_num_seqs == (32 if role != Role.PREFILL else 16)
    assert ns.enforce_eager is cpu
    if cpu:
        assert ns.dtype == "float32"
        assert ns.kv_cache_memory_bytes == 256 * 1024 * 1024
    else:
        assert ns.gpu_memory_utilization == pytest.approx(0.9)
    transfer = ns.kv_transfer_config
    if role == Role.AGGREGATED or connector == Connector.NONE:
        assert transfer is None
        return
    assert transfer.kv_connector == connector.value
    if connector == Connector.EXAMPLE:
        assert transfer.kv_role == "kv_both"
        assert transfer.kv_connector_extra_config["shared_storage_path"] == spec.kv_transfer.shared_storage_path
    else:
        assert transfer.kv_role == ("kv_producer" if role == Role.PREFILL else "kv_consumer")
    if connector == Connector.NIXL:
        assert transfer.kv_buffer_device == ("cpu" if cpu else "cuda")


def test_draft_model_speculation_parses(vllm_parser: Any) -> None:
    spec = make_spec(engine={"speculativeDecoding": {"method": "draft", "draftModel": "org/draft"}})
    ns = parse(vllm_parser, build_engine_launch(spec, Role.DECODE).args)
    assert ns.speculative_config == {"model": "org/draft", "num_speculative_tokens": 3}


def test_quantization_and_pvc_model_parse(vllm_parser: Any) -> None:
    spec = make_spec(
        model={"name": "m", "source": {"pvc": {"claimName": "w", "path": "/llama"}}, "quantization": "fp8"},
        engine={"chunkedPrefill": False},
    )
    ns = parse(vllm_parser, build_engine_launch(spec, Role.PREFILL).args)
    assert ns.model == "/models/llama"
    assert ns.quantization == "fp8"
    assert ns.enable_chunked_prefill is False


@pytest.mark.parametrize("cpu", [False, True])
def test_kv_events_for_precise_prefix_parse(vllm_parser: Any, cpu: bool) -> None:
    spec = make_spec(router={"routingPolicy": {"prefill": "precise-prefix"}}, engine={"kvEventsPort": 5558})
    ns = parse(vllm_parser, build_engine_launch(spec, Role.PREFILL, cpu=cpu).args)
    assert ns.prefix_caching_hash_algo == "sha256_cbor"
    assert ns.enable_prefix_caching is True
    events = ns.kv_events_config
    assert (events.enable_kv_cache_events, events.publisher) == (True, "zmq")
    assert (events.endpoint, events.topic) == ("tcp://*:5558", "kv")
