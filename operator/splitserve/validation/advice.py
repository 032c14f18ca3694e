"""Warnings for InferenceDeployments a cluster would accept but that will not behave as meant.

Unlike `checker.py` (what the API server rejects), these never fail validation: `splitserve
validate` prints them as WARNING lines and still exits 0.
"""

from __future__ import annotations

from typing import Any

import yaml

from splitserve.api.spec import InferenceDeploymentSpec, Mode, Role, RoutingPolicy
from splitserve.api.topology import kv_event_roles
from splitserve.validation.checker import Problem, label_for, load_documents, validate_object

# A vLLM worker's cold start (scheduling, image pull aside: engine start and model load) takes
# tens of seconds on an idle node and was measured up to ~200 s on a loaded CPU box
# (docs/scale-to-zero.md); below this a request held at zero replicas is likely to time out.
COLD_START_QUEUE_SECONDS = 120.0
QUEUE_FIELD = "spec.router.timeouts.queueSeconds"


def spec_advice(spec: InferenceDeploymentSpec, label: str) -> list[Problem]:
    """What to change in one (valid) spec, one Problem per warning."""
    return [
        *_cold_start_advice(spec, label),
        *_precise_prefix_advice(spec, label),
        *_gateway_advice(spec, label),
        *_lora_advice(spec, label),
    ]


def _lora_advice(spec: InferenceDeploymentSpec, label: str) -> list[Problem]:
    """More adapters than the engines' CPU cache holds: they all serve, but some are read again from disk."""
    lora = spec.engine.lora
    if len(spec.adapters) <= lora.max_cpu_loras:
        return []
    return [
        Problem(
            label,
            "spec.engine.lora.maxCpuLoras",
            f"{lora.max_cpu_loras} is fewer than the {len(spec.adapters)} adapters declared: every adapter is "
            "served, but an engine keeps only the most recently used maxCpuLoras in CPU memory and reads the "
            "others from their path again when a request needs them (a pause of that request). Raise it to "
            f"{len(spec.adapters)} if the workers' memory allows.",
        )
    ]


def _gateway_advice(spec: InferenceDeploymentSpec, label: str) -> list[Problem]:
    """Only the router holds a request while the decode pool is at zero; a Gateway has nowhere to send it."""
    if spec.gateway is None or not spec.autoscaling.enabled or spec.decode.min_replicas != 0:
        return []
    return [
        Problem(
            label,
            "spec.decode.minReplicas",
            "0 with spec.gateway and autoscaling on: while the decode pool is at zero, requests through the "
            "Gateway fail at once (the endpoint picker has no pod to name; only the router holds requests "
            "while a worker starts, and only its queue scales the pool back up). Set spec.decode.minReplicas "
            "to 1, or send the clients that can wait to the router.",
        )
    ]


def _cold_start_advice(spec: InferenceDeploymentSpec, label: str) -> list[Problem]:
    if not spec.autoscaling.enabled:
        return []
    queue = spec.router.timeouts.queue_seconds
    if queue >= COLD_START_QUEUE_SECONDS:
        return []
    # Only the pool the router holds requests for: decode (aggregated mode runs on decode's spec).
    # A prefill pool at zero holds nobody: the router serves those prompts aggregated on decode at
    # once, and the autoscaler brings prefill back on those fallbacks.
    pool = "decode"
    if spec.decode.min_replicas != 0:
        return []
    role = "the aggregated pool (spec.decode)" if spec.mode == Mode.AGGREGATED else "decode"
    return [
        Problem(
            label,
            QUEUE_FIELD,
            f"{queue:g}s is shorter than a worker's cold start while spec.{pool}.minReplicas is 0 with "
            f"autoscaling on: a request that arrives with {role} at zero waits in the router's queue "
            f"while a worker starts (tens of seconds idle, up to ~200 s for vLLM on a loaded CPU node) "
            f"and gets 503 after {queue:g}s. Set {QUEUE_FIELD} to {COLD_START_QUEUE_SECONDS:g} or more "
            f"(above your measured cold start), or spec.{pool}.minReplicas to 1.",
        )
    ]


def _precise_prefix_asked(spec: InferenceDeploymentSpec) -> str:
    """Which routingPolicy fields ask for precise-prefix on a pool in use, as the start of a sentence."""
    fields = ["prefill" if role == Role.PREFILL else "decode" for role in kv_event_roles(spec)]
    policy = RoutingPolicy.PRECISE_PREFIX.value
    if len(fields) == 1:
        return f"spec.router.routingPolicy.{fields[0]} is {policy}"
    return f"spec.router.routingPolicy.prefill and .decode are {policy}"


def _precise_prefix_advice(spec: InferenceDeploymentSpec, label: str) -> list[Problem]:
    """precise-prefix routes on what the engines report: without events it finds no cached prefix and
    routes by load alone; without a local tokenizer it pays a /tokenize round trip per request."""
    if not kv_event_roles(spec):
        return []  # not asked for, or only for the prefill pool of an aggregated deployment (unused)
    asked = _precise_prefix_asked(spec)
    warnings = []
    if not spec.engine.prefix_caching:
        warnings.append(
            Problem(
                label,
                "spec.engine.prefixCaching",
                f"prefix caching is off but {asked}: vLLM publishes KV-cache events only for the blocks its "
                "prefix cache keeps, so the router would see no events and route every prompt by load alone. "
                "Set spec.engine.prefixCaching to true, or choose another routing policy.",
            )
        )
    if spec.model.source.pvc is None:
        source = "huggingFace" if spec.model.source.hugging_face is not None else "uri"
        warnings.append(
            Problem(
                label,
                f"spec.model.source.{source}",
                f"{asked}, which matches prompts to cached blocks by the model's own token ids. The router reads "
                "the tokenizer only from a model.source.pvc (it mounts the workers' claim read-only); with a "
                f"{source} source it asks a worker's POST /tokenize for every prompt before routing it, one "
                "extra round trip per request. Put the model on a PersistentVolumeClaim (ReadOnlyMany, or "
                "reachable from the router's node) to tokenize in the router instead.",
            )
        )
    return warnings


def object_advice(obj: Any, *, index: int = 0) -> list[Problem]:
    """Warnings for one document; none for a document that fails validation (its errors come first)."""
    if validate_object(obj, index=index):
        return []
    spec = InferenceDeploymentSpec.model_validate(obj["spec"])
    return spec_advice(spec, label_for(index, obj))


def text_advice(text: str) -> list[Problem]:
    """Warnings for every valid InferenceDeployment in a (multi-document) YAML text."""
    try:
        documents = load_documents(text)
    except yaml.YAMLError:  # unreadable YAML is validate_text's error to report, not a warning
        return []
    return [warning for index, doc in enumerate(documents) for warning in object_advice(doc, index=index)]
