from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from splitserve.sim.tokens import (
    OUTPUT_WORDS,
    block_hashes,
    chat_prompt,
    generate_text,
    output_token,
    prompt_digest,
    tokenize,
)


def test_words_and_punctuation_are_tokens() -> None:
    assert len(tokenize("Hello, world!")) == 4
    assert tokenize("a  b\n c") == tokenize("a b c")
    assert tokenize("") == []


def test_output_words_round_trip_one_token_each() -> None:
    text = generate_text(tokenize("The quick brown fox"), 12)
    assert len(text.split()) == 12
    assert all(word in OUTPUT_WORDS for word in text.split())
    assert len(tokenize(text)) == 12


@given(st.lists(st.integers(0, 31999), min_size=1, max_size=50), st.integers(1, 30))
def test_generation_is_a_function_of_prompt_and_position(ids: list[int], n: int) -> None:
    longer = generate_text(ids, n + 5)
    assert generate_text(ids, n) == longer[: len(generate_text(ids, n))]
    assert longer.startswith(generate_text(ids, n))
    digest = prompt_digest(ids)
    assert [output_token(digest, i) for i in range(n)] == [output_token(prompt_digest(list(ids)), i) for i in range(n)]


def test_different_prompts_give_different_text() -> None:
    assert generate_text(tokenize("alpha beta"), 16) != generate_text(tokenize("alpha gamma"), 16)


def test_chat_template() -> None:
    prompt = chat_prompt([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert prompt == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    parts = chat_prompt([{"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    assert parts == "<|user|>\nHi\n<|assistant|>\n"


@given(st.lists(st.integers(0, 100), max_size=60), st.lists(st.integers(0, 100), max_size=60), st.integers(1, 8))
def test_block_hashes_name_prefixes(a: list[int], b: list[int], block_size: int) -> None:
    ha, hb = block_hashes(a, block_size), block_hashes(b, block_size)
    assert len(ha) == len(a) // block_size
    for i, (x, y) in enumerate(zip(ha, hb, strict=False)):
        same_prefix = a[: (i + 1) * block_size] == b[: (i + 1) * block_size]
        assert (x == y) == same_prefix
