"""Deterministic stand-ins for a tokenizer, a chat template and greedy generation.

Tokenization: a prompt is split into words and single punctuation marks (regex ``\\w+|[^\\w\\s]``);
each piece is one token whose id is ``crc32(piece) % PROMPT_VOCAB_SIZE``. So "Hello, world!" is 4 tokens.

Generation: output token ``i`` of a prompt is a pure function of the prompt's token ids, the
engine's KV generation and ``i`` (a BLAKE2 hash), rendered as one pseudo word with a leading space
(" kalo"). Any engine of one generation given the same prompt produces the same text, which is what
lets a decode worker that received KV from a prefill worker answer exactly like an aggregated worker
(greedy determinism); engines of another generation (other weights) answer other text, so a test
can tell which generation answered. Generation "" (the default) leaves the prompt's digest as is.
A LoRA adapter changes the weights too: a request for adapter ``NAME`` is seeded with the name as
well (``adapter_seed``), so the base model and each adapter answer a prompt with other text.

Chat prompt: ``<|role|>\\ncontent\\n`` for each message, then ``<|assistant|>\\n``.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from array import array
from collections.abc import Iterable, Mapping, Sequence

PROMPT_VOCAB_SIZE = 32000
_PIECE = re.compile(r"\w+|[^\w\s]")
_SYLLABLES = ("ba", "ce", "di", "fo", "gu", "ha", "je", "ki", "lo", "mu", "na", "pe", "ri", "so", "tu", "vo")
OUTPUT_WORDS: tuple[str, ...] = tuple(a + b for a in _SYLLABLES for b in _SYLLABLES)


def tokenize(text: str) -> list[int]:
    return [zlib.crc32(piece.encode()) % PROMPT_VOCAB_SIZE for piece in _PIECE.findall(text)]


def prompt_digest(token_ids: Sequence[int]) -> bytes:
    """Identity of a prompt for generation; equal token ids give equal digests."""
    return hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=16).digest()


def generation_seed(digest: bytes, generation: str) -> bytes:
    """What an engine of ``generation`` seeds a prompt's output with (the digest itself for "")."""
    if not generation:
        return digest
    return hashlib.blake2b(digest + b"\0" + generation.encode(), digest_size=16).digest()


def adapter_seed(seed: bytes, lora_name: str | None) -> bytes:
    """The seed of a request for LoRA adapter ``lora_name`` (``seed`` itself for the base model)."""
    if not lora_name:
        return seed
    return hashlib.blake2b(seed + b"\0lora\0" + lora_name.encode(), digest_size=16).digest()


def output_token(digest: bytes, position: int) -> int:
    """The greedy token at ``position`` (0-based) of the output for the prompt with ``digest``."""
    mixed = hashlib.blake2b(digest + position.to_bytes(8, "little"), digest_size=4).digest()
    return int.from_bytes(mixed, "little") % len(OUTPUT_WORDS)


def output_text(token_id: int) -> str:
    return " " + OUTPUT_WORDS[token_id % len(OUTPUT_WORDS)]


def generate_text(token_ids: Sequence[int], num_tokens: int, generation: str = "", lora_name: str | None = None) -> str:
    """The whole greedy output of ``num_tokens`` tokens; what a sim of ``generation`` answers for this
    prompt, with LoRA adapter ``lora_name`` (None: the base model)."""
    digest = adapter_seed(generation_seed(prompt_digest(token_ids), generation), lora_name)
    return "".join(output_text(output_token(digest, i)) for i in range(num_tokens))


def _content_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        # OpenAI content parts: keep the text ones, in order.
        return "".join(
            str(part.get("text", "")) for part in content if isinstance(part, dict) and part.get("type") == "text"
        )
    raise ValueError("message content must be a string or a list of content parts")


def chat_prompt(messages: Iterable[Mapping[str, object]]) -> str:
    """Render chat messages with the simulator's fixed template (see module docstring)."""
    rendered = []
    for message in messages:
        role = message.get("role")
        if not isinstance(role, str):
            raise ValueError("every message needs a string 'role'")
        rendered.append(f"<|{role}|>\n{_content_text(message.get('content', ''))}\n")
    return "".join(rendered) + "<|assistant|>\n"


HASH_MASK = (1 << 64) - 1
"""Block hashes are unsigned 64-bit, as vLLM publishes them in KV events (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)."""


def block_hash(parent: int, token_ids: Sequence[int], extra: int = 0) -> int:
    """Hash of one full block given its parent's hash (0 for the first block of a sequence) and the
    block's extra key (``lora_extra_key``; 0: none).

    Python's hash of a tuple of ints is not randomised between processes, so these are stable.
    """
    if extra:
        return hash((parent, tuple(token_ids), extra)) & HASH_MASK
    return hash((parent, tuple(token_ids))) & HASH_MASK


def lora_extra_key(lora_name: str | None, lora_path: str | None = None) -> int:
    """The extra key a LoRA request mixes into every one of its blocks, as vLLM's block hash mixes
    ``("lora", name, path)``; 0 for the base model. An int (Python's str hash varies per process)."""
    if not lora_name:
        return 0
    key = f"lora\0{lora_name}\0{lora_path or ''}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") or 1


def block_hashes(token_ids: Sequence[int], block_size: int, extra: int = 0) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids`` (as vLLM's prefix cache keys blocks).

    Block ``i``'s hash covers every token before it too, so equal hashes mean equal prefixes.
    ``extra`` (a LoRA request's ``lora_extra_key``) goes into every block, so one adapter's blocks
    never match another's or the base model's.
    """
    hashes: list[int] = []
    parent = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size], extra)
        hashes.append(parent)
    return hashes
