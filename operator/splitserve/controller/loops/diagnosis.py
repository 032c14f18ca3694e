"""The diagnosis loop: the six-question diagnosis of the served spec, written to status.diagnosis."""

from __future__ import annotations

from splitserve.api.status import InferenceDeploymentStatus
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

    def with_diagnosis(status: InferenceDeploymentStatus) -> InferenceDeploymentStatus:
        # Unchanged findings keep their time: status.diagnosis.time says since when this is the
        # diagnosis, and an idle deployment costs no status write every interval.
        previous = status.diagnosis
        if previous is not None and (previous.summary, previous.findings) == (diagnosis.summary, diagnosis.findings):
            return status
        return status.model_copy(update={"diagnosis": diagnosis})

    await reconciler.update_status(namespace, name, with_diagnosis)
