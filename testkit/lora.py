"""Simulated engines with LoRA adapters, and requests naming a model: what the router's and the
gateway's LoRA tests share."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from splitserve.sim import SimWorker
from splitserve.sim.config import LoRAConfig
from testkit.router import sim_config

BASE = "sim-model"  # sim_config's served model name
PROMPT = "the quick brown fox jumps over the lazy dog " * 4


def make_adapter_dirs(root: Path, names: tuple[str, ...] = ("a", "b")) -> dict[str, str]:
    """Adapter folders as a loader expects them (the simulator reads only adapter_config.json)."""
    dirs = {}
    for name in names:
        folder = root / name
        folder.mkdir()
        (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
        dirs[name] = str(folder)
    return dirs


def lora_sim(role: str, adapter_dirs: dict[str, str], *names: str) -> SimWorker:
    """A simulated worker of ``role`` with the adapters ``names`` loaded at start."""
    modules = tuple((name, adapter_dirs[name]) for name in names)
    return SimWorker(sim_config(role, lora=LoRAConfig(max_loras=2, modules=modules)))


async def post(http: aiohttp.ClientSession, url: str, model: str, prompt: str = PROMPT) -> tuple[int, dict[str, Any]]:
    """A greedy completion for ``model``: (status, answer)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    async with http.post(url + "/v1/completions", json=body) as response:
        return response.status, orjson.loads(await response.read())
