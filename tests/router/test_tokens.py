"""Prompt measurement: lengths and chained block hashes."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from splitserve.router.tokens import PromptMeasurer, chain_hashes_bytes, chain_hashes_ids, prompt_text


@given(a=st.binary(max_size=400), b=st.binary(max_size=400), block=st.integers(min_value=1, max_value=64))
def test_chained_hashes_share_exactly_the_common_full_blocks(a: bytes, b: bytes, block: int) -> None:
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    ha, hb = chain_hashes_bytes(a, block), chain_hashes_bytes(b, block)
    assert len(ha) == len(a) // block
    shared = 0
    while shared < min(len(ha), len(hb)) and ha[shared] == hb[shared]:
        shared += 1
    assert shared == min(common // block, len(ha), len(hb))


@given(ids=st.lists(st.integers(min_value=0, max_value=2**31), max_size=100), extra=st.lists(st.integers(0, 100)))
def test_token_id_hashes_are_prefix_stable(ids: list[int], extra: list[int]) -> None:
    base = chain_hashes_ids(ids, 8)
    assert chain_hashes_ids(ids + extra, 8)[: len(base)] == base


def test_approximate_token_count_is_bytes_over_four() -> None:
    measurer = PromptMeasurer(None, block_tokens=16, approx_bytes_per_token=4, want_hashes=False)
    assert measurer.measure({"prompt": "x" * 400}).tokens == 100
    assert measurer.measure({"prompt": [1, 2, 3]}).tokens == 3
    assert measurer.measure({"prompt": "é" * 2}).tokens == 1  # 4 UTF-8 bytes
    assert measurer.measure({"prompt": "abc"}).block_hashes == ()


def test_chat_prompt_text_joins_roles_and_contents() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hello"}]},
        ]
    }
    assert prompt_text(body) == "system\nbe brief\nuser\nhello"
