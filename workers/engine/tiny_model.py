"""A tiny random-weight Llama model with a byte-level BPE tokenizer, built offline.

Nothing may come from a model hub on these machines, yet vLLM needs a real model to serve. This one
has the Llama architecture (which every vLLM backend supports), a head size of 32 (supported by the
CPU attention backend), weights drawn from N(0, 0.2) so greedy output varies with the prompt, and a
chat template so /v1/chat/completions works. Same seed, same files, byte for byte.

Tiny LoRA adapters for it (``build_tiny_lora``): peft adapters of rank 8 on every Llama projection,
random A and B (``init_lora_weights=False``, so the adapter really changes the output), seeded by the
adapter's name. Same name, same files, byte for byte, on any machine: no path of this one is written.

torch, transformers, tokenizers and safetensors come with vLLM; they are imported inside the
functions so that importing this module stays cheap.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VOCAB_SIZE = 2048
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN]
WEIGHT_STD = 0.2
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# The files a loader needs; their hashes identify a build.
MODEL_FILES = (
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

# The tiny LoRA adapters: DIR/loras/NAME next to the model in DIR. vLLM reads these two files.
LORAS_DIR = "loras"
LORA_FILES = ("adapter_config.json", "adapter_model.safetensors")
LORA_RANK = 8
LORA_ALPHA = 16
LORA_TARGET_MODULES = ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")
# A directory name, and a valid OpenAI model name (the adapter is served under it).
LORA_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class TinyModelShape:
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    max_position_embeddings: int = 2048


_SYLLABLES = [
    consonant + vowel
    for consonant in ["", "b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "st", "tr"]
    for vowel in ["a", "e", "i", "o", "u", "ai", "ou"]
]


def training_corpus(seed: int, lines: int = 3000) -> list[str]:
    """Pseudo-words, digits and punctuation: enough variety for ~2k BPE merges, fixed by the seed."""
    rng = random.Random(seed)
    words = ["".join(rng.choices(_SYLLABLES, k=rng.randint(1, 4))) for _ in range(1500)]
    corpus = []
    for _ in range(lines):
        parts = [rng.choice(words) for _ in range(rng.randint(4, 16))]
        parts.append(str(rng.randint(0, 9999)))
        corpus.append(" ".join(parts).capitalize() + rng.choice([".", "?", "!", ",", ":"]))
    return corpus


def build_tokenizer(seed: int, vocab_size: int = VOCAB_SIZE) -> Any:
    """A byte-level BPE trained on the seeded corpus, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # any byte string stays encodable
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(seed), trainer=trainer)
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=TinyModelShape.max_position_embeddings,
    )


def build_model(seed: int, vocab_size: int, bos_id: int, eos_id: int, pad_id: int, shape: TinyModelShape) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=shape.max_position_embeddings,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model: Any = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, parameter in sorted(model.named_parameters()):
            # Matrices random, norm scales left at 1: a well-conditioned but arbitrary function.
            if parameter.dim() >= 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * WEIGHT_STD)
    return model.to(torch.float32)


def build_tiny_model(directory: Path, seed: int = 0, shape: TinyModelShape | None = None) -> dict[str, str]:
    """Write the model and tokenizer to `directory`; returns {file name: sha256} of MODEL_FILES."""
    shape = shape or TinyModelShape()
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(seed)
    vocab_size = len(tokenizer)
    model = build_model(
        seed,
        vocab_size,
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        shape,
    )
    model.save_pretrained(str(directory), safe_serialization=True)
    tokenizer.save_pretrained(str(directory))
    return file_hashes(directory)


def file_hashes(directory: Path) -> dict[str, str]:
    hashes = {}
    for name in MODEL_FILES:
        path = directory / name
        if path.exists():
            hashes[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return hashes


def lora_dir(model_dir: Path, name: str) -> Path:
    """Where ``build_tiny_lora`` writes adapter ``name`` of the model in ``model_dir``."""
    return model_dir / LORAS_DIR / name


def lora_seed(name: str, seed: int = 0) -> int:
    """The adapter's random seed: a function of its name (and the model's seed), stable across processes."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF


def build_tiny_lora(model_dir: Path, name: str, seed: int = 0) -> dict[str, str]:
    """Write a random peft LoRA adapter for the tiny model in ``model_dir`` to ``lora_dir(model_dir, name)``.

    Built in a sibling folder and renamed, so a reader never sees half an adapter. Returns
    {file name: sha256} of LORA_FILES.
    """
    if not LORA_NAME.match(name):
        raise ValueError(f"adapter name {name!r} must match {LORA_NAME.pattern}")
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    config = LoraConfig(
        r=LORA_RANK,
        lora_alpha=LORA_ALPHA,
        target_modules=list(LORA_TARGET_MODULES),
        init_lora_weights=False,  # B random too: an adapter that changes nothing would prove nothing
        task_type="CAUSAL_LM",
    )
    torch.manual_seed(lora_seed(name, seed))
    peft_model = get_peft_model(model, config)
    target = lora_dir(model_dir, name)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        peft_model.save_pretrained(str(partial))
        _make_reproducible(partial)
        if target.exists():
            shutil.rmtree(target)
        os.replace(partial, target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return lora_file_hashes(target)


def _make_reproducible(adapter: Path) -> None:
    """peft writes this machine's model path and target_modules in set order (it varies with the hash
    seed of the process): write the config with neither, and drop the generated model card."""
    config_path = adapter / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = None
    config["target_modules"] = sorted(config["target_modules"])
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (adapter / "README.md").unlink(missing_ok=True)


def lora_file_hashes(adapter: Path) -> dict[str, str]:
    return {name: hashlib.sha256((adapter / name).read_bytes()).hexdigest() for name in LORA_FILES}
