"""Spec builders and hypothesis strategies shared by the engine tests."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from splitserve.api.spec import Connector, InferenceDeploymentSpec, Role, RoutingPolicy

ALL_CONNECTORS = list(Connector)
ALL_ROLES = list(Role)


def make_spec(**overrides: Any) -> InferenceDeploymentSpec:
    """A valid spec: the tiny model by uri, plus whatever wire-format (camelCase) sections are given."""
    wire: dict[str, Any] = {"model": {"name": "tiny", "source": {"uri": "/models/tiny"}}}
    wire.update(overrides)
    return InferenceDeploymentSpec.model_validate(wire)


_flag_values = st.sampled_from(["--max-num-batched-tokens", "--seed", "--max-logprobs"])
extra_args = st.lists(st.tuples(_flag_values, st.integers(min_value=1, max_value=4096).map(str)), max_size=2).map(
    lambda pairs: [part for pair in pairs for part in pair]
)

sources = st.one_of(
    st.builds(
        lambda repo, rev: {"huggingFace": {"repo": repo, "revision": rev}},
        st.sampled_from(["meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen2.5-0.5B"]),
        st.sampled_from(["main", "v1.0", "0123abcd"]),
    ),
    st.builds(
        lambda claim, path: {"pvc": {"claimName": claim, "path": path}},
        st.sampled_from(["models", "llm-weights"]),
        st.sampled_from(["/", "llama", "/llama/8b", "llama/8b/", "//a//b"]),
    ),
    st.sampled_from(["s3://bucket/llama", "/opt/model", "gs://b/m"]).map(lambda uri: {"uri": uri}),
)

speculative = st.one_of(
    st.just({"method": "off"}),
    st.builds(
        lambda k, n: {"method": "ngram", "numSpeculativeTokens": k, "ngramPromptLookupMax": n},
        st.integers(1, 16),
        st.integers(1, 16),
    ),
    st.builds(
        lambda k: {"method": "draft", "numSpeculativeTokens": k, "draftModel": "org/draft-1b"},
        st.integers(1, 16),
    ),
)


def _pool(tp: int, extra: list[str]) -> dict[str, Any]:
    return {"tensorParallelSize": tp, "resources": {"gpus": tp}, "extraArgs": extra}


pools = st.builds(_pool, st.sampled_from([1, 2, 4, 8]), extra_args)
policies = st.sampled_from(list(RoutingPolicy))


@st.composite
def specs(draw: st.DrawFn) -> InferenceDeploymentSpec:
    """Generated valid specs over every field the builder reads."""
    connector = draw(st.sampled_from(ALL_CONNECTORS))
    mode = "aggregated" if connector == Connector.NONE else draw(st.sampled_from(["aggregated", "disaggregated"]))
    env = draw(
        st.lists(
            st.sampled_from([("HF_HOME", "/cache"), ("VLLM_LOGGING_LEVEL", "DEBUG"), ("NCCL_DEBUG", "INFO")]),
            max_size=3,
            unique=True,
        )
    )
    wire: dict[str, Any] = {
        "model": {
            "name": draw(st.sampled_from(["tiny", "llama-8b", "org/model:v1"])),
            "source": draw(sources),
            "dtype": draw(st.sampled_from(["auto", "float16", "bfloat16", "float32"])),
            "quantization": draw(st.sampled_from(["none", "fp8", "int8", "awq", "gptq"])),
        },
        "engine": {
            "port": draw(st.integers(1024, 65535)),
            "prefixCaching": draw(st.booleans()),
            "chunkedPrefill": draw(st.booleans()),
            "speculativeDecoding": draw(speculative),
            "gpuMemoryUtilization": draw(st.sampled_from([0.5, 0.85, 0.9, 0.95])),
            "extraArgs": draw(extra_args),
            "env": [{"name": name, "value": value} for name, value in env]
            + [{"name": "FROM_SECRET", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
        },
        "kvTransfer": {
            "connector": connector.value,
            "bufferDevice": draw(st.sampled_from(["cuda", "cpu"])),
            "sideChannelPort": draw(st.integers(1024, 65535)),
        },
        "mode": mode,
        "prefill": draw(pools),
        "decode": draw(pools),
        "router": {"routingPolicy": {"prefill": draw(policies), "decode": draw(policies)}},
    }
    if draw(st.booleans()):
        wire["engine"]["kvEventsPort"] = draw(st.integers(1024, 65535))
    if draw(st.booleans()):
        wire["model"]["maxModelLen"] = draw(st.integers(16, 131072))
    if draw(st.booleans()):
        wire["engine"]["blockSize"] = draw(st.sampled_from([8, 16, 32, 64, 128]))
    if draw(st.booleans()):
        wire["engine"]["maxNumSeqs"] = draw(st.integers(1, 4096))
    return InferenceDeploymentSpec.model_validate(wire)
