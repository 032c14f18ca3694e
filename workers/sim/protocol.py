"""OpenAI request parsing and response shapes, as vLLM's OpenAI server produces them (pure functions).

Accepted request fields: ``model``, ``prompt`` (string, one-element list of strings, or a list of
token ids) or ``messages``, ``max_tokens`` / ``max_completion_tokens``, ``stream``,
``stream_options.include_usage``, ``kv_transfer_params``, ``n`` (must be 1). Sampling fields
(temperature, top_p, seed, ...) are accepted and ignored: output is always the deterministic
"greedy" text of ``splitserve.sim.tokens``. Generation always ends with ``finish_reason="length"``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Container
from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve.sim.config import EngineLimits
from splitserve.sim.tokens import chat_prompt, tokenize

if TYPE_CHECKING:
    from splitserve.router.tokens import ChatTokenizer

DEFAULT_COMPLETION_MAX_TOKENS = 16  # vLLM's default for /v1/completions
MAX_TOKEN_ID = 2**31

ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    408: "RequestTimeoutError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
}


class RequestError(Exception):
    """A request the simulator refuses; becomes an OpenAI-style JSON error with ``status`` (and vLLM's
    ``err_type`` and ``param`` where they are not the status's usual type and null)."""

    def __init__(self, status: int, message: str, err_type: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param


def error_body(status: int, message: str, err_type: str | None = None, param: str | None = None) -> dict[str, object]:
    kind = err_type or ERROR_TYPES.get(status, "APIError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def model_not_found(model: object, served_model: str) -> RequestError:
    """vLLM's answer for a model name it does not serve (neither the base model nor a loaded adapter)."""
    return RequestError(
        404, f"The model `{model}` does not exist. Valid aliases: {served_model}.", "NotFoundError", "model"
    )


@dataclass(frozen=True)
class GenerationRequest:
    chat: bool
    model: str
    """The model name the request asked for: the base model's, or a loaded LoRA adapter's."""
    prompt_token_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    kv_transfer_params: dict[str, object] | None


def parse_json_object(raw: bytes) -> dict[str, object]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RequestError(400, f"request body is not valid JSON: {error}") from error
    if not isinstance(body, dict):
        raise RequestError(400, "request body must be a JSON object")
    return body


def _optional_int(body: dict[str, object], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise RequestError(400, f"'{name}' must be an integer")
    return value


def prompt_tokens_of(body: dict[str, object], chat: bool, tokenizer: ChatTokenizer | None = None) -> list[int]:
    """The prompt's token ids: with the model's real tokenizer (``--tokenizer``) as vLLM computes them,
    else with the simulator's stand-in tokenizer and chat template."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise RequestError(400, "'messages' must be a non-empty list of message objects")
        try:
            if tokenizer is not None:
                ids = tokenizer.encode_chat(body)
                if ids is None:
                    raise ValueError("the model's tokenizer has no chat template")
                return ids
            return tokenize(chat_prompt(messages))
        except ValueError as error:
            raise RequestError(400, str(error)) from error
    if "prompt" not in body:
        raise RequestError(400, "'prompt' is a required property")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenize(prompt) if tokenizer is None else tokenizer.encode_ids(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < MAX_TOKEN_ID for t in prompt):
            raise RequestError(400, f"token ids in 'prompt' must be between 0 and {MAX_TOKEN_ID - 1}")
        return list(prompt)
    raise RequestError(400, "'prompt' must be a string or a list of token ids (batched prompts are not simulated)")


def parse_generation(
    body: dict[str, object],
    chat: bool,
    served_model: str,
    limits: EngineLimits,
    tokenizer: ChatTokenizer | None = None,
    adapters: Container[str] = (),
) -> GenerationRequest:
    """Check and read a generation request; ``adapters``: the names of the LoRA adapters loaded."""
    model = body.get("model") or served_model
    if model != served_model and not (isinstance(model, str) and model in adapters):
        raise model_not_found(model, served_model)
    assert isinstance(model, str)
    tokens = prompt_tokens_of(body, chat, tokenizer)
    if not tokens:
        raise RequestError(400, "the prompt must contain at least one token")
    n = _optional_int(body, "n")
    if n not in (None, 1):
        raise RequestError(400, "only n=1 is simulated")
    max_tokens = _optional_int(body, "max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = _optional_int(body, "max_tokens")
    if max_tokens is None:
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if not chat else limits.max_model_len - len(tokens)
    if max_tokens < 1:
        raise RequestError(400, f"max_tokens must be at least 1, got {max_tokens}.")
    if len(tokens) + max_tokens > limits.max_model_len:
        raise RequestError(
            400,
            f"This model's maximum context length is {limits.max_model_len} tokens. However, you requested "
            f"{len(tokens) + max_tokens} tokens ({len(tokens)} in the messages, {max_tokens} in the completion). "
            "Please reduce the length of the messages or completion.",
        )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, "'stream' must be a boolean")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise RequestError(400, "'stream_options' must be an object")
    include_usage = bool(options and options.get("include_usage"))
    params = body.get("kv_transfer_params")
    if params is not None and not isinstance(params, dict):
        raise RequestError(400, "'kv_transfer_params' must be an object")
    return GenerationRequest(chat, model, tokens, max_tokens, stream, include_usage, params)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, object]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass(frozen=True)
class ResponseShape:
    """Builds the JSON bodies for one request."""

    chat: bool
    response_id: str
    model: str
    created: int

    @classmethod
    def for_request(cls, chat: bool, request_id: str, model: str) -> ResponseShape:
        prefix = "chatcmpl-" if chat else "cmpl-"
        return cls(chat, prefix + request_id, model, int(time.time()))

    def _head(self, chunk: bool) -> dict[str, object]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.response_id, "object": kind, "created": self.created, "model": self.model}

    def full(self, text: str, usage_body: dict[str, object], kv_params: dict[str, object] | None) -> dict[str, object]:
        choice: dict[str, object] = {"index": 0, "logprobs": None, "finish_reason": "length", "stop_reason": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
        else:
            choice["text"] = text
        return {**self._head(False), "choices": [choice], "usage": usage_body, "kv_transfer_params": kv_params}

    def chunk(
        self,
        text: str,
        finish_reason: str | None,
        include_usage: bool,
        role: bool = False,
        kv_params: dict[str, object] | None = None,
    ) -> dict[str, object]:
        choice: dict[str, object] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": text} if role else {"content": text}
        else:
            choice["text"] = text
            choice["stop_reason"] = None
        body: dict[str, object] = {**self._head(True), "choices": [choice]}
        if include_usage:
            body["usage"] = None
        if kv_params is not None:
            body["kv_transfer_params"] = kv_params
        return body

    def usage_chunk(self, usage_body: dict[str, object]) -> dict[str, object]:
        return {**self._head(True), "choices": [], "usage": usage_body}


def sse(body: dict[str, object]) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
