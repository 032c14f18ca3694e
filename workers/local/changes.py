"""What a new deployment file changes for a running local stack: pure decisions, nothing started.

A running stack can take a new file in one of four ways:
- spec.adapters (LoRA): the adapters file is rewritten and the running workers load and unload at run
  time (adapters.py); neither a restart nor a new KV generation, and it combines with the others. Only
  turning LoRA on in a stack whose workers and router run without it needs a restart of `up`;
- a new KV generation (api/generation.py: model source and revision, dtype, block size, ...): a
  make-before-break rollout, new workers beside the old ones (rollout.py);
- the same generation: replica counts change in place (workers added or drained and stopped);
- neither: changes that the running processes cannot take (the router's settings, the workers'
  settings without a new generation) are listed as needing a restart of `up`, and cluster-only
  fields (autoscaling bounds, resources, scheduling) as having no effect locally.
A new `spec.mode`, `spec.model.name` or `metadata.name` is refused outright: the router serves one
model name in one mode, and the stack one deployment.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from splitserve.api.generation import generation_changes, kv_flags
from splitserve.local.deployment import LocalDeployment
from splitserve.local.plan import role_counts

# Spec paths (or prefixes, ending in ".") that change nothing in local processes: cluster sizing,
# scheduling and monitoring; ports are allocated locally.
NO_LOCAL_EFFECT = (
    "prefill.minReplicas",
    "prefill.maxReplicas",
    "decode.minReplicas",
    "decode.maxReplicas",
    "prefill.resources.",
    "decode.resources.",
    "prefill.nodeSelector",
    "decode.nodeSelector",
    "prefill.tolerations",
    "decode.tolerations",
    "prefill.affinity",
    "decode.affinity",
    "prefill.terminationGracePeriodSeconds",
    "decode.terminationGracePeriodSeconds",
    "model.parameterCount",
    "engine.imagePullPolicy",
    "engine.port",
    "engine.gpuMemoryUtilization",
    "engine.kvEventsPort",
    "kvTransfer.sideChannelPort",
    "router.replicas",
    "router.image",
    "router.serviceType",
    "router.port",
    "router.cpu",
    "router.memory",
    "autoscaling.",
    "monitoring.",
    "optimization.",
    "rollout.",
)
REPLICAS = ("prefill.replicas", "decode.replicas")
ADAPTERS = "adapters"
REFUSED = ("mode", "model.name")
# Leaves that api/generation.py hashes (extraArgs only for their KV-shaping flags, handled apart).
GENERATION_PREFIXES = (
    "model.source.",
    "model.dtype",
    "model.quantization",
    "model.maxModelLen",
    "engine.kvCacheDtype",
    "engine.blockSize",
    "engine.image",
    "prefill.tensorParallelSize",
    "decode.tensorParallelSize",
    "kvTransfer.connector",
    "kvTransfer.bufferDevice",
    "kvTransfer.sharedStoragePath",
)
EXTRA_ARGS = ("engine.extraArgs", "prefill.extraArgs", "decode.extraArgs")


def _matches(path: str, patterns: tuple[str, ...]) -> bool:
    return any(path.startswith(pattern) if pattern.endswith(".") else path == pattern for pattern in patterns)


def _leaves(value: Any, prefix: str = "") -> dict[str, Any]:
    """Every leaf of a JSON-like value by dotted path (lists are leaves)."""
    if isinstance(value, dict):
        leaves: dict[str, Any] = {}
        for key, child in value.items():
            leaves.update(_leaves(child, f"{prefix}{key}."))
        return leaves
    return {prefix.rstrip("."): value}


def _spec_leaves(deployment: LocalDeployment) -> dict[str, Any]:
    return _leaves(deployment.spec.model_dump(by_alias=True, mode="json"))


def _show(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    return text if len(text) <= 60 else text[:57] + "..."


def _non_kv_args(args: list[str]) -> list[str]:
    rest = list(args)
    for arg in kv_flags(args):
        rest.remove(arg)
    return rest


@dataclass(frozen=True)
class Change:
    """A new file against the running stack."""

    generation_before: str
    generation_after: str
    # generation_changes(): "path: old -> new" for each generation input that differs.
    generation_changes: tuple[str, ...] = ()
    refused: tuple[str, ...] = ()
    # Per role (prefill, decode, aggregated) whose count differs: (running, asked).
    replicas: dict[str, tuple[int, int]] = field(default_factory=dict)
    worker_settings: tuple[str, ...] = ()
    router_settings: tuple[str, ...] = ()
    no_local_effect: tuple[str, ...] = ()
    # spec.adapters changed and the running workers take it at run time: "adapters: a, b -> a, c".
    adapters: str | None = None

    @property
    def new_generation(self) -> bool:
        return self.generation_before != self.generation_after

    @property
    def needs_restart(self) -> tuple[str, ...]:
        """What the running stack leaves as it is: the router's settings always, the workers' settings
        unless a new generation brings new workers."""
        return self.router_settings + (() if self.new_generation else self.worker_settings)

    @property
    def applies_nothing(self) -> bool:
        return not self.new_generation and not self.replicas and self.adapters is None


def describe_change(
    workers_from: LocalDeployment,
    router_from: LocalDeployment,
    new: LocalDeployment,
    generation_before: tuple[str, dict[str, Any]],
    generation_after: tuple[str, dict[str, Any]],
    adapters_from: LocalDeployment | None = None,
) -> Change:
    """What `new` changes. `workers_from`: the deployment the running workers were started from (replica
    counts as they run); `router_from`: the one the router was started from (it never restarts);
    `adapters_from`: the one whose adapters the adapters file lists now (default `workers_from`)."""
    refused = []
    if new.name != router_from.name:
        refused.append(f"metadata.name is {new.name!r}, the stack runs {router_from.name!r}")
    router_leaves, worker_leaves, new_leaves = _spec_leaves(router_from), _spec_leaves(workers_from), _spec_leaves(new)
    refused += [
        f"spec.{path} cannot change in a running stack ({_show(router_leaves[path])} -> {_show(new_leaves[path])}); "
        "stop `splitserve up` and start it again with the new file"
        for path in REFUSED
        if router_leaves.get(path) != new_leaves.get(path)
    ]
    worker_settings, router_settings, no_effect = [], [], []
    for path, value in new_leaves.items():
        before = router_leaves.get(path) if path.startswith("router.") else worker_leaves.get(path)
        if before == value or path == ADAPTERS or _matches(path, REFUSED + REPLICAS + GENERATION_PREFIXES):
            continue
        if path in EXTRA_ARGS and _non_kv_args(list(before or [])) == _non_kv_args(list(value or [])):
            continue  # only KV-shaping flags changed: that is the generation's business
        line = f"{path}: {_show(before)} -> {_show(value)}"
        if _matches(path, NO_LOCAL_EFFECT):
            no_effect.append(line)
        elif path.startswith("router."):
            router_settings.append(line)
        else:
            worker_settings.append(line)
    adapters = None
    listed = _spec_leaves(adapters_from).get(ADAPTERS) if adapters_from is not None else worker_leaves.get(ADAPTERS)
    asked_adapters = new_leaves.get(ADAPTERS) or []
    if (listed or []) != asked_adapters:
        line = f"adapters: {_adapter_names(listed or [], asked_adapters)}"
        if worker_leaves.get(ADAPTERS) and router_leaves.get(ADAPTERS):
            adapters = line  # the workers and the router run with LoRA on: loaded at run time
        else:
            # Started without LoRA (no --enable-lora, no --lora): only new processes could take it.
            router_settings.append(f"{line} (LoRA on needs workers and a router started with it)")
    running, asked = role_counts(workers_from), role_counts(new)
    replicas = {role: (running.get(role, 0), count) for role, count in asked.items() if running.get(role, 0) != count}
    return Change(
        generation_before=generation_before[0],
        generation_after=generation_after[0],
        generation_changes=tuple(generation_changes(generation_before[1], generation_after[1])),
        refused=tuple(refused),
        replicas=replicas,
        worker_settings=tuple(worker_settings),
        router_settings=tuple(router_settings),
        no_local_effect=tuple(no_effect),
        adapters=adapters,
    )


def _adapter_names(before: list[Any], after: list[Any]) -> str:
    """`a, b -> a, c` (`none` for no adapter); `a (source changed)` when only sources differ."""

    def names(adapters: list[Any]) -> list[str]:
        return [str(adapter.get("name")) for adapter in adapters if isinstance(adapter, dict)]

    if names(before) == names(after):
        moved = [name for name, old, new in zip(names(before), before, after, strict=True) if old != new]
        return ", ".join(f"{name} (source changed)" for name in moved)
    return f"{', '.join(names(before)) or 'none'} -> {', '.join(names(after)) or 'none'}"


def with_replicas(running: LocalDeployment, counts: Mapping[str, int]) -> LocalDeployment:
    """`running` with other worker counts (role_counts' keys): what the workers run after an in-place change."""
    replicas = {
        "prefill": counts.get("prefill", running.spec.prefill.replicas),
        "decode": counts.get("decode", counts.get("aggregated", running.spec.decode.replicas)),
    }
    spec = running.spec.model_copy(
        update={pool: getattr(running.spec, pool).model_copy(update={"replicas": n}) for pool, n in replicas.items()}
    )
    document = copy.deepcopy(running.document)
    for pool, count in replicas.items():
        document["spec"].setdefault(pool, {})["replicas"] = count
    return LocalDeployment(name=running.name, spec=spec, document=document)
