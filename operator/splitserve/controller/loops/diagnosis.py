"""The diagnosis loop: the six-question diagnosis of the served spec, written to status.diagnosis."""

from __future__ import annotations

from splitserve.controller.loops.autoscaler import spec_of
from splitserve.controller.reconcile import Reconciler
from splitserve.io.prometheus import PrometheusClient
from splitserve.io.telemetry import run_diagnosis


async def diagnose_once(reconciler: Reconciler, namespace: str, name: str, prometheus: PrometheusClient | None) -> None:
    """Write the six-question diagnosis to status.diagnosis (telemetry when Prometheus answers)."""
    found = spec_of(reconciler, namespace, name)
    if found is None:
        return
    _, spec = found
    url = spec.autoscaling.prometheus_url if prometheus is not None else None
    report = await run_diagnosis(spec, name=name, namespace=namespace, prometheus_url=url, source=prometheus)
    diagnosis = report.status()
    await reconciler.update_status(namespace, name, lambda status: status.model_copy(update={"diagnosis": diagnosis}))
