"""summarise() for the kubectl column, patch tags, and the status conversion."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from splitserve.api.status import DiagnosisStatus
from splitserve.diagnosis.findings import QuestionResult
from splitserve.diagnosis.questions import diagnose
from splitserve.diagnosis.render import render_text, summarise, tag_for_patch
from splitserve.diagnosis.report import Report
from tests.diagnosis.conftest import InputFactory, SpecFactory


@pytest.mark.parametrize(
    ("patch", "tag"),
    [
        (None, ""),
        ({"model": {"quantization": "fp8"}, "decode": {"tensorParallelSize": 2, "resources": {"gpus": 2}}}, "fp8+tp2"),
        ({"router": {"routingPolicy": {"prefill": "prefix-aware"}}}, "prefix-aware"),
        ({"engine": {"speculativeDecoding": {"method": "ngram", "numSpeculativeTokens": 3}}}, "spec-decode"),
        ({"engine": {"speculativeDecoding": {"method": "off"}}}, "spec-decode-off"),
        ({"engine": {"maxNumSeqs": None}}, "batching"),
        ({"decode": {"replicas": 3, "maxReplicas": 3}}, "decode-replicas"),
        ({"prefill": {"replicas": 1}, "decode": {"replicas": 4}}, "pd-ratio"),
        ({"mode": "aggregated"}, "aggregated"),
        ({"model": {"maxModelLen": 16384}}, "max-model-len"),
    ],
)
def test_tag_for_patch(patch: dict[str, Any] | None, tag: str) -> None:
    assert tag_for_patch(patch) == tag


def _result(number: int, status: str, verdict: str, patch: dict[str, Any] | None = None) -> QuestionResult:
    return QuestionResult(number, f"k{number}", f"Q{number}", status, verdict, patch=patch)  # type: ignore[arg-type]


def test_summary_names_the_fit_and_each_recommendation() -> None:
    results = [
        _result(1, "ok", "fits: weights take 20%"),
        _result(2, "recommend", "60% shared", {"router": {"routingPolicy": {"prefill": "prefix-aware"}}}),
        _result(3, "ok", "low variance"),
        _result(5, "recommend", "slow", {"engine": {"speculativeDecoding": {"method": "ngram"}}}),
    ]
    assert summarise(results) == "fits; 2 recommendations: prefix-aware, spec-decode"
    # The same line from the API's Finding objects (what the operator keeps in status).
    assert summarise([r.to_finding() for r in results]) == "fits; 2 recommendations: prefix-aware, spec-decode"


def test_summary_of_a_problem_without_patch_uses_the_question_key() -> None:
    results = [_result(1, "problem", "does not fit: weights 900 GiB"), _result(4, "problem", "KV pressure")]
    assert summarise(results) == "does not fit; 2 recommendations: k1, k4"


def test_summary_without_recommendations_and_without_telemetry(
    make_spec: SpecFactory, make_input: InputFactory
) -> None:
    spec = make_spec({"model": {"parameterCount": 8_000_000_000, "maxModelLen": 8192}})
    results = diagnose(make_input(spec))
    assert summarise(results) == "fits; no recommendations (no telemetry)"


def test_report_status_fits_the_api_model(make_spec: SpecFactory, make_input: InputFactory) -> None:
    inp = make_input(make_spec({"model": {"name": "m-70b", "maxModelLen": 8192}}))
    report = Report("d", "ml", inp, diagnose(inp), None)
    status = report.status(datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC))
    assert isinstance(status, DiagnosisStatus)
    assert status.time == "2026-01-02T03:04:05Z"
    assert status.summary.startswith("does not fit; ")
    assert status.findings[0].question == "1. Hardware-model fit"
    assert status.findings[0].patch is not None
    wire = status.to_wire()
    assert DiagnosisStatus.model_validate(wire) == status


def test_text_wraps_to_the_width_given(make_spec: SpecFactory, make_input: InputFactory) -> None:
    inp = make_input(make_spec({"model": {"name": "m-70b"}}))
    text = render_text("d", None, inp, diagnose(inp), width=80)
    assert all(len(line) <= 80 for line in text.splitlines() if not line.lstrip().startswith("patch:"))
