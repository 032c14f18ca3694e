"""The diagnosis' telemetry reader: gather a spec's inputs (model files, Prometheus) and run the
six questions. Shared by `splitserve diagnose` and the operator's diagnosis and autopilot loops."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from splitserve.api.spec import InferenceDeploymentSpec
from splitserve.diagnosis.findings import DiagnosisInput
from splitserve.diagnosis.model_facts import model_facts
from splitserve.diagnosis.questions import diagnose
from splitserve.diagnosis.report import Report, gpu_choices
from splitserve.diagnosis.telemetry import (
    QuerySource,
    Telemetry,
    TelemetryScope,
    collect,
    coverage_note,
    default_scope,
)
from splitserve.io.prometheus import PrometheusClient, PrometheusUnavailable


async def gather_telemetry(
    source: QuerySource, scope: TelemetryScope, where: str, at: float | None = None
) -> tuple[Telemetry | None, str]:
    """Telemetry, or None with the reason (Prometheus unreachable or failing). `at`: when the window ended,
    for the note (the source evaluates its queries then)."""
    try:
        if await source.query_scalar("vector(1)") is None:
            return None, f"Prometheus at {where} answered an empty result to vector(1)"
        telemetry = await collect(source, scope)
    except PrometheusUnavailable as exc:
        return None, f"Prometheus not reachable: {exc}"
    note = f"Prometheus at {where}, window {scope.window}"
    if at is not None:
        note += f" ending {datetime.fromtimestamp(at, UTC).isoformat(timespec='seconds')}"
    gaps = coverage_note(telemetry)
    return telemetry, note + (f"; {gaps}" if gaps else "")


async def run_diagnosis(
    spec: InferenceDeploymentSpec,
    *,
    name: str,
    namespace: str | None = None,
    prometheus_url: str | None = None,
    source: QuerySource | None = None,
    gpu: str | None = None,
    model_dir: str | None = None,
    window: str = "5m",
    engine_selector: str | None = None,
    router_selector: str | None = None,
    cache_dirs: list[Path] | None = None,
    at: float | None = None,
) -> Report:
    """Diagnose one spec. Pass `source` (a Prometheus client) or `prometheus_url`; neither means no telemetry.
    `at` (Unix time, with `prometheus_url`) reads the window that ended then instead of the one ending now."""
    gpus = gpu_choices(spec, gpu)
    facts = model_facts(spec, model_dir, cache_dirs)
    scope = default_scope(name, namespace, window)
    if engine_selector is not None or router_selector is not None:
        scope = TelemetryScope(
            engine_selector if engine_selector is not None else scope.engine_selector,
            router_selector if router_selector is not None else scope.router_selector,
            window,
        )
    telemetry: Telemetry | None = None
    note = "no --prometheus given"
    if source is not None:
        telemetry, note = await gather_telemetry(source, scope, prometheus_url or "the given client")
    elif prometheus_url:
        async with PrometheusClient(prometheus_url, at=at) as client:
            telemetry, note = await gather_telemetry(client, scope, prometheus_url, at)
    inp = DiagnosisInput(spec=spec, facts=facts, gpus=gpus, telemetry=telemetry, telemetry_note=note)
    return Report(name, namespace, inp, diagnose(inp), prometheus_url)
