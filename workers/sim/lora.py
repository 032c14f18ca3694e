"""LoRA adapters in the simulated engine, as vLLM's OpenAIServingModels keeps them (vLLM 0.32).

An adapter is loaded from a folder holding a peft ``adapter_config.json`` (the simulator reads only its
rank ``r``; it has no weights to apply: a request for the adapter answers text seeded by its name, see
tokens.py), at start from ``--lora-modules`` or at run time through ``POST /v1/load_lora_adapter``.
The outcomes and their texts are vLLM's:

- loaded: 200, ``Success: LoRA adapter 'NAME' added successfully.`` (plain text);
- no ``adapter_config.json`` under the path: 404 ``NotFoundError`` ``Loading lora NAME failed: No
  adapter found for PATH``;
- a rank above ``--max-lora-rank``: 500 ``InternalServerError`` ``LoRA rank R is greater than
  max_lora_rank M.``;
- name or path missing, the base model's name, or a name loaded already (without ``load_inplace``):
  400 ``InvalidUserInput``;
- unloaded: 200 ``Success: LoRA adapter 'NAME' removed successfully.``; not loaded: 404.

Each adapter gets an integer id from a counter starting at 1 (``lora_int_id``, published as a KV
event's ``lora_id``); reloading a name in place keeps its id.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from splitserve.sim.protocol import RequestError

INVALID_USER_INPUT = "InvalidUserInput"


@dataclass(frozen=True)
class LoRARequest:
    """A loaded adapter (vLLM's LoRARequest): what a request for it carries into the engine."""

    name: str
    int_id: int
    path: str
    rank: int


def parse_lora_module(text: str) -> tuple[str, str]:
    """One ``--lora-modules`` value: ``NAME=PATH`` or vLLM's JSON form ``{"name": ..., "path": ...}``."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"--lora-modules {text!r} is not JSON: {error}") from error
        name, path = (value.get("name"), value.get("path")) if isinstance(value, dict) else (None, None)
        if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
            raise ValueError(f'--lora-modules {text!r}: the JSON form needs "name" and "path"')
        return name, path
    name, separator, path = text.partition("=")
    if not separator or not name or not path:
        raise ValueError(f"--lora-modules {text!r} must be NAME=PATH")
    return name, path


def adapter_rank(path: str) -> int | None:
    """The rank in ``PATH/adapter_config.json``; None when there is no adapter there (vLLM's not found)."""
    config_path = Path(os.path.expanduser(path)) / "adapter_config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    rank = config.get("r") if isinstance(config, dict) else None
    return rank if isinstance(rank, int) and not isinstance(rank, bool) and rank > 0 else None


class LoRARegistry:
    """The adapters one engine serves, by name, in load order."""

    def __init__(self, base_model: str, max_lora_rank: int) -> None:
        self.base_model = base_model
        self.max_lora_rank = max_lora_rank
        self._loaded: dict[str, LoRARequest] = {}
        self._next_id = 1

    def __contains__(self, name: object) -> bool:
        return name in self._loaded

    def get(self, name: str) -> LoRARequest | None:
        return self._loaded.get(name)

    @property
    def adapters(self) -> list[LoRARequest]:
        return list(self._loaded.values())

    def load(self, name: object, path: object, load_inplace: bool = False) -> str:
        """Load ``name`` from ``path``; vLLM's success text, or RequestError with vLLM's error."""
        if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
            raise RequestError(400, "Both 'lora_name' and 'lora_path' must be provided.", INVALID_USER_INPUT)
        if name == self.base_model:
            raise RequestError(
                400, f"The lora adapter '{name}' conflicts with a served base model.", INVALID_USER_INPUT
            )
        previous = self._loaded.get(name)
        if previous is not None and not load_inplace:
            raise RequestError(
                400,
                f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, "
                "set 'load_inplace' to True.",
                INVALID_USER_INPUT,
            )
        rank = adapter_rank(path)
        if rank is None:
            raise RequestError(404, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError")
        if rank > self.max_lora_rank:
            raise RequestError(
                500, f"LoRA rank {rank} is greater than max_lora_rank {self.max_lora_rank}.", "InternalServerError"
            )
        int_id = previous.int_id if previous is not None else self._take_id()
        self._loaded[name] = LoRARequest(name=name, int_id=int_id, path=path, rank=rank)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, name: object) -> str:
        if not isinstance(name, str) or not name:
            raise RequestError(400, "'lora_name' needs to be provided to unload a LoRA adapter.", INVALID_USER_INPUT)
        if name not in self._loaded:
            raise RequestError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del self._loaded[name]
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _take_id(self) -> int:
        int_id, self._next_id = self._next_id, self._next_id + 1
        return int_id
