"""InferenceDeployment files as the offline commands read them: validated first, as `splitserve
validate` does, so render and diff never build objects from a spec a cluster would reject."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.api.spec import InferenceDeploymentSpec
from splitserve.api.topology import Owner
from splitserve.commands.common import UserError, read_input
from splitserve.validation import load_documents, validate_text


class InvalidInput(UserError):
    """A file a cluster would reject: one `FILE: problem` line per problem."""


@dataclass(frozen=True)
class LoadedDeployment:
    """One InferenceDeployment of a file."""

    owner: Owner
    spec: InferenceDeploymentSpec


def load_deployments(filename: str, namespace: str | None = None) -> list[LoadedDeployment]:
    """Every InferenceDeployment of FILE ('-': stdin), `namespace` where a document sets none.

    UserError when the file cannot be read; InvalidInput listing every problem when it is invalid."""
    text = read_input(filename)
    problems = validate_text(text)
    if problems:
        raise InvalidInput("\n".join(f"{filename}: {problem}" for problem in problems))
    loaded = []
    for doc in load_documents(text):
        owner = Owner(doc["metadata"]["name"], doc["metadata"].get("namespace") or namespace or "default")
        loaded.append(LoadedDeployment(owner, InferenceDeploymentSpec.model_validate(doc["spec"])))
    return loaded


def load_one_deployment(filename: str, namespace: str | None = None) -> LoadedDeployment:
    """The one InferenceDeployment of FILE (InvalidInput when it holds several)."""
    loaded = load_deployments(filename, namespace)
    if len(loaded) != 1:
        names = ", ".join(deployment.owner.name for deployment in loaded)
        raise InvalidInput(f"{filename}: holds {len(loaded)} InferenceDeployments ({names}); give a file with one")
    return loaded[0]
