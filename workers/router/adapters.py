"""What each worker serves of LoRA adapters, read from the worker itself (pure parsing).

The router does not trust a declared list: an adapter is routable to a worker only once that worker's
own ``GET /v1/models`` lists it (vLLM lists each loaded adapter with ``parent`` set to the base model),
so a request is never sent to a worker that would answer 404, whether the adapter is still loading,
failed to load or was unloaded. Which adapters are *active* (holding a LoRA slot in the engine's
batch) comes from vLLM's ``vllm:lora_requests_info`` gauge, as llm-d's LoRA-affinity scorer reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

LORA_INFO_METRIC = "vllm:lora_requests_info"


@dataclass(frozen=True)
class ModelCard:
    id: str
    parent: str | None
    root: str | None = None


def parse_models(body: bytes) -> tuple[ModelCard, ...]:
    """The cards of an OpenAI ``/v1/models`` answer; ValueError when it is not one."""
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        raise ValueError(f"not JSON: {error}") from None
    data = document.get("data") if isinstance(document, dict) else None
    if not isinstance(data, list):
        raise ValueError("no data list")
    cards = []
    for entry in data:
        if isinstance(entry, dict) and isinstance(entry.get("id"), str):
            parent, root = entry.get("parent"), entry.get("root")
            parent = parent if isinstance(parent, str) else None
            cards.append(ModelCard(entry["id"], parent, root if isinstance(root, str) else None))
    return tuple(cards)


def adapter_names(cards: tuple[ModelCard, ...]) -> frozenset[str]:
    """The adapters among ``cards``: those with a parent model."""
    return frozenset(card.id for card in cards if card.parent is not None)


def _label(labels: str, name: str) -> str:
    start = labels.find(f'{name}="')
    if start < 0:
        return ""
    start += len(name) + 2
    end = labels.find('"', start)
    return labels[start:end] if end >= 0 else ""


def parse_active_adapters(metrics_text: str) -> frozenset[str]:
    """Adapters running or waiting in the engine, from the newest ``vllm:lora_requests_info`` series.

    vLLM keeps one series per label combination it has reported and sets each to the time of its
    report, so the series with the largest value is the current state.
    """
    newest = -1.0
    current = ""
    for line in metrics_text.splitlines():
        if not line.startswith(LORA_INFO_METRIC + "{"):
            continue
        labels, _, value = line.rpartition("}")
        try:
            stamp = float(value.strip().split(" ")[0])
        except ValueError:
            continue
        if stamp > newest:
            newest, current = stamp, labels
    if newest < 0:
        return frozenset()
    names = _label(current, "running_lora_adapters").split(",") + _label(current, "waiting_lora_adapters").split(",")
    return frozenset(name for name in names if name)
