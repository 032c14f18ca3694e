"""What the emulator serves: resource descriptions, the built-in seed list and CRD registration."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class ScaleSpec:
    """Where a resource keeps the numbers the /scale subresource exposes (JSON paths like `.spec.replicas`)."""

    spec_replicas_path: str = ".spec.replicas"
    status_replicas_path: str = ".status.replicas"
    label_selector_path: str | None = None
    # Built-in workloads keep a structured selector in spec.selector; CRDs point at a string.
    selector_is_structured: bool = False


@dataclasses.dataclass(frozen=True)
class PrinterColumn:
    name: str
    type: str
    json_path: str
    description: str = ""
    priority: int = 0
    format: str = ""


@dataclasses.dataclass(frozen=True)
class ResourceInfo:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    singular: str = ""
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    has_status: bool = False
    scale: ScaleSpec | None = None
    printer_columns: tuple[PrinterColumn, ...] = ()
    # CRD-backed resources disappear when their CRD is deleted; built-ins never do.
    from_crd: bool = False

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def key(self) -> str:
        """Identity of the stored collection; versions of one group/plural share objects like in etcd."""
        return f"{self.group}/{self.plural}"

    @property
    def verbs(self) -> list[str]:
        return ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]

    def discovery_entries(self) -> list[dict[str, Any]]:
        main: dict[str, Any] = {
            "name": self.plural,
            "singularName": self.singular or self.kind.lower(),
            "namespaced": self.namespaced,
            "kind": self.kind,
            "verbs": self.verbs,
        }
        if self.short_names:
            main["shortNames"] = list(self.short_names)
        if self.categories:
            main["categories"] = list(self.categories)
        entries = [main]
        if self.has_status:
            entries.append(
                {
                    "name": f"{self.plural}/status",
                    "singularName": "",
                    "namespaced": self.namespaced,
                    "kind": self.kind,
                    "verbs": ["get", "patch", "update"],
                }
            )
        if self.scale is not None:
            entries.append(
                {
                    "name": f"{self.plural}/scale",
                    "singularName": "",
                    "namespaced": self.namespaced,
                    "group": "autoscaling",
                    "version": "v1",
                    "kind": "Scale",
                    "verbs": ["get", "patch", "update"],
                }
            )
        return entries


def _builtin(
    api_version: str,
    plural: str,
    kind: str,
    *,
    namespaced: bool = True,
    short_names: Iterable[str] = (),
    status: bool = False,
    scale: ScaleSpec | None = None,
    categories: Iterable[str] = (),
) -> ResourceInfo:
    group, _, version = api_version.rpartition("/")
    return ResourceInfo(
        group=group,
        version=version,
        plural=plural,
        kind=kind,
        namespaced=namespaced,
        short_names=tuple(short_names),
        has_status=status,
        scale=scale,
        categories=tuple(categories),
    )


_WORKLOAD_SCALE = ScaleSpec(label_selector_path=".spec.selector", selector_is_structured=True)

BUILTIN_RESOURCES: tuple[ResourceInfo, ...] = (
    _builtin("v1", "pods", "Pod", short_names=["po"], status=True, categories=["all"]),
    _builtin("v1", "services", "Service", short_names=["svc"], status=True, categories=["all"]),
    _builtin("v1", "endpoints", "Endpoints", short_names=["ep"]),
    _builtin("v1", "serviceaccounts", "ServiceAccount", short_names=["sa"]),
    _builtin("v1", "secrets", "Secret"),
    _builtin("v1", "configmaps", "ConfigMap", short_names=["cm"]),
    _builtin("v1", "persistentvolumeclaims", "PersistentVolumeClaim", short_names=["pvc"], status=True),
    _builtin("v1", "events", "Event", short_names=["ev"]),
    _builtin("v1", "namespaces", "Namespace", namespaced=False, short_names=["ns"], status=True),
    _builtin(
        "apps/v1",
        "deployments",
        "Deployment",
        short_names=["deploy"],
        status=True,
        scale=_WORKLOAD_SCALE,
        categories=["all"],
    ),
    _builtin(
        "apps/v1",
        "statefulsets",
        "StatefulSet",
        short_names=["sts"],
        status=True,
        scale=_WORKLOAD_SCALE,
        categories=["all"],
    ),
    _builtin("policy/v1", "poddisruptionbudgets", "PodDisruptionBudget", short_names=["pdb"], status=True),
    _builtin("networking.k8s.io/v1", "networkpolicies", "NetworkPolicy", short_names=["netpol"]),
    _builtin("rbac.authorization.k8s.io/v1", "roles", "Role"),
    _builtin("rbac.authorization.k8s.io/v1", "rolebindings", "RoleBinding"),
    _builtin("discovery.k8s.io/v1", "endpointslices", "EndpointSlice"),
    _builtin(
        "autoscaling/v2",
        "horizontalpodautoscalers",
        "HorizontalPodAutoscaler",
        short_names=["hpa"],
        status=True,
        categories=["all"],
    ),
    _builtin("coordination.k8s.io/v1", "leases", "Lease"),
    _builtin("events.k8s.io/v1", "events", "Event", short_names=["ev"]),
    _builtin(
        "apiextensions.k8s.io/v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        namespaced=False,
        short_names=["crd", "crds"],
        status=True,
    ),
    _builtin("monitoring.coreos.com/v1", "servicemonitors", "ServiceMonitor", short_names=["smon"]),
    _builtin("monitoring.coreos.com/v1", "podmonitors", "PodMonitor", short_names=["pmon"]),
    _builtin("keda.sh/v1alpha1", "scaledobjects", "ScaledObject", short_names=["so"], status=True),
    # Gateway API and its Inference Extension (spec.gateway's InferencePool and HTTPRoute).
    _builtin("inference.networking.k8s.io/v1", "inferencepools", "InferencePool", short_names=["infpool"], status=True),
    _builtin("gateway.networking.k8s.io/v1", "httproutes", "HTTPRoute", status=True, categories=["gateway-api"]),
    _builtin("kopf.dev/v1", "kopfpeerings", "KopfPeering"),
    _builtin("kopf.dev/v1", "clusterkopfpeerings", "ClusterKopfPeering", namespaced=False),
)


def resources_from_crd(crd: Mapping[str, Any]) -> list[ResourceInfo]:
    """One ResourceInfo per served version of an apiextensions.k8s.io/v1 CustomResourceDefinition."""
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    infos: list[ResourceInfo] = []
    for version in spec.get("versions") or []:
        if not version.get("served", True):
            continue
        subresources = version.get("subresources") or {}
        scale_spec = subresources.get("scale")
        scale = None
        if scale_spec is not None:
            scale = ScaleSpec(
                spec_replicas_path=scale_spec.get("specReplicasPath", ".spec.replicas"),
                status_replicas_path=scale_spec.get("statusReplicasPath", ".status.replicas"),
                label_selector_path=scale_spec.get("labelSelectorPath"),
            )
        columns = tuple(
            PrinterColumn(
                name=column["name"],
                type=column.get("type", "string"),
                json_path=column["jsonPath"],
                description=column.get("description", ""),
                priority=int(column.get("priority", 0)),
                format=column.get("format", ""),
            )
            for column in version.get("additionalPrinterColumns") or []
        )
        infos.append(
            ResourceInfo(
                group=spec.get("group", ""),
                version=version["name"],
                plural=names["plural"],
                kind=names["kind"],
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                singular=names.get("singular", ""),
                short_names=tuple(names.get("shortNames") or ()),
                categories=tuple(names.get("categories") or ()),
                has_status="status" in subresources,
                scale=scale,
                printer_columns=columns,
                from_crd=True,
            )
        )
    return infos


def omit_resources(infos: Iterable[ResourceInfo], omitted: Iterable[str]) -> list[ResourceInfo]:
    """Drop built-ins named as "group" (a whole API group) or "group/plural" ("" or "core" is the core group).

    Lets a test run against a cluster without e.g. prometheus-operator (monitoring.coreos.com) or KEDA.
    """
    rules = [rule.split("/", 1) for rule in omitted]
    normalized = [("" if parts[0] == "core" else parts[0], parts[1] if len(parts) > 1 else None) for parts in rules]
    return [
        info
        for info in infos
        if not any(info.group == group and plural in (None, info.plural) for group, plural in normalized)
    ]


class ResourceRegistry:
    """The served resources, indexed for URL routing and discovery."""

    def __init__(self, builtins: Iterable[ResourceInfo] = BUILTIN_RESOURCES) -> None:
        self._builtins: list[ResourceInfo] = list(builtins)
        self._by_crd: dict[str, list[ResourceInfo]] = {}

    def all(self) -> list[ResourceInfo]:
        return self._builtins + [info for infos in self._by_crd.values() for info in infos]

    def find(self, group: str, version: str, plural: str) -> ResourceInfo | None:
        for info in self.all():
            if (info.group, info.version, info.plural) == (group, version, plural):
                return info
        return None

    def find_kind(self, api_version: str, kind: str) -> ResourceInfo | None:
        for info in self.all():
            if info.api_version == api_version and info.kind == kind:
                return info
        return None

    def register_crd(self, crd: Mapping[str, Any]) -> None:
        self._by_crd[crd["metadata"]["name"]] = resources_from_crd(crd)

    def unregister_crd(self, crd_name: str) -> list[ResourceInfo]:
        return self._by_crd.pop(crd_name, [])

    def groups(self) -> dict[str, list[str]]:
        """Group name -> served versions in registration order (the first one is preferred)."""
        result: dict[str, list[str]] = {}
        for info in self.all():
            versions = result.setdefault(info.group, [])
            if info.version not in versions:
                versions.append(info.version)
        return result

    def in_group_version(self, group: str, version: str) -> list[ResourceInfo]:
        return [info for info in self.all() if info.group == group and info.version == version]
