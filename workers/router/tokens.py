"""Prompt tokens for routing: how long a prompt is and the chained hashes of its token blocks.

With a local Hugging Face tokenizer (``--tokenizer DIR``, through the ``tokenizers`` package) the
router counts and hashes real token ids. Without one it uses a documented, deterministic
approximation: one token per ``approx_bytes_per_token`` bytes of UTF-8 prompt text, and blocks of
``block_tokens * approx_bytes_per_token`` bytes. The approximation only has to be stable (the same
prefix always gives the same hashes) and roughly proportional to length; it never reaches a worker.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class Tokenizer(Protocol):
    def encode_ids(self, text: str) -> list[int]:
        """Token ids of a completions prompt, as the engine tokenizes it (special tokens included)."""
        ...


class ChatTokenizer(Tokenizer, Protocol):
    def encode_chat(self, body: dict[str, Any]) -> list[int] | None:
        """Token ids of a chat request as the engine renders it, or None when it cannot be known here."""
        ...


class HuggingFaceTokenizer:
    """The model's own tokenizer (tokenizer.json) and chat template, loaded from its local directory.

    It tokenizes as vLLM does: a completions prompt with the tokenizer's special tokens (vLLM's
    default ``add_special_tokens=True``), and a chat request by rendering the model's chat template
    (as ``transformers.apply_chat_template`` does: jinja2 sandbox, trimmed blocks) and tokenizing the
    result without adding special tokens again. So the router's block keys are the engine's.
    """

    def __init__(self, path: str) -> None:
        import json
        import os

        from tokenizers import Tokenizer as HFTokenizer

        directory = path if os.path.isdir(path) else os.path.dirname(path)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        self._tokenizer = HFTokenizer.from_file(file)
        config: dict[str, Any] = {}
        config_file = os.path.join(directory, "tokenizer_config.json")
        if os.path.exists(config_file):
            with open(config_file) as handle:
                config = json.load(handle)
        template = config.get("chat_template")
        template_file = os.path.join(directory, "chat_template.jinja")
        if template is None and os.path.exists(template_file):
            with open(template_file) as handle:
                template = handle.read()
        self._special = {k: _token_text(v) for k, v in config.items() if k.endswith("_token")}
        self._template = _compile_chat_template(template) if isinstance(template, str) else None

    def encode_ids(self, text: str) -> list[int]:
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=True).ids
        return ids

    def decode(self, ids: list[int]) -> str:
        text: str = self._tokenizer.decode(ids, skip_special_tokens=False)
        return text

    def encode_chat(self, body: dict[str, Any]) -> list[int] | None:
        if self._template is None:
            return None
        try:
            text = self._template.render(
                messages=body["messages"],
                add_generation_prompt=body.get("add_generation_prompt", True),
                tools=body.get("tools"),
                **{**self._special, **(body.get("chat_template_kwargs") or {})},
            )
        except Exception:  # a template error is the engine's to report; routing just falls back
            return None
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=False).ids
        return ids


def _token_text(value: Any) -> Any:
    # tokenizer_config.json writes special tokens as strings or as {"content": ...} objects.
    return value.get("content") if isinstance(value, dict) else value


def _compile_chat_template(template: str) -> Any:
    """The template compiled as transformers compiles it."""
    import json

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:  # fmt: skip
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


@dataclass(frozen=True)
class PromptShape:
    """What routing needs from a prompt: its length in tokens, its block-hash chain (prefix-aware)
    and, when they are known exactly, its token ids (precise-prefix)."""

    tokens: int
    block_hashes: tuple[int, ...]
    token_ids: tuple[int, ...] = ()


def _digest(previous: int, block: bytes) -> int:
    # blake2b keeps hashes stable across processes (Python's hash() is salted per process).
    h = hashlib.blake2b(block, digest_size=8, key=previous.to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "little")


def chain_hashes_bytes(data: bytes, block_bytes: int) -> tuple[int, ...]:
    """Chained hashes of every full ``block_bytes`` block: hash i covers bytes [0, (i+1)*block)."""
    hashes: list[int] = []
    previous = 0
    for start in range(0, len(data) - block_bytes + 1, block_bytes):
        previous = _digest(previous, data[start : start + block_bytes])
        hashes.append(previous)
    return tuple(hashes)


def chain_hashes_ids(ids: Sequence[int], block_tokens: int) -> tuple[int, ...]:
    """Chained hashes of every full block of ``block_tokens`` token ids."""
    hashes: list[int] = []
    previous = 0
    for start in range(0, len(ids) - block_tokens + 1, block_tokens):
        block = b"".join(i.to_bytes(4, "little", signed=False) for i in ids[start : start + block_tokens])
        previous = _digest(previous, block)
        hashes.append(previous)
    return tuple(hashes)


def prompt_text(body: dict[str, Any]) -> str | list[int] | None:
    """The prompt of a completions or chat request as text (or token ids when given as ids)."""
    if "messages" in body:
        parts: list[str] = []
        for message in body["messages"]:
            if not isinstance(message, dict):
                continue
            parts.append(str(message.get("role", "")))
            content = message.get("content")
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts.extend(str(p.get("text", "")) for p in content if isinstance(p, dict))
        return "\n".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int):
            return [int(x) for x in prompt]
        if isinstance(first, str):
            return str(first)  # batched prompts: route on the first
        if isinstance(first, list):
            return [int(x) for x in first]
    return None


class PromptMeasurer:
    """Turns request bodies into :class:`PromptShape`; hashing is skipped when no policy needs it,
    and token ids are kept only when a policy needs them and they are the engine's own."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        block_tokens: int,
        approx_bytes_per_token: int,
        want_hashes: bool,
        want_token_ids: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._block_tokens = block_tokens
        self._bytes_per_token = max(1, approx_bytes_per_token)
        self._want_hashes = want_hashes
        self._want_ids = want_token_ids

    def measure(self, body: dict[str, Any]) -> PromptShape:
        prompt = prompt_text(body)
        if prompt is None:
            return PromptShape(0, ())
        exact = self._exact_ids(body, prompt)
        if exact is not None:
            hashes = chain_hashes_ids(exact, self._block_tokens) if self._want_hashes else ()
            return PromptShape(len(exact), hashes, tuple(exact) if self._want_ids else ())
        # Approximate from here on: a chat request without a chat template, or no tokenizer at all.
        assert isinstance(prompt, str)  # token-id prompts are always exact
        if self._tokenizer is not None:
            ids = self._tokenizer.encode_ids(prompt)
            hashes = chain_hashes_ids(ids, self._block_tokens) if self._want_hashes else ()
            return PromptShape(len(ids), hashes)
        data = prompt.encode()
        tokens = (len(data) + self._bytes_per_token - 1) // self._bytes_per_token
        if not self._want_hashes:
            return PromptShape(tokens, ())
        return PromptShape(tokens, chain_hashes_bytes(data, self._block_tokens * self._bytes_per_token))

    def _exact_ids(self, body: dict[str, Any], prompt: str | list[int]) -> list[int] | None:
        """The token ids the engine will compute, when they can be known here."""
        if "messages" in body:
            encode_chat = getattr(self._tokenizer, "encode_chat", None)
            return None if encode_chat is None else encode_chat(body)
        if isinstance(prompt, list):
            return prompt  # token-id prompts reach the engine unchanged
        if self._tokenizer is not None:
            return self._tokenizer.encode_ids(prompt)
        return None
