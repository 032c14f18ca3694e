"""Bad input of every kind gets the documented 4xx with OpenAI-style error JSON."""

from __future__ import annotations

from typing import Any

import aiohttp
import openai
import pytest

from splitserve.sim import SimWorker
from testkit.router import router_config, running_router, sim_config

BAD_BODIES: list[tuple[str, bytes, int, str]] = [
    ("not json", b"{this is not json", 400, "invalid_json"),
    ("json array", b"[1, 2]", 400, "invalid_json"),
    ("missing model", b'{"prompt": "hi"}', 400, "missing_field"),
    ("model not a string", b'{"model": 3, "prompt": "hi"}', 400, "invalid_type"),
    ("missing prompt", b'{"model": "sim-model"}', 400, "missing_field"),
    ("prompt wrong type", b'{"model": "sim-model", "prompt": {"a": 1}}', 400, "invalid_type"),
    ("empty prompt list", b'{"model": "sim-model", "prompt": []}', 400, "invalid_type"),
    ("max_tokens a string", b'{"model": "sim-model", "prompt": "hi", "max_tokens": "5"}', 400, "invalid_type"),
    ("max_tokens negative", b'{"model": "sim-model", "prompt": "hi", "max_tokens": -1}', 400, "invalid_value"),
    ("stream not a bool", b'{"model": "sim-model", "prompt": "hi", "stream": "yes"}', 400, "invalid_type"),
    ("temperature a string", b'{"model": "sim-model", "prompt": "hi", "temperature": "hot"}', 400, "invalid_type"),
    ("stop a number", b'{"model": "sim-model", "prompt": "hi", "stop": 5}', 400, "invalid_type"),
    ("unknown model", b'{"model": "gpt-9", "prompt": "hi"}', 404, "model_not_found"),
]


@pytest.fixture
async def router_url() -> Any:
    async with (
        SimWorker(sim_config("aggregated")) as worker,
        running_router(router_config(decode_urls=(worker.url,), max_body_bytes=4096)) as (_, url),
    ):
        yield url


@pytest.mark.parametrize(("case", "raw", "status", "code"), BAD_BODIES, ids=[c[0] for c in BAD_BODIES])
async def test_bad_completion_bodies(router_url: str, case: str, raw: bytes, status: int, code: str) -> None:
    async with aiohttp.ClientSession() as session:
        headers = {"Content-Type": "application/json"}
        async with session.post(router_url + "/v1/completions", data=raw, headers=headers) as response:
            assert response.status == status
            error = (await response.json())["error"]
            assert error["code"] == code
            assert isinstance(error["message"], str) and error["message"]
            assert isinstance(error["type"], str)


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b'{"model": "sim-model"}', "missing_field"),
        (b'{"model": "sim-model", "messages": []}', "invalid_type"),
        (b'{"model": "sim-model", "messages": ["hi"]}', "invalid_type"),
        (b'{"model": "sim-model", "messages": [{"content": "hi"}]}', "invalid_type"),
        (b'{"model": "sim-model", "messages": [{"role": "user", "content": 5}]}', "invalid_type"),
    ],
)
async def test_bad_chat_bodies(router_url: str, raw: bytes, code: str) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.post(router_url + "/v1/chat/completions", data=raw) as response,
    ):
        assert response.status == 400
        assert (await response.json())["error"]["code"] == code


async def test_oversized_body_is_413(router_url: str) -> None:
    body = b'{"model": "sim-model", "prompt": "' + b"x" * 10_000 + b'"}'
    async with aiohttp.ClientSession() as session, session.post(router_url + "/v1/completions", data=body) as response:
        assert response.status == 413
        assert (await response.json())["error"]["code"] == "request_too_large"


async def test_oversized_chunked_body_is_413(router_url: str) -> None:
    async def chunks() -> Any:
        for _ in range(10):
            yield b"x" * 1000

    async with (
        aiohttp.ClientSession() as session,
        session.post(router_url + "/v1/completions", data=chunks()) as response,
    ):
        assert response.status == 413
        assert (await response.json())["error"]["code"] == "request_too_large"


async def test_unknown_path_and_method_are_json(router_url: str) -> None:
    async with aiohttp.ClientSession() as session, session.post(router_url + "/v1/embeddings", json={}) as response:
        assert response.status == 404
        assert (await response.json())["error"]["code"] == "not_found"
        async with session.get(router_url + "/v1/completions") as response:
            assert response.status == 405
            assert (await response.json())["error"]["code"] == "method_not_allowed"


async def test_openai_client_works_unchanged(router_url: str) -> None:
    client = openai.AsyncOpenAI(base_url=router_url + "/v1", api_key="unused", max_retries=0)
    try:
        completion = await client.completions.create(model="sim-model", prompt="hello world", max_tokens=5)
        assert completion.usage is not None and completion.usage.completion_tokens == 5
        chat = await client.chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert chat.choices[0].message.content
        stream = await client.chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
        )
        pieces = [chunk.choices[0].delta.content async for chunk in stream if chunk.choices]
        assert "".join(p or "" for p in pieces) == chat.choices[0].message.content
        models = await client.models.list()
        assert [m.id for m in models.data] == ["sim-model"]
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="other", prompt="x", max_tokens=1)
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(model="sim-model", prompt="x", max_tokens=-3)
    finally:
        await client.close()
