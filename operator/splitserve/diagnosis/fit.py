"""The one diagnosis verdict that blocks a reconcile: weights that certainly do not fit the GPUs."""

from __future__ import annotations

from splitserve.api.spec import InferenceDeploymentSpec
from splitserve.api.status import Problem
from splitserve.diagnosis.findings import DiagnosisInput
from splitserve.diagnosis.model_facts import model_facts
from splitserve.diagnosis.questions import hardware_fit
from splitserve.diagnosis.report import gpu_choices


def model_fit_problem(spec: InferenceDeploymentSpec) -> Problem | None:
    """ModelDoesNotFit when the weights certainly exceed the pools' GPUs (diagnosis question 1).

    Only certain verdicts block: the GPU type must be known from a node selector (not assumed)
    and the parameter count declared or read from the model's config (not guessed from a name).
    """
    facts = model_facts(spec)
    gpus = gpu_choices(spec, None)
    if any(choice.assumed for choice in gpus.values()) or facts.parameter_count is None:
        return None
    if spec.model.parameter_count is None and "config" not in facts.parameter_source:
        return None
    result = hardware_fit(DiagnosisInput(spec, facts, gpus))
    if not result.verdict.startswith("does not fit"):
        return None
    return Problem("ModelDoesNotFit", f"{result.verdict}. Options: {result.recommendation}"[:2000])
