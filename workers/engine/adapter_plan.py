"""The adapter sync's decisions, with no I/O: the adapters file and the engine's /v1/models read, what
to load and unload, when to retry a failed load, and the pod condition that reports the outcome.

The I/O around them (HTTP to the engine, downloads, the Kubernetes API) is adapters.py and
pod_condition.py.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

# The pod condition's reasons are the operator's (api.topology), which reads them back.
from splitserve.api.topology import ADAPTER_LOAD_FAILED, ADAPTERS_LOADED, ADAPTERS_LOADING
from splitserve.router.adapters import parse_models as parse_model_cards


class AdaptersFileError(ValueError):
    """The adapters file is not what the plan says: the message says where."""


@dataclass(frozen=True)
class HuggingFaceSource:
    repo: str
    revision: str | None = None

    def __str__(self) -> str:
        return f"{self.repo}@{self.revision}" if self.revision else self.repo


@dataclass(frozen=True)
class AdapterEntry:
    """One adapter of the file: a `path` handed to vLLM as is, or a Hugging Face repo to download."""

    name: str
    path: str | None = None
    hugging_face: HuggingFaceSource | None = None

    @property
    def source(self) -> str:
        return self.path if self.path is not None else f"huggingFace {self.hugging_face}"


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise AdaptersFileError(f"{where}: must be a non-empty string")
    return value


def _entry(item: Any, index: int) -> AdapterEntry:
    where = f"adapters[{index}]"
    if not isinstance(item, dict):
        raise AdaptersFileError(f"{where}: must be an object")
    name = _string(item.get("name"), f"{where}.name")
    path, hub = item.get("path"), item.get("huggingFace")
    if (path is None) == (hub is None):
        raise AdaptersFileError(f"{where} ({name}): give exactly one of path, huggingFace")
    if path is not None:
        return AdapterEntry(name, path=_string(path, f"{where}.path"))
    if not isinstance(hub, dict):
        raise AdaptersFileError(f"{where}.huggingFace: must be an object")
    revision = hub.get("revision")
    source = HuggingFaceSource(
        _string(hub.get("repo"), f"{where}.huggingFace.repo"),
        None if revision is None else _string(revision, f"{where}.huggingFace.revision"),
    )
    return AdapterEntry(name, hugging_face=source)


def parse_adapters_file(text: str) -> tuple[AdapterEntry, ...]:
    """The entries of an adapters file: `{"adapters": [{"name", "path" | "huggingFace": {"repo", "revision"}}]}`.

    Raises AdaptersFileError for anything else (names must be unique). Unknown keys are ignored, so an
    operator newer than the worker may add some.
    """
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise AdaptersFileError(f"not valid JSON: {error.msg} (line {error.lineno})") from error
    if not isinstance(document, dict) or not isinstance(document.get("adapters"), list):
        raise AdaptersFileError('must be an object with an "adapters" list')
    entries = tuple(_entry(item, index) for index, item in enumerate(document["adapters"]))
    seen: set[str] = set()
    for entry in entries:
        if entry.name in seen:
            raise AdaptersFileError(f"adapter {entry.name} is listed twice")
        seen.add(entry.name)
    return entries


# --------------------------------------------------------------------------- the engine's side


@dataclass(frozen=True)
class AdapterCard:
    root: str | None  # vLLM: the lora_path it was loaded from; None: not said, taken as the wanted one
    parent: str


@dataclass(frozen=True)
class EngineModels:
    """What /v1/models says: the base model ids, and the adapters (cards with a `parent`) by name."""

    base: frozenset[str]
    adapters: Mapping[str, AdapterCard]


def parse_models(body: bytes) -> EngineModels:
    """Read an OpenAI /v1/models answer (the router's reading of it); ValueError if it is not one."""
    base: set[str] = set()
    adapters: dict[str, AdapterCard] = {}
    for card in parse_model_cards(body):
        if card.parent:
            adapters[card.id] = AdapterCard(card.root, card.parent)
        else:
            base.add(card.id)
    return EngineModels(frozenset(base), adapters)


def error_message(status: int, text: str) -> str:
    """vLLM's own words from an error answer (`{"error": {"message"}}`, or an older `{"message"}`)."""
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if isinstance(body, dict):
        error = body.get("error")
        message = error.get("message") if isinstance(error, dict) else body.get("message")
        if isinstance(message, str) and message:
            return message
    text = " ".join(text.split())
    return text[:300] if text else f"HTTP {status}"


@dataclass(frozen=True)
class SyncPlan:
    load: tuple[tuple[str, str], ...] = ()  # (name, path): not served yet
    reload: tuple[tuple[str, str], ...] = ()  # (name, path): served from another path, loaded in place
    unload: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.load or self.reload or self.unload)


def plan_sync(
    listed: Collection[str], paths: Mapping[str, str], served: EngineModels, ours: Collection[str] = ()
) -> SyncPlan:
    """What makes the engine serve the file's adapters.

    `listed`: every name in the file; `paths`: the names whose lora_path is known (a Hugging Face
    download may still run: such a name is neither loaded nor unloaded). Unloaded: adapters the file no
    longer lists that are children of a base model or were loaded by us (`ours`); a base model never.
    """
    load, reload = [], []
    for name in sorted(paths):
        card = served.adapters.get(name)
        if card is None:
            load.append((name, paths[name]))
        elif card.root is not None and card.root != paths[name]:
            reload.append((name, paths[name]))
    unload = [
        name
        for name, card in sorted(served.adapters.items())
        if name not in listed and name not in served.base and (card.parent in served.base or name in ours)
    ]
    return SyncPlan(tuple(load), tuple(reload), tuple(unload))


def confirmed(paths: Mapping[str, str], served: EngineModels) -> set[str]:
    """The names /v1/models lists as loaded from the path we want (or from a path it does not say)."""
    return {
        name
        for name, path in paths.items()
        if (card := served.adapters.get(name)) is not None and card.root in (path, None)
    }


def retry_delay(failures: int, *, first_s: float = 2.0, cap_s: float = 300.0) -> float:
    """Seconds before the next attempt after `failures` failed ones in a row: doubling, capped."""
    doublings = max(0, min(failures - 1, 30))
    return float(min(cap_s, first_s * 2**doublings))


# --------------------------------------------------------------------------- the outcome


@dataclass(frozen=True)
class AdaptersState:
    """Where the sync stands: adapters loaded (confirmed by /v1/models), failed (name -> reason, as
    vLLM or the download said it), and pending (listed, neither yet: engine not ready, downloading,
    about to load or waiting to retry after the engine went away)."""

    loaded: tuple[str, ...] = ()
    failed: Mapping[str, str] = field(default_factory=dict)
    pending: tuple[str, ...] = ()

    @property
    def ready(self) -> bool:
        return not self.failed and not self.pending

    def summary(self) -> str:
        parts = [f"loaded {', '.join(self.loaded) or 'none'}"]
        if self.pending:
            parts.append(f"pending {', '.join(self.pending)}")
        if self.failed:
            parts.append(f"failed {', '.join(sorted(self.failed))}")
        return "; ".join(parts)


def adapters_state(listed: Iterable[str], loaded: Collection[str], failed: Mapping[str, str]) -> AdaptersState:
    """The state of the listed names: loaded wins over an old failure; failed over pending."""
    names = list(listed)
    return AdaptersState(
        loaded=tuple(sorted(name for name in names if name in loaded)),
        failed={name: failed[name] for name in sorted(names) if name in failed and name not in loaded},
        pending=tuple(sorted(name for name in names if name not in loaded and name not in failed)),
    )


@dataclass(frozen=True)
class Condition:
    status: str  # "True" | "False"
    reason: str
    message: str


def adapters_condition(state: AdaptersState) -> Condition:
    """The pod condition for a state. A failure wins over loading: a failed adapter needs a person.

    AdapterLoadFailed's message is one `name: reason` per failed adapter, `; `-joined (the operator
    reads it per adapter); the others name the adapters loaded or still loading.
    """
    if state.failed:
        failures = "; ".join(f"{name}: {why}" for name, why in state.failed.items())
        return Condition("False", ADAPTER_LOAD_FAILED, failures)
    if state.pending:
        return Condition("False", ADAPTERS_LOADING, f"loading {', '.join(state.pending)}")
    loaded = ", ".join(state.loaded)
    return Condition("True", ADAPTERS_LOADED, f"loaded {loaded}" if loaded else "no adapters listed")
