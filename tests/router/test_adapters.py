"""Reading a worker's adapters from its own /v1/models and vllm:lora_requests_info (pure parts)."""

from __future__ import annotations

from dataclasses import dataclass

import orjson
import pytest

from splitserve.router.adapters import ModelCard, adapter_names, parse_active_adapters, parse_models
from splitserve.router.kv_index import request_keys
from splitserve.router.policies import prefer_active_adapter

# What vLLM 0.32 answers (trimmed) with one adapter loaded.
VLLM_MODELS = {
    "object": "list",
    "data": [
        {"id": "tiny", "object": "model", "root": "/models/tiny", "parent": None, "max_model_len": 2048},
        {"id": "a", "object": "model", "root": "/adapters/a", "parent": "tiny", "max_model_len": None},
    ],
}
# vLLM keeps one series per label set it reported, each set to the time it was reported.
VLLM_LORA_INFO = """\
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.796687811563546e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="a",waiting_lora_adapters="a"} 1.7966878089609945e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="b",waiting_lora_adapters="c,b"} 1.796687811553443e+09
"""


def test_models_answer_gives_the_adapters_with_their_parent() -> None:
    cards = parse_models(orjson.dumps(VLLM_MODELS))
    assert cards == (ModelCard("tiny", None, "/models/tiny"), ModelCard("a", "tiny", "/adapters/a"))
    assert adapter_names(cards) == frozenset({"a"})


@pytest.mark.parametrize("body", [b"not json", b"[]", b'{"data": 3}'])
def test_a_models_answer_that_is_not_one_is_refused(body: bytes) -> None:
    with pytest.raises(ValueError):
        parse_models(body)


def test_active_adapters_are_read_from_the_newest_series() -> None:
    assert parse_active_adapters(VLLM_LORA_INFO) == frozenset()  # the newest says nothing runs now
    newest_running = VLLM_LORA_INFO.replace("1.796687811563546e+09", "1.0")
    assert parse_active_adapters(newest_running) == frozenset({"b", "c"})
    assert parse_active_adapters("vllm:num_requests_waiting 0\n") == frozenset()


@dataclass
class _Worker:
    key: str
    inflight: int
    active: bool


def test_affinity_prefers_workers_with_the_adapter_active_unless_overloaded() -> None:
    idle, busy = _Worker("idle", 0, False), _Worker("active", 3, True)
    assert prefer_active_adapter([idle, busy], lambda w: w.active) == [busy]
    busy.inflight = 20  # beyond least * 1.5 + 4: spill onto the idle worker (which then loads it)
    assert prefer_active_adapter([idle, busy], lambda w: w.active) == [idle, busy]
    nobody = [_Worker("x", 0, False), _Worker("y", 1, False)]
    assert prefer_active_adapter(nobody, lambda w: w.active) == nobody


def test_block_keys_of_an_adapter_differ_from_the_base_models_and_each_other() -> None:
    tokens = list(range(64))
    base = request_keys(tokens, 16)
    a = request_keys(tokens, 16, lora_name="a")
    b = request_keys(tokens, 16, lora_name="b")
    assert len({base[0], a[0], b[0]}) == 3
    assert not set(base) & set(a) and not set(a) & set(b)
