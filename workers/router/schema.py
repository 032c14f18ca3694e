"""Checks on request bodies before any worker sees them: wrong input is a 400, never a 500."""

from __future__ import annotations

from typing import Any

from splitserve.router.errors import RouterError, bad_request

_INT_FIELDS = ("max_tokens", "max_completion_tokens", "n", "min_tokens", "top_k", "seed", "best_of")
_NUMBER_FIELDS = (
    "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
)  # fmt: skip
_NON_NEGATIVE = {"max_tokens", "max_completion_tokens", "min_tokens", "n", "best_of"}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _type_error(field: str, expected: str) -> RouterError:
    return bad_request(f"`{field}` must be {expected}.", code="invalid_type", param=field)


def _check_prompt(prompt: object) -> None:
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt) or all(_is_int(p) for p in prompt):
            return
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
            return
    raise _type_error("prompt", "a string, a list of strings, a list of token ids or a list of such lists")


def _check_messages(messages: object) -> None:
    if not isinstance(messages, list) or not messages:
        raise _type_error("messages", "a non-empty list of message objects")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _type_error(f"messages[{index}]", "an object")
        if not isinstance(message.get("role"), str):
            raise _type_error(f"messages[{index}].role", "a string")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise _type_error(f"messages[{index}].content", "a string, a list of parts or null")


def validate_body(body: object, chat: bool) -> dict[str, Any]:
    """The body as a dict when it is a well-formed completions (or chat) request; else RouterError."""
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    if "model" not in body:
        raise bad_request("`model` is required.", code="missing_field", param="model")
    if not isinstance(body["model"], str):
        raise _type_error("model", "a string")
    if chat:
        if "messages" not in body:
            raise bad_request("`messages` is required.", code="missing_field", param="messages")
        _check_messages(body["messages"])
    else:
        if "prompt" not in body:
            raise bad_request("`prompt` is required.", code="missing_field", param="prompt")
        _check_prompt(body["prompt"])
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _type_error("stream", "a boolean")
    for field in _INT_FIELDS:
        value = body.get(field)
        if value is None:
            continue
        if not _is_int(value):
            raise _type_error(field, "an integer")
        if field in _NON_NEGATIVE and value < 0:
            raise bad_request(f"`{field}` must be >= 0.", code="invalid_value", param=field)
    for field in _NUMBER_FIELDS:
        value = body.get(field)
        if value is not None and not _is_number(value):
            raise _type_error(field, "a number")
    stop = body.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise _type_error("stop", "a string or a list of strings")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _type_error("stream_options", "an object")
    return body
