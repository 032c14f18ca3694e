"""The operator's own Prometheus metrics (served by `splitserve operator --metrics-port`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge


@dataclass
class OperatorMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        self.reconciles = Counter(
            "splitserve_operator_reconciles_total",
            "Reconciles of InferenceDeployments by result (ok, degraded, invalid)",
            ["result"],
            registry=self.registry,
        )
        self.desired_replicas = Gauge(
            "splitserve_autoscaler_desired_replicas",
            "Replicas the built-in autoscaler wants per pool",
            ["namespace", "deployment", "pool"],
            registry=self.registry,
        )
        self.prometheus_up = Gauge(
            "splitserve_autoscaler_prometheus_up",
            "1 when the autoscaler could read its signals from Prometheus at the last evaluation",
            ["namespace", "deployment"],
            registry=self.registry,
        )
        self.optimizations = Counter(
            "splitserve_operator_optimizations_total",
            "Changes dynamic optimization applied or undid, by kind (mode, speculativeDecoding, ratio)",
            ["kind", "outcome"],
            registry=self.registry,
        )
