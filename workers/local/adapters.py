"""spec.adapters in `splitserve up`: the adapters file the local workers follow, and the tiny adapters.

As in a cluster, every worker of a deployment with adapters runs with LoRA on and an adapter sync
(`--adapters-file`, splitserve.engine.adapters) that keeps its adapters equal to one file; locally that
file is RUN_DIR/adapters.json, in the format of the cluster's ConfigMap (builders.adapters). `up`
rewrites it when a new version of the deployment changes the list, and the running workers load and
unload at run time: no worker restarts, no new KV generation.

An adapter source `uri: splitserve://tiny-lora/NAME` stands for a tiny random LoRA adapter of the tiny
model: with --engine vllm, the peft adapter `splitserve tiny-model --lora NAME` builds beside the model
(MODEL_DIR/loras/NAME); with --engine sim, a folder holding only its adapter_config.json, all that a
simulator reads.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from splitserve.api.spec import AdapterSource, AdapterSpec
from splitserve.builders.adapters import adapters_file, adapters_file_text
from splitserve.engine.tiny_model import LORA_ALPHA, LORA_RANK, LORA_TARGET_MODULES
from splitserve.local.deployment import LocalDeployment, tiny_lora_name

ADAPTERS_FILE = "adapters.json"
SIM_LORAS_DIR = "sim-loras"


def tiny_lora_names(deployment: LocalDeployment) -> list[str]:
    """The tiny adapters the deployment names (`uri: splitserve://tiny-lora/NAME`), in its order."""
    names = (tiny_lora_name(adapter.source.uri) for adapter in deployment.spec.adapters)
    return [name for name in names if name is not None]


def adapters_document(deployment: LocalDeployment, tiny_loras: Mapping[str, str]) -> dict[str, Any]:
    """The adapters file of a local deployment: the cluster's, a tiny adapter's uri replaced by its folder
    (`tiny_loras`: NAME -> folder)."""

    def local(adapter: AdapterSpec) -> AdapterSpec:
        name = tiny_lora_name(adapter.source.uri)
        if name is None:
            return adapter
        return adapter.model_copy(update={"source": AdapterSource(uri=tiny_loras[name])})

    spec = deployment.spec
    return adapters_file(spec.model_copy(update={"adapters": [local(adapter) for adapter in spec.adapters]}))


def write_adapters_file(path: Path, document: dict[str, Any]) -> bool:
    """Write the file whole (the workers read it every 2 s and must never see half of it); False when it
    already says the same."""
    text = adapters_file_text(document)
    try:
        if path.read_text(encoding="utf-8") == text:
            return False
    except OSError:
        pass
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)
    return True


def write_sim_lora(root: Path, name: str) -> str:
    """A tiny adapter for the simulators: its adapter_config.json only (they read its rank)."""
    folder = root / SIM_LORAS_DIR / name
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "base_model_name_or_path": None,
        "lora_alpha": LORA_ALPHA,
        "peft_type": "LORA",
        "r": LORA_RANK,
        "target_modules": list(LORA_TARGET_MODULES),
        "task_type": "CAUSAL_LM",
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return str(folder)
