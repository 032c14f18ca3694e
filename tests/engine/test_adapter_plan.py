"""The adapter sync's pure decisions: the file, /v1/models, what to load and unload, back-off, the condition."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from splitserve.engine.adapter_plan import (
    AdapterCard,
    AdapterEntry,
    AdaptersFileError,
    AdaptersState,
    Condition,
    EngineModels,
    HuggingFaceSource,
    SyncPlan,
    adapters_condition,
    adapters_state,
    error_message,
    parse_adapters_file,
    parse_models,
    plan_sync,
    retry_delay,
)


def test_the_file_of_the_plan() -> None:
    text = json.dumps(
        {
            "adapters": [
                {"name": "a", "path": "/adapters/a"},
                {"name": "b", "huggingFace": {"repo": "org/adapter", "revision": "main"}, "later": 1},
                {"name": "c", "huggingFace": {"repo": "org/c"}},
            ]
        }
    )
    assert parse_adapters_file(text) == (
        AdapterEntry("a", path="/adapters/a"),
        AdapterEntry("b", hugging_face=HuggingFaceSource("org/adapter", "main")),
        AdapterEntry("c", hugging_face=HuggingFaceSource("org/c")),
    )
    assert parse_adapters_file('{"adapters": []}') == ()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "not valid JSON"),
        ("[]", 'an "adapters" list'),
        ('{"adapters": [{"path": "/a"}]}', r"adapters\[0\].name: must be a non-empty string"),
        ('{"adapters": [{"name": "a", "path": "/a", "huggingFace": {"repo": "r"}}]}', "exactly one of"),
        ('{"adapters": [{"name": "a", "huggingFace": {"revision": "x"}}]}', r"huggingFace.repo"),
        ('{"adapters": [{"name": "a", "path": "/a"}, {"name": "a", "path": "/b"}]}', "listed twice"),
    ],
)
def test_malformed_files_say_where(text: str, message: str) -> None:
    with pytest.raises(AdaptersFileError, match=message):
        parse_adapters_file(text)


def test_models_and_vllms_error_messages() -> None:
    body = {
        "data": [
            {"id": "base", "root": "/m", "parent": None},
            {"id": "a", "root": "/adapters/a", "parent": "base"},
            {"id": "b", "parent": "base"},
        ]
    }
    assert parse_models(json.dumps(body).encode()) == EngineModels(
        frozenset({"base"}), {"a": AdapterCard("/adapters/a", "base"), "b": AdapterCard(None, "base")}
    )
    with pytest.raises(ValueError):
        parse_models(b'{"detail": "nope"}')
    vllm = '{"error": {"message": "Loading lora b failed: No adapter found for /b", "type": "NotFoundError"}}'
    assert error_message(404, vllm) == "Loading lora b failed: No adapter found for /b"
    assert error_message(400, '{"message": "old style"}') == "old style"
    assert error_message(500, "Internal\n Server Error") == "Internal Server Error"
    assert error_message(502, "") == "HTTP 502"


def test_plan_loads_reloads_and_unloads_only_adapters() -> None:
    served = EngineModels(
        frozenset({"base"}),
        {
            "keep": AdapterCard("/k", "base"),
            "moved": AdapterCard("/old", "base"),
            "gone": AdapterCard("/g", "base"),
            "unsaid": AdapterCard(None, "base"),  # no root: taken as loaded from the wanted path
            "foreign": AdapterCard("/f", "elsewhere"),
            "ours": AdapterCard("/o", "elsewhere"),
        },
    )
    listed = {"keep", "moved", "new", "downloading", "unsaid"}
    paths = {"keep": "/k", "moved": "/new-path", "new": "/n", "unsaid": "/u"}
    assert plan_sync(listed, paths, served, ours={"ours"}) == SyncPlan(
        load=(("new", "/n"),), reload=(("moved", "/new-path"),), unload=("gone", "ours")
    )
    assert not plan_sync({"keep"}, {"keep": "/k"}, EngineModels(frozenset({"base"}), {"keep": AdapterCard("/k", "b")}))


@given(st.integers(min_value=1, max_value=10_000))
def test_back_off_doubles_up_to_its_cap(failures: int) -> None:
    delay = retry_delay(failures, first_s=2.0, cap_s=300.0)
    assert 2.0 <= delay <= 300.0
    assert retry_delay(failures + 1) == min(300.0, delay * 2)


def test_the_condition_of_each_state() -> None:
    state = adapters_state(["b", "a", "c", "d"], {"a"}, {"c": "Loading lora c failed: x", "d": "cannot download"})
    assert state == AdaptersState(
        loaded=("a",), failed={"c": "Loading lora c failed: x", "d": "cannot download"}, pending=("b",)
    )
    assert adapters_condition(state) == Condition(
        "False", "AdapterLoadFailed", "c: Loading lora c failed: x; d: cannot download"
    )
    assert adapters_condition(AdaptersState(loaded=("a",), pending=("b",))) == Condition(
        "False", "AdaptersLoading", "loading b"
    )
    assert adapters_condition(AdaptersState(loaded=("a", "b"))) == Condition("True", "AdaptersLoaded", "loaded a, b")
    assert adapters_condition(AdaptersState()).status == "True"
    assert adapters_state(["a"], {"a"}, {"a": "old failure"}) == AdaptersState(loaded=("a",))
