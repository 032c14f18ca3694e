"""The OpenAI-compatible HTTP surface: response shapes, streaming, errors, admin endpoints."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import openai
import pytest
from sim_helpers import fast_config, post

from splitserve.sim import SimWorker, chat_prompt, generate_text, tokenize

PROMPT = "Summarise the plot of Hamlet, please."


async def sse_events(reply: aiohttp.ClientResponse) -> list[Any]:
    raw = (await reply.read()).decode()
    events = [block.removeprefix("data: ") for block in raw.split("\n\n") if block]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


async def test_completion_shape_and_deterministic_text(http: aiohttp.ClientSession) -> None:
    async with SimWorker(fast_config()) as worker:
        status, body = await post(
            http, worker.url + "/v1/completions", {"model": "sim-model", "prompt": PROMPT, "max_tokens": 7}
        )
    assert status == 200
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["text"] == generate_text(tokenize(PROMPT), 7)
    assert choice["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == len(tokenize(PROMPT)) == 8
    assert body["usage"]["completion_tokens"] == 7 and body["usage"]["total_tokens"] == 15
    assert body["kv_transfer_params"] is None


async def test_chat_completion_shape(http: aiohttp.ClientSession) -> None:
    messages = [{"role": "user", "content": PROMPT}]
    async with SimWorker(fast_config()) as worker:
        status, body = await post(http, worker.url + "/v1/chat/completions", {"messages": messages, "max_tokens": 5})
    assert status == 200 and body["object"] == "chat.completion"
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant"
    assert message["content"] == generate_text(tokenize(chat_prompt(messages)), 5)


async def test_streaming_completion_with_usage(http: aiohttp.ClientSession) -> None:
    body = {"prompt": PROMPT, "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}
    async with SimWorker(fast_config()) as worker, http.post(worker.url + "/v1/completions", json=body) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/event-stream")
        events = await sse_events(reply)
    token_chunks, usage_chunk = events[:-1], events[-1]
    assert len(token_chunks) == 6
    assert "".join(c["choices"][0]["text"] for c in token_chunks) == generate_text(tokenize(PROMPT), 6)
    assert [c["choices"][0]["finish_reason"] for c in token_chunks] == [None] * 5 + ["length"]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 6


async def test_streaming_chat_without_usage(http: aiohttp.ClientSession) -> None:
    messages = [{"role": "user", "content": "hi"}]
    body = {"messages": messages, "max_tokens": 3, "stream": True}
    async with SimWorker(fast_config()) as worker, http.post(worker.url + "/v1/chat/completions", json=body) as reply:
        events = await sse_events(reply)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" and "usage" not in e for e in events)
    text = "".join(e["choices"][0]["delta"]["content"] for e in events)
    assert text == generate_text(tokenize(chat_prompt(messages)), 3)


async def test_openai_client_works_unchanged() -> None:
    async with SimWorker(fast_config()) as worker:
        client = openai.AsyncOpenAI(base_url=worker.url + "/v1", api_key="unused")
        models = await client.models.list()
        assert [m.id for m in models.data] == ["sim-model"]
        completion = await client.completions.create(model="sim-model", prompt=PROMPT, max_tokens=4)
        assert completion.choices[0].text == generate_text(tokenize(PROMPT), 4)
        assert completion.usage is not None and completion.usage.completion_tokens == 4
        chat = await client.chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert chat.choices[0].message.content == generate_text(
            tokenize(chat_prompt([{"role": "user", "content": "hi"}])), 3
        )
        stream = await client.chat.completions.create(
            model="sim-model",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces: list[str] = []
        usage_seen = None
        async for chunk in stream:
            pieces.extend(c.delta.content or "" for c in chunk.choices)
            usage_seen = chunk.usage or usage_seen
        assert "".join(pieces) == chat.choices[0].message.content
        assert usage_seen is not None and usage_seen.completion_tokens == 3
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="other-model", prompt="x", max_tokens=1)
        await client.close()


@pytest.mark.parametrize(
    ("path", "raw", "status", "needle"),
    [
        ("/v1/completions", b"{not json", 400, "not valid JSON"),
        ("/v1/completions", b"[1, 2]", 400, "JSON object"),
        ("/v1/completions", b'{"max_tokens": 3}', 400, "'prompt'"),
        ("/v1/chat/completions", b'{"messages": []}', 400, "'messages'"),
        ("/v1/completions", b'{"prompt": "x", "model": "gpt-9"}', 404, "gpt-9"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": "many"}', 400, "max_tokens"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 5000}', 400, "maximum context length"),
        ("/v1/completions", b'{"prompt": "x", "stream": "yes"}', 400, "stream"),
        ("/v1/completions", b'{"prompt": "x", "n": 2}', 400, "n=1"),
        ("/v1/completions", b'{"prompt": "x", "kv_transfer_params": 7}', 400, "kv_transfer_params"),
    ],
)
async def test_bad_requests_get_openai_errors(
    http: aiohttp.ClientSession, path: str, raw: bytes, status: int, needle: str
) -> None:
    headers = {"Content-Type": "application/json"}
    async with SimWorker(fast_config()) as worker, http.post(worker.url + path, data=raw, headers=headers) as reply:
        body = await reply.json()
        assert reply.status == status
    error = body["error"]
    assert needle in error["message"]
    assert error["code"] == status and isinstance(error["type"], str)


async def test_models_health_tokenize(http: aiohttp.ClientSession) -> None:
    async with SimWorker(fast_config(model="tiny")) as worker:
        async with http.get(worker.url + "/v1/models") as reply:
            models = await reply.json()
        assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 2048
        async with http.get(worker.url + "/health") as reply:
            assert reply.status == 200
        async with http.get(worker.url + "/version") as reply:
            assert "version" in await reply.json()
        async with http.get(worker.url + "/load") as reply:
            assert await reply.json() == {"server_load": 0}
        status, body = await post(http, worker.url + "/tokenize", {"model": "tiny", "prompt": "Hello, world!"})
        assert status == 200 and body["count"] == 4 and body["tokens"] == tokenize("Hello, world!")


async def test_prompt_as_token_ids(http: aiohttp.ClientSession) -> None:
    ids = tokenize(PROMPT)
    async with SimWorker(fast_config()) as worker:
        _, by_ids = await post(http, worker.url + "/v1/completions", {"prompt": ids, "max_tokens": 5})
        _, by_text = await post(http, worker.url + "/v1/completions", {"prompt": [PROMPT], "max_tokens": 5})
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
