"""Two generations of one model id, laid out as a local Hugging Face hub cache.

Generation A and generation B are the tiny Llama model of `splitserve.engine.tiny_model` with the
same architecture, shapes and tokenizer (tokenizer seed 0) but weights drawn from different seeds,
so vLLM's NIXL compatibility hash (model name, dtype, layer shapes, KV dtype, vLLM version) is the
same for both, while their KV caches mean different things.

The hub cache holds one repository, `splitserve/tiny`, with one snapshot per generation, as
huggingface_hub itself writes it:

    HF_HOME/hub/models--splitserve--tiny/
        blobs/<sha256 of the file>
        refs/rev-a                  (the commit of A, 40 hex digits)
        refs/rev-b                  (the commit of B)
        snapshots/<commit A>/config.json -> ../../blobs/<sha256> ...
        snapshots/<commit B>/...

so that `vllm serve splitserve/tiny --revision rev-a` resolves the ref, then loads that snapshot,
and nothing is ever fetched: with HF_HUB_OFFLINE=1, or online against hub.LocalHub, which answers
from this cache (test_generations_real.py says why its engines run online).

`python -m tests.vllm.generations DIR` builds the two model directories DIR/a and DIR/b (torch is
imported only there, not in the test process).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ID = "splitserve/tiny"
TOKENIZER_SEED = 0
# Generation name -> (git ref, weight seed). A's weights are those of `splitserve tiny-model --seed 0`.
GENERATIONS: dict[str, tuple[str, int]] = {"a": ("rev-a", 0), "b": ("rev-b", 1)}
REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_VERSION = "v1"  # bump when the files built here change


@dataclass(frozen=True)
class Snapshot:
    name: str  # "a" or "b"
    ref: str  # the revision the engine is given (a branch name under refs/)
    commit: str  # 40 hex digits
    directory: Path  # the snapshot directory inside the hub cache

    @property
    def generation(self) -> str:
        """The 10-hex-digit generation id the router is told for this snapshot's workers."""
        return self.commit[:10]


def build_generation(directory: Path, weight_seed: int) -> None:
    """The tiny model with tokenizer seed TOKENIZER_SEED and weights of `weight_seed` (imports torch)."""
    from splitserve.engine.tiny_model import TinyModelShape, build_model, build_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(TOKENIZER_SEED)
    model = build_model(
        weight_seed,
        len(tokenizer),
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        TinyModelShape(),
    )
    model.save_pretrained(str(directory), safe_serialization=True)
    tokenizer.save_pretrained(str(directory))


def build_generations(base: Path, timeout: float = 600.0) -> dict[str, Path]:
    """base/<version>/a and .../b, built once (in a subprocess) and reused while their files exist."""
    root = base / BUILD_VERSION
    directories = {name: root / name for name in GENERATIONS}
    if not all((d / "model.safetensors").exists() and (d / "tokenizer.json").exists() for d in directories.values()):
        shutil.rmtree(root, ignore_errors=True)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        command = [sys.executable, "-m", "tests.vllm.generations", str(root)]
        subprocess.run(command, check=True, capture_output=True, timeout=timeout, cwd=REPO_ROOT, env=env)
    return directories


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def lay_out_hub_cache(hf_home: Path, builds: dict[str, Path], repo_id: str = REPO_ID) -> dict[str, Snapshot]:
    """Put each build in `hf_home`'s hub cache as one snapshot of `repo_id`, with a ref per generation."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    blobs = repo / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    snapshots: dict[str, Snapshot] = {}
    for name, build in sorted(builds.items()):
        ref, _seed = GENERATIONS[name]
        files = sorted(path for path in build.iterdir() if path.is_file())
        hashes = {path.name: _sha256(path) for path in files}
        # A stand-in for the git commit: 40 hex digits, fixed by the snapshot's files.
        commit = hashlib.sha1("".join(f"{n}\0{h}\n" for n, h in sorted(hashes.items())).encode()).hexdigest()
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True, exist_ok=True)
        for path in files:
            blob = blobs / hashes[path.name]
            if not blob.exists():
                shutil.copyfile(path, blob)
            link = snapshot / path.name
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(Path("..", "..", "blobs", hashes[path.name]))
        (repo / "refs" / ref).write_text(commit)  # huggingface_hub writes no trailing newline
        snapshots[name] = Snapshot(name, ref, commit, snapshot)
    return snapshots


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.vllm.generations DIR", file=sys.stderr)
        return 2
    root = Path(argv[0])
    for name, (_ref, seed) in GENERATIONS.items():
        build_generation(root / name, seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
