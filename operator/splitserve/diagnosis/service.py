"""Run a whole diagnosis for one spec: gather inputs (files, Prometheus), ask the questions, report.

Shared by `splitserve diagnose` and the operator's slow diagnosis timer, which passes its own
Prometheus client and writes `Report.status()` to status.diagnosis.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from splitserve.api.spec import InferenceDeploymentSpec
from splitserve.api.status import DiagnosisStatus
from splitserve.autoscaling.prometheus import PrometheusClient, PrometheusUnavailable
from splitserve.diagnosis.findings import DiagnosisInput, QuestionResult
from splitserve.diagnosis.gpus import GpuChoice, choose_gpu
from splitserve.diagnosis.model_facts import model_facts
from splitserve.diagnosis.questions import diagnose
from splitserve.diagnosis.render import render_json, render_text, summarise, to_json_document
from splitserve.diagnosis.telemetry import QuerySource, Telemetry, TelemetryScope, collect, default_scope


@dataclass(frozen=True)
class Report:
    name: str
    namespace: str | None
    inp: DiagnosisInput
    results: list[QuestionResult]
    prometheus: str | None

    def summary(self) -> str:
        return summarise(self.results)

    def status(self, now: datetime | None = None) -> DiagnosisStatus:
        time = (now or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")
        return DiagnosisStatus(
            time=time, summary=self.summary(), findings=[result.to_finding() for result in self.results]
        )

    def document(self) -> dict[str, Any]:
        return to_json_document(self.name, self.namespace, self.inp, self.results, self.prometheus)

    def json(self) -> str:
        return render_json(self.document())

    def text(self, width: int | None = None) -> str:
        return render_text(self.name, self.namespace, self.inp, self.results, width)


def gpu_choices(spec: InferenceDeploymentSpec, override: str | None) -> dict[str, GpuChoice]:
    """GPU per pool (both pools, so the questions can always look either up). ValueError on a bad --gpu."""
    return {
        "prefill": choose_gpu(override, spec.prefill.node_selector),
        "decode": choose_gpu(override, spec.decode.node_selector),
    }


async def gather_telemetry(source: QuerySource, scope: TelemetryScope, where: str) -> tuple[Telemetry | None, str]:
    """Telemetry, or None with the reason (Prometheus unreachable or failing)."""
    try:
        if await source.query_scalar("vector(1)") is None:
            return None, f"Prometheus at {where} answered an empty result to vector(1)"
        telemetry = await collect(source, scope)
    except PrometheusUnavailable as exc:
        return None, f"Prometheus not reachable: {exc}"
    return telemetry, f"Prometheus at {where}, window {scope.window}"


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
) -> Report:
    """Diagnose one spec. Pass `source` (a Prometheus client) or `prometheus_url`; neither means no telemetry."""
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
        async with PrometheusClient(prometheus_url) as client:
            telemetry, note = await gather_telemetry(client, scope, prometheus_url)
    inp = DiagnosisInput(spec=spec, facts=facts, gpus=gpus, telemetry=telemetry, telemetry_note=note)
    return Report(name, namespace, inp, diagnose(inp), prometheus_url)
