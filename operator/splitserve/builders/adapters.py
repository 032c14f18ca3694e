"""spec.adapters (LoRA): the adapters file every worker loads its adapters from, the volumes the adapters are
read from, and the worker pods' account that reports what each worker loaded.

The workers load adapters at run time, never through `--lora-modules` in the pod template: a change of the
adapter list must roll no pod and start no KV generation (the base model's KV does not change). So the list
lives in a ConfigMap, `<name>-adapters`, which the kubelet refreshes inside the running pods; each worker's
adapter sync (`splitserve worker --adapters-file`) loads the new adapters and unloads the removed through
vLLM's runtime API, confirms them from /v1/models, and sets the splitserve.io/AdaptersReady condition on its
own pod, which the operator rolls up into status.adapters (controller.adapters).

The pod template depends only on whether any adapter is declared and on the PersistentVolumeClaims the
adapters are read from (a pod's volumes are fixed when it starts): one volume per claim, not per adapter,
so adding an adapter on a claim the workers already mount rolls nothing either. Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Set
from typing import Any

from splitserve.api.spec import AdapterSpec, InferenceDeploymentSpec, Mode, SecretKeyRef
from splitserve.api.topology import (
    ADAPTERS_FILE_KEY,
    ADAPTERS_MOUNT_PATH,
    adapters_config_map_name,
    decode_sidecar_account,
    serves_adapters,
    workers_account,
)
from splitserve.builders.target import Target, metadata
from splitserve.builders.vllm_args import MODEL_MOUNT_PATH

ADAPTERS_VOLUME = "adapters"
# Each adapter claim other than the model's is mounted read-only at ADAPTER_CLAIMS_ROOT/<claim>.
ADAPTER_CLAIMS_ROOT = "/adapters"
ADAPTER_CLAIM_VOLUME_PREFIX = "adapter-claim-"
COMPONENT = "workers"
# A volume name is a DNS label of at most 63 characters.
_VOLUME_NAME_MAX = 63


def _inside(path: str) -> str:
    """A path inside a volume, normalised as an absolute path first so that ".." cannot climb out of it."""
    return posixpath.normpath("/" + path).lstrip("/")


def _model_claim(spec: InferenceDeploymentSpec) -> str | None:
    pvc = spec.model.source.pvc
    return pvc.claim_name if pvc is not None else None


def adapter_claims(spec: InferenceDeploymentSpec, unavailable: Set[str] = frozenset()) -> list[str]:
    """The claims the workers mount for adapters, sorted: those of pvc sources, less the model's own (mounted
    already) and those `unavailable` (missing: a pod that mounts a missing claim never starts)."""
    claims = {a.source.pvc.claim_name for a in spec.adapters if a.source.pvc is not None}
    return sorted(claims - set(unavailable) - {_model_claim(spec)})


def claim_volume_name(claim: str) -> str:
    """The pod volume of an adapter claim: `adapter-claim-<claim>`, shortened with a hash past 63 characters."""
    name = ADAPTER_CLAIM_VOLUME_PREFIX + claim
    if len(name) <= _VOLUME_NAME_MAX:
        return name
    digest = hashlib.sha256(claim.encode()).hexdigest()[:10]
    return f"{name[: _VOLUME_NAME_MAX - len(digest) - 1]}-{digest}"


def adapter_path(spec: InferenceDeploymentSpec, adapter: AdapterSpec) -> str | None:
    """Where a worker finds the adapter's files (vLLM's lora_path): under its claim's mount for a pvc source,
    the uri as is; None for a huggingFace source (the worker downloads it)."""
    source = adapter.source
    if source.pvc is not None:
        claim = source.pvc.claim_name
        mount = MODEL_MOUNT_PATH if claim == _model_claim(spec) else posixpath.join(ADAPTER_CLAIMS_ROOT, claim)
        inside = _inside(source.pvc.path)
        return posixpath.join(mount, inside) if inside else mount
    return source.uri


def adapters_file(spec: InferenceDeploymentSpec, unavailable_claims: Set[str] = frozenset()) -> dict[str, Any]:
    """The adapters file: `{"adapters": [{"name", "path"} | {"name", "huggingFace": {"repo", "revision"}}]}` in
    the spec's order. Adapters on an `unavailable` claim are left out (status.adapters says why)."""
    entries: list[dict[str, Any]] = []
    for adapter in spec.adapters:
        source = adapter.source
        if source.pvc is not None and source.pvc.claim_name in unavailable_claims:
            continue
        if source.hugging_face is not None:
            hub = {"repo": source.hugging_face.repo, "revision": source.hugging_face.revision}
            entries.append({"name": adapter.name, "huggingFace": hub})
        else:
            entries.append({"name": adapter.name, "path": adapter_path(spec, adapter)})
    return {"adapters": entries}


def adapters_file_text(content: dict[str, Any]) -> str:
    """The adapters file as written: one adapter a line, so `kubectl get configmap -o yaml` reads well."""
    lines = [json.dumps(entry, separators=(", ", ": ")) for entry in content["adapters"]]
    return '{"adapters": [' + ",".join(f"\n  {line}" for line in lines) + ("\n" if lines else "") + "]}\n"


def adapters_token_ref(spec: InferenceDeploymentSpec) -> SecretKeyRef | None:
    """The Secret a worker's HF_TOKEN comes from: the model's, else the adapters' (a CEL rule makes them one)."""
    sources = [spec.model.source.hugging_face, *(a.source.hugging_face for a in spec.adapters)]
    return next((hub.token_secret_ref for hub in sources if hub is not None and hub.token_secret_ref), None)


def adapter_volumes(target: Target) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The worker pods' volumes and the engine's mounts for adapters: the adapters file's ConfigMap and each
    adapter claim, read-only; none without adapters."""
    spec = target.spec
    if not serves_adapters(spec):
        return [], []
    # Optional: a pod whose ConfigMap is missing (pruned while the template still named it) starts, with no
    # adapters file, rather than staying in ContainerCreating.
    config_map = {"name": adapters_config_map_name(target.owner.name), "optional": True}
    volumes: list[dict[str, Any]] = [{"name": ADAPTERS_VOLUME, "configMap": config_map}]
    mounts: list[dict[str, Any]] = [{"name": ADAPTERS_VOLUME, "mountPath": ADAPTERS_MOUNT_PATH, "readOnly": True}]
    for claim in adapter_claims(spec, target.unavailable_claims):
        name = claim_volume_name(claim)
        volumes.append({"name": name, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": name, "mountPath": posixpath.join(ADAPTER_CLAIMS_ROOT, claim), "readOnly": True})
    return volumes, mounts


def build_adapters_config_map(target: Target) -> list[dict[str, Any]]:
    """The ConfigMap `<name>-adapters` with the adapters file, when adapters are declared."""
    if not serves_adapters(target.spec):
        return []
    name = adapters_config_map_name(target.owner.name)
    text = adapters_file_text(adapters_file(target.spec, target.unavailable_claims))
    meta = metadata(target, name, COMPONENT)
    return [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {ADAPTERS_FILE_KEY: text}}]


def build_workers_rbac(target: Target) -> list[dict[str, Any]]:
    """With adapters: the worker pods' ServiceAccount, a Role that may patch the status of the namespace's
    pods (each worker sets its own splitserve.io/AdaptersReady condition) and its RoleBinding, which binds the
    decode pods' pd-sidecar account too when they carry one."""
    spec = target.spec
    if not serves_adapters(spec):
        return []
    name = workers_account(target.owner.name)
    namespace = target.owner.namespace
    subjects = [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]
    if spec.gateway is not None and spec.mode == Mode.DISAGGREGATED:
        sidecar = decode_sidecar_account(target.owner.name)
        subjects.append({"kind": "ServiceAccount", "name": sidecar, "namespace": namespace})
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": metadata(target, name, COMPONENT)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": metadata(target, name, COMPONENT),
            # A Role cannot narrow it to the pod's own name: every Pod's status in the namespace.
            "rules": [{"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": metadata(target, name, COMPONENT),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": subjects,
        },
    ]
