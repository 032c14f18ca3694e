"""Token ids from the engine itself (a worker's ``POST /tokenize``), for precise-prefix routing when
the router has no local copy of the model's tokenizer (a Hugging Face or URI model source).

The worker renders the request with its own tokenizer and chat template, so the ids are exactly
the ones its prefix cache keys blocks by, at the cost of one round trip per request before
routing (llm-d's precise scorer makes the same call, to vLLM's render endpoints). Any failure only
costs the prefix match: the request is then routed by load.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp
import orjson

log = logging.getLogger(__name__)

# Fields of a chat request that change how vLLM renders it (vllm/entrypoints/serve/tokenize/protocol.py).
_CHAT_FIELDS = ("messages", "add_generation_prompt", "continue_final_message", "chat_template",
                "chat_template_kwargs", "tools", "documents")  # fmt: skip


def tokenize_body(body: dict[str, Any]) -> dict[str, Any] | None:
    """The /tokenize request that renders ``body`` as its completion or chat request would be."""
    if "messages" in body:
        request = {k: body[k] for k in _CHAT_FIELDS if k in body}
        request.setdefault("add_generation_prompt", True)
    elif isinstance(body.get("prompt"), str):
        request = {"prompt": body["prompt"]}
    else:
        return None  # token-id prompts need no tokenizer; batched text prompts are routed on load
    request["model"] = body.get("model")
    return request


class EngineTokens:
    def __init__(self, workers: Callable[[], Sequence[Any]], timeout: float = 2.0) -> None:
        self._workers = workers  # healthy workers, each with .url and .session
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self.failures = 0

    async def token_ids(self, body: dict[str, Any]) -> tuple[int, ...]:
        request = tokenize_body(body)
        if request is None:
            return ()
        payload = orjson.dumps(request)
        for worker in self._workers()[:2]:  # one retry on another worker, then give up: it is only routing
            try:
                async with worker.session.post(
                    worker.url + "/tokenize", data=payload, headers={"Content-Type": "application/json"},
                    timeout=self._timeout,
                ) as response:  # fmt: skip
                    if response.status != 200:
                        break  # the engine refuses this request; it will say why when it is served
                    tokens = orjson.loads(await response.read()).get("tokens")
                    if isinstance(tokens, list):
                        return tuple(int(t) for t in tokens)
                    break
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as error:
                log.debug("tokenize on %s failed: %s", worker.url, error)
                continue
        self.failures += 1
        return ()
