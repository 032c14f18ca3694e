"""Reading the InferenceDeployment file that `splitserve up` runs, validated like a cluster would."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitserve.api.base import KIND
from splitserve.api.spec import InferenceDeploymentSpec, Mode
from splitserve.engine.tiny_model import LORA_NAME
from splitserve.validation import load_documents, validate_text

# The model source `up` replaces by the tiny model it builds (see deploy/local/*.yaml).
TINY_MODEL_URI = "splitserve://tiny-model"
# An adapter source `up` replaces by a tiny LoRA adapter of the tiny model: TINY_LORA_URI + NAME.
TINY_LORA_URI = "splitserve://tiny-lora/"


def tiny_lora_name(uri: str | None) -> str | None:
    """NAME of an adapter source `splitserve://tiny-lora/NAME`; None for any other source."""
    if uri is None or not uri.startswith(TINY_LORA_URI):
        return None
    return uri.removeprefix(TINY_LORA_URI)


class DeploymentFileError(Exception):
    """The file cannot run; `messages` are the lines to show, one problem each."""

    def __init__(self, messages: list[str]) -> None:
        super().__init__("\n".join(messages))
        self.messages = messages


@dataclass(frozen=True)
class LocalDeployment:
    name: str
    spec: InferenceDeploymentSpec
    # The whole object as given (defaults written out), kept to write the spec workers read.
    document: dict[str, Any]

    @property
    def disaggregated(self) -> bool:
        return self.spec.mode is Mode.DISAGGREGATED

    @property
    def prefill_replicas(self) -> int:
        return self.spec.prefill.replicas if self.disaggregated else 0

    @property
    def decode_replicas(self) -> int:
        return self.spec.decode.replicas


def parse_deployment(text: str) -> LocalDeployment:
    """The one InferenceDeployment in text, or DeploymentFileError with every validation problem."""
    problems = validate_text(text)
    if problems:
        raise DeploymentFileError([str(problem) for problem in problems])
    documents = [doc for doc in load_documents(text) if doc.get("kind") == KIND]
    if len(documents) != 1:
        raise DeploymentFileError(
            [f"the file holds {len(documents)} InferenceDeployments; `splitserve up` runs exactly one"]
        )
    document = documents[0]
    spec = InferenceDeploymentSpec.model_validate(document["spec"])
    deployment = LocalDeployment(name=str(document["metadata"]["name"]), spec=spec, document=document)
    local_problems = local_run_problems(deployment)
    if local_problems:
        raise DeploymentFileError(local_problems)
    return deployment


def local_run_problems(deployment: LocalDeployment) -> list[str]:
    """Valid for a cluster but impossible to run as local processes."""
    problems = []
    if deployment.decode_replicas < 1:
        pool = "decode" if deployment.disaggregated else "decode (the aggregated pool)"
        problems.append(f"spec.decode.replicas is 0: no {pool} worker would serve requests; set it to 1 or more")
    if deployment.spec.model.source.pvc is not None:
        problems.append(
            "spec.model.source.pvc needs a cluster; locally use source.uri (a path, or "
            f"{TINY_MODEL_URI} for the tiny test model)"
        )
    for index, adapter in enumerate(deployment.spec.adapters):
        where = f"spec.adapters[{index}] ({adapter.name})"
        if adapter.source.pvc is not None:
            problems.append(
                f"{where}: source.pvc needs a cluster; locally use source.uri (a folder, or "
                f"{TINY_LORA_URI}NAME for a tiny adapter of the tiny model)"
            )
        name = tiny_lora_name(adapter.source.uri)
        if name is None:
            continue
        if not LORA_NAME.match(name):
            problems.append(f"{where}: {adapter.source.uri}: NAME must match {LORA_NAME.pattern}")
        if deployment.spec.model.source.uri != TINY_MODEL_URI:
            problems.append(
                f"{where}: {TINY_LORA_URI}NAME is an adapter of the tiny model: model.source.uri must "
                f"be {TINY_MODEL_URI}"
            )
    return problems


def load_deployment(path: Path) -> LocalDeployment:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise DeploymentFileError([f"cannot read {path}: {error.strerror or error}"]) from error
    return parse_deployment(text)
