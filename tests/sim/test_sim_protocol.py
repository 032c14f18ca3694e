"""Request parsing never crashes: any JSON body is either a valid request or a RequestError."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.sim.config import PROFILES
from splitserve.sim.protocol import RequestError, parse_generation, parse_json_object

LIMITS = PROFILES["cpu-tiny"].limits
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-5, 5000)
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
fields = st.sampled_from(
    ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "stream", "stream_options", "n",
     "kv_transfer_params"]
)  # fmt: skip


@settings(max_examples=120, deadline=None)
@given(st.dictionaries(fields, json_values, max_size=6), st.booleans())
def test_any_body_parses_or_is_refused_with_4xx(body: dict[str, Any], chat: bool) -> None:
    try:
        parsed = parse_generation(body, chat, "sim-model", LIMITS)
    except RequestError as error:
        assert error.status in (400, 404)
        return
    assert parsed.max_tokens >= 1
    assert len(parsed.prompt_token_ids) + parsed.max_tokens <= LIMITS.max_model_len


@pytest.mark.parametrize("raw", [b"", b"\xff\xfe", b"null", b'"text"', b"{"])
def test_non_objects_are_refused(raw: bytes) -> None:
    with pytest.raises(RequestError) as caught:
        parse_json_object(raw)
    assert caught.value.status == 400


def test_chat_max_completion_tokens_wins_and_default_fills_context() -> None:
    messages = [{"role": "user", "content": "hi there"}]
    parsed = parse_generation({"messages": messages, "max_completion_tokens": 3, "max_tokens": 9}, True, "m", LIMITS)
    assert parsed.max_tokens == 3
    unbounded = parse_generation({"messages": messages}, True, "m", LIMITS)
    assert unbounded.max_tokens + len(unbounded.prompt_token_ids) == LIMITS.max_model_len
    completion = parse_generation({"prompt": "hi"}, False, "m", LIMITS)
    assert completion.max_tokens == 16
    assert json.dumps(completion.kv_transfer_params) == "null"
