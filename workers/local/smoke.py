"""The requests `up` itself sends: the `--smoke` completion and the example commands it prints."""

from __future__ import annotations

import json
import shlex
from typing import Any

import httpx

SMOKE_PROMPT = "The capital of France is"


def completion_body(model: str, prompt: str = SMOKE_PROMPT, max_tokens: int = 16) -> dict[str, Any]:
    # Greedy, so the same stack gives the same answer every time.
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}


def send_smoke_request(endpoint: str, model: str, timeout_seconds: float = 120.0) -> str:
    """One completion through the router; the generated text, or RuntimeError saying what went wrong."""
    try:
        response = httpx.post(f"{endpoint}/completions", json=completion_body(model), timeout=timeout_seconds)
    except httpx.HTTPError as error:
        raise RuntimeError(f"request to {endpoint}/completions failed: {error!r}") from error
    if response.status_code != 200:
        raise RuntimeError(f"router answered {response.status_code}: {response.text[:500]}")
    try:
        answer = response.json()
        return str(answer["choices"][0]["text"])
    except (ValueError, KeyError, IndexError, TypeError) as error:
        raise RuntimeError(f"unexpected answer from the router: {response.text[:500]}") from error


def example_commands(endpoint: str, model: str) -> list[str]:
    body = json.dumps(completion_body(model, prompt="Hello, my name is"))
    curl = f"curl -s {endpoint}/completions -H 'Content-Type: application/json' -d {shlex.quote(body)}"
    # Double-quoted Python literals, so the shell's single quotes wrap the code without escapes.
    code = (
        "import openai; print(openai.OpenAI().completions.create("
        f'model={json.dumps(model)}, prompt="Hello, my name is", max_tokens=16).choices[0].text)'
    )
    python = f"OPENAI_BASE_URL={endpoint} OPENAI_API_KEY=unused python -c {shlex.quote(code)}"
    return [curl, python]
