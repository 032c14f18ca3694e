"""vLLM's prefill/decode protocol done by hand (as vLLM's own disaggregated proxy does) and prompts."""

from __future__ import annotations

import json
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any

import httpx

# What the prefill leg sends ("compute this prompt, keep its KV for a remote decode"): the router's.
from splitserve.router.flow import PREFILL_KV_PARAMS

GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True}
# Ids below this are the tokenizer's special tokens.
FIRST_ORDINARY_TOKEN = 3
VOCAB_SIZE = 2048


def token_prompt(length: int, salt: str) -> list[int]:
    """A prompt of exactly `length` token ids; the salt makes its first block unique (no prefix-cache hits)."""
    rng = random.Random(f"{salt}/{length}")
    return [rng.randrange(FIRST_ORDINARY_TOKEN, VOCAB_SIZE) for _ in range(length)]


_SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "zu", "pe", "ga", "do"]


def text_prompt(words: int, salt: str) -> str:
    rng = random.Random(f"{salt}/{words}")
    body = " ".join("".join(rng.choices(_SYLLABLES, k=rng.randint(1, 3))) for _ in range(words))
    return f"{salt}: {body}."


def prefill_leg(body: dict[str, Any]) -> dict[str, Any]:
    leg = {key: value for key, value in body.items() if key not in ("stream_options", "min_tokens")}
    leg.update(max_tokens=1, stream=False, kv_transfer_params=dict(PREFILL_KV_PARAMS))
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    return leg


@dataclass
class PdResult:
    response: dict[str, Any]
    kv_transfer_params: dict[str, Any]
    prefill_seconds: float
    total_seconds: float


def pd_request(client: httpx.Client, prefill_url: str, decode_url: str, path: str, body: dict[str, Any]) -> PdResult:
    """One non-streaming request through prefill then decode, with one X-Request-Id for both legs."""
    headers = {"X-Request-Id": f"splitserve-test-{uuid.uuid4().hex}"}
    start = time.monotonic()
    prefill = client.post(prefill_url + path, json=prefill_leg(body), headers=headers)
    prefill.raise_for_status()
    params = prefill.json()["kv_transfer_params"]
    prefill_seconds = time.monotonic() - start
    decode = client.post(decode_url + path, json={**body, "kv_transfer_params": params}, headers=headers)
    decode.raise_for_status()
    return PdResult(decode.json(), params, prefill_seconds, time.monotonic() - start)


@dataclass
class StreamTiming:
    text: str
    chunks: int
    completion_tokens: int | None
    first_token_seconds: float
    per_token_seconds: float


def stream(
    client: httpx.Client, url: str, path: str, body: dict[str, Any], headers: dict[str, str], *, usage: bool = False
) -> StreamTiming:
    """A streaming request; time to the first chunk and mean time per later token, seen by the client.

    A busy server sends several tokens in one chunk, so with `usage` the per-token time divides by the
    completion tokens the server reports rather than by the chunks received.
    """
    start = time.monotonic()
    times: list[float] = []
    parts: list[str] = []
    completion_tokens = None
    request = {**body, "stream": True}
    if usage:
        request["stream_options"] = {"include_usage": True}
    with client.stream("POST", url + path, json=request, headers=headers) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if event.get("usage"):
                completion_tokens = event["usage"]["completion_tokens"]
            choices = event.get("choices") or []
            if not choices:
                continue
            times.append(time.monotonic() - start)
            parts.append(choices[0].get("text") or (choices[0].get("delta") or {}).get("content") or "")
    if not times:
        return StreamTiming("", 0, completion_tokens, float("nan"), float("nan"))
    steps = (completion_tokens or len(times)) - 1
    per_token = (times[-1] - times[0]) / steps if steps > 0 else float("nan")
    return StreamTiming("".join(parts), len(times), completion_tokens, times[0], per_token)
