"""`splitserve diagnose` on every InferenceDeployment shipped under deploy/: valid, and no confusing lines.

Without Prometheus only the spec speaks, so the checks are about what a reader would trip over: a GPU
assumed for CPU-only pools, a prefill pool shown for an aggregated deployment.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from splitserve.api.spec import Mode
from splitserve.commands.diagnose import first_deployment, parse_spec
from splitserve.diagnosis.findings import pools_in_use
from splitserve.io.telemetry import run_diagnosis

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
TEXTS = {
    path: text
    for path in sorted(DEPLOY.rglob("*.yaml"))
    if "crds" not in path.parts and "kind: InferenceDeployment" in (text := path.read_text(errors="replace"))
}
EXAMPLES = list(TEXTS)


def test_examples_found() -> None:
    assert len(EXAMPLES) >= 5, EXAMPLES


@pytest.mark.parametrize("path", EXAMPLES, ids=[str(p.relative_to(DEPLOY)) for p in EXAMPLES])
async def test_example_diagnosis_reads_clearly(path: Path, tmp_path: Path) -> None:
    spec = parse_spec(first_deployment(TEXTS[path], str(path)), str(path))
    report = await run_diagnosis(spec, name=path.stem, cache_dirs=[tmp_path / "no-hf-cache"])
    text = report.text(width=120)
    header = text.split("\n\n", 1)[0]
    assert len(report.results) == 6
    if spec.mode is Mode.AGGREGATED:
        assert "prefill" not in header, header
        assert "prefill /" not in text, text
    for name, pool in pools_in_use(spec):
        if pool.resources.gpus == 0:
            assert f"{name}: CPU only" in header, header
            assert f"{name} GPU" not in text, text
    fit = report.results[0]
    if all(pool.resources.gpus == 0 for _, pool in pools_in_use(spec)):
        assert fit.status == "unknown" and "CPU-only" in fit.verdict, fit.verdict
    else:
        assert fit.status in ("ok", "problem"), fit.verdict
