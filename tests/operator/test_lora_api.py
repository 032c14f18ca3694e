"""spec.adapters and spec.engine.lora (LoRA): the CEL and schema rules, each with the message a person reads,
what is accepted, `splitserve validate`'s lines, and the warning for more adapters than the CPU cache."""

from __future__ import annotations

import argparse
import io
import json
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from splitserve.commands import validate as validate_command
from splitserve.validation import validate_object
from splitserve.validation.advice import object_advice
from tests.operator.helpers import minimal

HUB = {"name": "hub", "source": {"huggingFace": {"repo": "org/hub-lora", "revision": "v2"}}}
ON_CLAIM = {"name": "on-claim", "source": {"pvc": {"claimName": "loras", "path": "x/../on-claim"}}}
IN_IMAGE = {"name": "in-image", "source": {"uri": "/opt/loras/in-image"}}


def lora_doc(*adapters: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return minimal(**spec, adapters=list(adapters or [HUB, ON_CLAIM, IN_IMAGE]))


# --------------------------------------------------------------------------- CEL and schema

LORA_INVALID: list[tuple[str, dict[str, Any], str, str]] = [
    ("duplicate names", {"adapters": [IN_IMAGE, {**HUB, "name": "in-image"}]}, "spec.adapters",
     'adapter "in-image" is declared twice: adapters[].name must be unique'),
    ("the model's own name", {"adapters": [{**IN_IMAGE, "name": "m"}]}, "spec.adapters",
     'adapter "m" has the name of the base model (model.name)'),
    ("two source kinds", {"adapters": [{"name": "a", "source": {"uri": "/a", "pvc": {"claimName": "c"}}}]},
     "spec.adapters[0].source", "an adapter's source needs exactly one of huggingFace, pvc or uri"),
    ("no source kind", {"adapters": [{"name": "a", "source": {}}]}, "spec.adapters[0].source",
     "needs exactly one of huggingFace, pvc or uri"),
    ("not a model name", {"adapters": [{**IN_IMAGE, "name": "my adapter"}]}, "spec.adapters[0].name",
     'adapter name "my adapter" is not a valid model name, as model.name'),
    ("another HF token", {"model": {"name": "m", "source": {"huggingFace": {"repo": "o/m", "tokenSecretRef": {
        "name": "hf"}}}}, "adapters": [{"name": "a", "source": {"huggingFace": {"repo": "o/a", "tokenSecretRef": {
            "name": "other"}}}}]}, "spec.adapters", "must name the same Secret and key: a worker downloads with one"),
    ("CPU cache below the batch", {"engine": {"lora": {"maxLoras": 8, "maxCpuLoras": 4}}},
     "spec.engine.lora.maxCpuLoras", "must be at least engine.lora.maxLoras"),
    ("a rank vLLM lacks", {"engine": {"lora": {"maxRank": 12}}}, "spec.engine.lora.maxRank", "is not one of"),
    ("too many adapters", {"adapters": [{"name": f"a{i}", "source": {"uri": "/a"}} for i in range(65)]},
     "spec.adapters", "is too long"),
    ("unknown adapter field", {"adapters": [{**IN_IMAGE, "path": "/x"}]}, "spec.adapters[0]",
     "unknown field(s): 'path'"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "overrides", "path", "message"), LORA_INVALID, ids=[c[0] for c in LORA_INVALID])
def test_invalid_adapters_are_rejected_with_clear_messages(
    case: str, overrides: dict[str, Any], path: str, message: str
) -> None:
    problems = validate_object(minimal(**overrides))
    assert any(p.path == path and message in p.message for p in problems), [str(p) for p in problems]


@pytest.mark.parametrize(
    "overrides",
    [
        {"adapters": [HUB, ON_CLAIM, IN_IMAGE]},
        # One token for the model and the adapters; names with the model name's punctuation.
        {
            "model": {"name": "org/base", "source": {"huggingFace": {"repo": "o/m", "tokenSecretRef": {"name": "hf"}}}},
            "adapters": [{"name": "org/base:sql-v1.2_b", "source": {"huggingFace": {"repo": "o/a", "tokenSecretRef": {
                "name": "hf"}}}}],
        },
        {"engine": {"lora": {"maxLoras": 2, "maxRank": 64, "maxCpuLoras": 2}}},  # limits alone, LoRA off
    ],
)  # fmt: skip
def test_workable_adapter_specs_are_accepted(overrides: dict[str, Any]) -> None:
    assert validate_object(minimal(**overrides)) == []


def test_validate_prints_each_adapter_problem_readably(tmp_path: Path) -> None:
    doc = lora_doc({**IN_IMAGE, "name": "m"}, IN_IMAGE, IN_IMAGE)
    path = tmp_path / "bad.yaml"
    path.write_text(json.dumps(doc))
    err, out = io.StringIO(), io.StringIO()
    with redirect_stderr(err), redirect_stdout(out):
        code = validate_command.run(argparse.Namespace(filename=[str(path)]))
    assert code == 1
    lines = err.getvalue().splitlines()
    assert f'{path}: document 1 (demo): spec.adapters: adapter "in-image" is declared twice' in lines[0]
    assert 'adapter "m" has the name of the base model' in lines[1]


def test_more_adapters_than_the_cpu_cache_is_a_warning_not_an_error() -> None:
    doc = lora_doc(*({"name": f"a{i}", "source": {"uri": f"/a{i}"}} for i in range(3)), engine={"lora": {
        "maxLoras": 1, "maxCpuLoras": 2}})  # fmt: skip
    assert validate_object(doc) == []
    (warning,) = object_advice(doc)
    assert warning.path == "spec.engine.lora.maxCpuLoras" and "fewer than the 3 adapters" in warning.message
