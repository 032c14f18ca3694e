"""`splitserve diagnose`: text and JSON output, no-Prometheus behaviour, user errors."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from splitserve.cli import main
from splitserve.commands.diagnose import parse_at
from tests.diagnosis.conftest import LLAMA_70B

ModelDir = Callable[[dict[str, Any]], Path]


def write_manifest(tmp_path: Path, spec: dict[str, Any], *, leading: list[dict[str, Any]] | None = None) -> Path:
    documents = [
        *(leading or []),
        {
            "apiVersion": "splitserve.io/v1alpha1",
            "kind": "InferenceDeployment",
            "metadata": {"name": "chat", "namespace": "ml"},
            "spec": spec,
        },
        {"apiVersion": "splitserve.io/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": "second"}},
    ]
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump_all(documents))
    return path


@pytest.fixture
def llama70(tmp_path: Path, model_dir: ModelDir) -> Path:
    directory = model_dir(LLAMA_70B)
    spec = {
        "model": {"name": "llama-70b", "source": {"uri": str(directory)}, "dtype": "bfloat16", "maxModelLen": 32768}
    }
    return write_manifest(
        tmp_path, spec, leading=[{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ml"}}]
    )


def test_text_output_is_an_aligned_table_with_details(llama70: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diagnose", "-f", str(llama70), "--gpu", "H100-80GB"]) == 0
    out = capsys.readouterr().out
    assert "Diagnosis of InferenceDeployment chat (namespace ml)" in out
    table = [line for line in out.splitlines() if line[:2] in {f"{n} " for n in range(1, 7)}]
    assert len(table) == 6
    status_column = {
        line.index(status)
        for line, status in zip(table, ["problem", "unknown", "ok", "unknown", "unknown", "unknown"], strict=True)
    }
    assert len(status_column) == 1  # statuses line up in one column
    assert "does not fit" in out
    assert "fp8 weights at TP 2" in out
    assert 'patch: {"model": {"quantization": "fp8"}' in out
    assert "no telemetry:" in out
    assert out.rstrip().splitlines()[-1].startswith("summary: does not fit; ")


def test_json_output_is_stable_and_documented(llama70: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diagnose", "-f", str(llama70), "--gpu", "H100-80GB", "-o", "json"]) == 0
    first = capsys.readouterr().out
    assert main(["diagnose", "-f", str(llama70), "--gpu", "H100-80GB", "-o", "json"]) == 0
    assert capsys.readouterr().out == first
    document = json.loads(first)
    assert list(document) == ["apiVersion", "kind", "deployment", "summary", "telemetry", "gpus", "model", "findings"]
    assert document["deployment"] == {"name": "chat", "namespace": "ml", "mode": "disaggregated"}
    assert document["telemetry"]["available"] is False
    assert document["gpus"]["decode"]["type"] == "H100-80GB"
    findings = document["findings"]
    assert [f["number"] for f in findings] == [1, 2, 3, 4, 5, 6]
    for finding in findings:
        assert list(finding) == [
            "number", "key", "question", "status", "verdict", "evidence", "recommendation", "patch", "alternatives"
        ]  # fmt: skip
        assert finding["status"] in {"ok", "recommend", "problem", "unknown"}
        assert all(set(e) == {"text", "source"} for e in finding["evidence"])
    assert document["model"]["parameterCount"] == 70_552_387_584
    fit = findings[0]
    assert fit["key"] == "hardware-fit" and fit["status"] == "problem"
    assert fit["patch"]["model"] == {"quantization": "fp8"}
    assert [a["description"].split(":")[0] for a in fit["alternatives"]] == ["fp8 weights at TP 2", "TP 4 (bfloat16)"]


def test_unreachable_prometheus_is_reported_and_the_spec_still_answered(
    llama70: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["diagnose", "-f", str(llama70), "--prometheus", "http://127.0.0.1:9", "-o", "json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["telemetry"]["available"] is False
    assert "not reachable" in document["telemetry"]["note"]
    assert document["gpus"]["decode"]["assumed"] is True
    assert document["findings"][0]["status"] == "problem"


def test_gpu_from_node_selector(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    selector = {"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-L4"}}
    spec = {
        "model": {
            "name": "m",
            "source": {"uri": "s3://bucket/m"},
            "parameterCount": 8_000_000_000,
            "maxModelLen": 8192,
        },
        "mode": "aggregated",
        "decode": selector,
    }
    assert main(["diagnose", "-f", str(write_manifest(tmp_path, spec)), "-o", "json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["gpus"]["decode"]["type"] == "L4"
    assert document["findings"][0]["verdict"].startswith("fits")
    assert "remote" in document["model"]["configNote"]


@pytest.mark.parametrize(
    ("content", "args", "message"),
    [
        ("kind: Namespace\n", [], "no InferenceDeployment document"),
        ("{: bad", [], "not valid YAML"),
        (
            "kind: InferenceDeployment\nspec:\n  model: {name: m, source: {uri: /m}, dtype: float8}\n",
            [],
            "invalid spec at spec.model.dtype",
        ),
        ("kind: InferenceDeployment\nspec:\n  model: {name: m, source: {uri: /m}}\n", ["--gpu", "H1OO"], "unknown GPU"),
        (
            "kind: InferenceDeployment\nspec:\n  model: {name: m, source: {uri: /m}}\n",
            ["--window", "5 min"],
            "duration",
        ),
        (
            "kind: InferenceDeployment\nspec:\n  model: {name: m, source: {uri: /m}}\n",
            ["--prometheus", "http://127.0.0.1:1", "--at", "yesterday"],
            "neither RFC 3339",
        ),
        (
            "kind: InferenceDeployment\nspec:\n  model: {name: m, source: {uri: /m}}\n",
            ["--prometheus", "http://127.0.0.1:1", "--at", "2026-12-06T14:05:00"],
            "no time zone",
        ),
        (
            "kind: InferenceDeployment\nspec:\n  model: {name: m, source: {uri: /m}}\n",
            ["--prometheus", "http://127.0.0.1:1", "--at", "nan"],
            "is not a time",
        ),
        (
            "kind: InferenceDeployment\nspec:\n  model: {name: m, source: {uri: /m}}\n",
            ["--at", "1796565900"],
            "needs --prometheus",
        ),
    ],
)
def test_user_errors_are_one_line_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, args: list[str], message: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    assert main(["diagnose", "-f", str(path), *args]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert message in captured.err
    assert len(captured.err.strip().splitlines()) == 1


def test_missing_file_is_a_user_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diagnose", "-f", str(tmp_path / "nope.yaml")]) == 1
    assert "cannot read" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("2026-12-06T14:05:00Z", 1796565900.0),
        ("2026-12-06T15:05:00+01:00", 1796565900.0),
        ("1796565900.5", 1796565900.5),
        (None, None),
    ],
)
def test_at_reads_rfc3339_or_unix_seconds(text: str | None, seconds: float | None) -> None:
    assert parse_at(text) == seconds
