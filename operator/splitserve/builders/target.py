"""What every builder is given: the owner, the desired spec and the default images, plus the
metadata every child carries."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from splitserve.api.generation import kv_generation
from splitserve.api.spec import DEFAULT_ROUTER_IMAGE, DEFAULT_WORKER_IMAGE, InferenceDeploymentSpec
from splitserve.api.topology import Owner, common_labels


@dataclass(frozen=True)
class Images:
    """Images used when a spec leaves them unset: the operator's configuration (chart values)."""

    worker: str = DEFAULT_WORKER_IMAGE
    router: str = DEFAULT_ROUTER_IMAGE

    @classmethod
    def from_environment(cls, env: Mapping[str, str] = os.environ) -> Images:
        return cls(
            worker=env.get("SPLITSERVE_WORKER_IMAGE") or DEFAULT_WORKER_IMAGE,
            router=env.get("SPLITSERVE_ROUTER_IMAGE") or DEFAULT_ROUTER_IMAGE,
        )


@dataclass(frozen=True)
class Target:
    """Everything a builder needs: who owns the objects, the desired spec, default images."""

    owner: Owner
    spec: InferenceDeploymentSpec
    images: Images = Images()
    # PersistentVolumeClaims of spec.adapters that the cluster lacks (the reconciler looks): their adapters
    # are left out of the pods and the adapters file, so a missing claim never keeps a worker from starting.
    unavailable_claims: frozenset[str] = frozenset()

    @cached_property
    def generation(self) -> str:
        """The spec's KV generation: part of every worker pool's name, selector and pod labels."""
        return kv_generation(self.spec, self.images.worker)


def metadata(target: Target, name: str, component: str, **extra_labels: str) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": target.owner.namespace,
        "labels": common_labels(target.owner.name, component) | extra_labels,
    }
    if target.owner.uid:
        meta["ownerReferences"] = [target.owner.reference()]
    return meta
