"""Validation of rendered Kubernetes manifests against the upstream schemas, without a cluster.

Built-in kinds (and CustomResourceDefinition objects themselves) are checked by kubernetes-validate in
strict mode, so unknown fields fail. Custom resources whose CRD we ship are checked against that CRD's
openAPIV3Schema. Third-party kinds whose schemas we do not have are reported as skipped, never passed
silently.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import kubernetes_validate.utils
import yaml
from referencing import Registry, Resource

# Kubernetes versions the manifests must be valid for: the oldest we support and the newest schemas known.
KUBERNETES_VERSIONS = ("1.35.0", kubernetes_validate.latest_version())

# Kinds owned by other projects (Prometheus Operator, KEDA) whose CRDs we do not ship.
THIRD_PARTY_KINDS = {
    ("monitoring.coreos.com", "ServiceMonitor"),
    ("monitoring.coreos.com", "PodMonitor"),
    ("monitoring.coreos.com", "PrometheusRule"),
    ("keda.sh", "ScaledObject"),
}


# render(values=None, name=..., namespace=...) -> {template path: rendered text}
RenderChart = Callable[..., dict[str, str]]


@functools.cache
def strict_validator(kube_version: str, api_version: str, kind: str) -> jsonschema.protocols.Validator:
    """kubernetes-validate's strict schema for one kind, compiled once (its own `validate` re-reads the
    multi-megabyte definitions file on every call, which made these tests slow)."""
    utils = kubernetes_validate.utils
    version = [v for v in utils.all_versions() if utils.major_minor(v) <= utils.major_minor(kube_version)][-1]
    schema_dir = f"kubernetes-json-schema/v{version}-local-strict"
    file_api_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    try:
        schema = utils.schema_contents(f"{schema_dir}/{kind.lower()}-{file_api_version}.json", kube_version)
    except FileNotFoundError as missing:
        raise kubernetes_validate.SchemaNotFoundError(
            version=utils.major_minor(kube_version), kind=kind, api_version=api_version
        ) from missing
    definitions = utils.schema_contents(f"{schema_dir}/_definitions.json", kube_version)
    registry: Registry = Resource.from_contents(definitions) @ (Resource.from_contents(schema) @ Registry())
    validator: jsonschema.protocols.Validator = jsonschema.Draft202012Validator(schema, registry=registry)
    return validator


def validate_strict(obj: dict[str, Any], kube_version: str) -> None:
    """Same result as kubernetes_validate.validate(obj, kube_version, strict=True), cached per kind."""
    try:
        validator = strict_validator(kube_version, obj["apiVersion"], obj["kind"])
    except AttributeError:  # kubernetes-validate changed its internals: use its public (slower) API
        kubernetes_validate.validate(obj, kube_version, strict=True)
        return
    validator.validate(obj)


@dataclass
class ValidationReport:
    errors: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    checked: int = 0


def parse_manifests(text: str) -> list[dict[str, Any]]:
    """All non-empty YAML documents of a multi-document manifest."""
    return [doc for doc in yaml.safe_load_all(text) if doc]


def api_group(obj: dict[str, Any]) -> str:
    api_version: str = obj["apiVersion"]
    return api_version.split("/")[0] if "/" in api_version else ""


def describe(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata", {})
    namespace = f"{meta['namespace']}/" if meta.get("namespace") else ""
    return f"{obj.get('kind')} {namespace}{meta.get('name')}"


def crd_schemas(crd_files: Iterable[Path]) -> dict[tuple[str, str, str], dict[str, Any]]:
    """(group, version, kind) -> openAPIV3Schema for every CRD in the given files."""
    schemas: dict[tuple[str, str, str], dict[str, Any]] = {}
    for path in crd_files:
        for crd in parse_manifests(path.read_text()):
            spec = crd["spec"]
            for version in spec["versions"]:
                key = (spec["group"], version["name"], spec["names"]["kind"])
                schemas[key] = version["schema"]["openAPIV3Schema"]
    return schemas


def validate_objects(
    objects: Iterable[dict[str, Any]],
    custom_schemas: dict[tuple[str, str, str], dict[str, Any]],
    versions: Iterable[str] = KUBERNETES_VERSIONS,
) -> ValidationReport:
    report = ValidationReport()
    version_list = list(versions)
    for obj in objects:
        group = api_group(obj)
        version = obj["apiVersion"].split("/")[-1]
        custom_key = (group, version, obj["kind"])
        if custom_key in custom_schemas:
            for error in jsonschema.Draft7Validator(custom_schemas[custom_key]).iter_errors(obj):
                report.errors.append(f"{describe(obj)}: {error.message} at {list(error.absolute_path)}")
            report.checked += 1
            continue
        if (group, obj["kind"]) in THIRD_PARTY_KINDS:
            report.skipped.append(f"{describe(obj)} ({obj['apiVersion']}: third-party schema not bundled)")
            continue
        for kube_version in version_list:
            try:
                validate_strict(obj, kube_version)
            except jsonschema.ValidationError as error:
                where = list(error.absolute_path)
                report.errors.append(f"{describe(obj)} @ {kube_version}: {error.message} at {where}")
            except kubernetes_validate.SchemaNotFoundError:
                report.errors.append(f"{describe(obj)} @ {kube_version}: no schema for {obj['apiVersion']}")
        report.checked += 1
    return report


def manifest_objects(rendered: dict[str, str]) -> list[dict[str, Any]]:
    """The Kubernetes objects of a rendered chart (NOTES.txt left out)."""
    objects: list[dict[str, Any]] = []
    for template, text in sorted(rendered.items()):
        if template.endswith(".yaml"):
            objects.extend(parse_manifests(text))
    return objects
