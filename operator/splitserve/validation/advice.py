"""Warnings for InferenceDeployments a cluster would accept but that will not behave as meant.

Unlike `checker.py` (what the API server rejects), these never fail validation: `splitserve
validate` prints them as WARNING lines and still exits 0.
"""

from __future__ import annotations

from typing import Any

import yaml

from splitserve.api.spec import InferenceDeploymentSpec, Mode
from splitserve.validation.checker import Problem, label_for, load_documents, validate_object

# A vLLM worker's cold start (scheduling, image pull aside: engine start and model load) takes
# tens of seconds on an idle node and was measured up to ~200 s on a loaded CPU box
# (docs/scale-to-zero.md); below this a request held at zero replicas is likely to time out.
COLD_START_QUEUE_SECONDS = 120.0
QUEUE_FIELD = "spec.router.timeouts.queueSeconds"


def spec_advice(spec: InferenceDeploymentSpec, label: str) -> list[Problem]:
    """What to change in one (valid) spec, one Problem per warning."""
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
