"""A whole diagnosis of one spec as a report: text, JSON, or status.diagnosis (pure; the inputs are
gathered by splitserve.io.telemetry.run_diagnosis)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from splitserve.api.spec import InferenceDeploymentSpec
from splitserve.api.status import DiagnosisStatus
from splitserve.diagnosis.findings import DiagnosisInput, QuestionResult
from splitserve.diagnosis.gpus import GpuChoice, choose_gpu
from splitserve.diagnosis.render import render_json, render_text, summarise, to_json_document


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
