"""`splitserve validate` warnings: accepted by a cluster, but not what the user meant (exit 0)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from splitserve.validation import object_advice, text_advice, validate_object
from tests.operator.helpers import minimal

AUTOSCALED = {"enabled": True, "prometheusUrl": "http://prometheus:9090"}
DECODE_AT_ZERO = {"replicas": 0, "minReplicas": 0, "maxReplicas": 4}


def scale_to_zero(queue_seconds: float | None = None, **overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"decode": DECODE_AT_ZERO, "autoscaling": AUTOSCALED, **overrides}
    if queue_seconds is not None:
        spec["router"] = {"timeouts": {"queueSeconds": queue_seconds}}
    return minimal(**spec)


def test_decode_at_zero_with_the_default_queue_timeout_warns() -> None:
    obj = scale_to_zero()
    assert validate_object(obj) == [], "a warning is not an error"
    (warning,) = object_advice(obj)
    assert warning.path == "spec.router.timeouts.queueSeconds"
    assert "60s is shorter than a worker's cold start" in warning.message
    assert "spec.decode.minReplicas is 0" in warning.message
    assert "Set spec.router.timeouts.queueSeconds to 120 or more" in warning.message


@pytest.mark.parametrize(
    ("obj", "why"),
    [
        (scale_to_zero(queue_seconds=120), "the queue outlasts a cold start"),
        (scale_to_zero(queue_seconds=300), "the queue outlasts a cold start"),
        (minimal(decode=DECODE_AT_ZERO), "autoscaling off: nothing scales it from zero anyway"),
        (minimal(decode={"minReplicas": 1}, autoscaling=AUTOSCALED), "decode never at zero"),
        (
            minimal(prefill={"replicas": 0, "minReplicas": 0, "maxReplicas": 2}, autoscaling=AUTOSCALED),
            "prefill at zero holds no request: the router serves it aggregated on decode",
        ),
    ],
)
def test_no_warning_when_no_request_waits_out_a_cold_start(obj: dict[str, Any], why: str) -> None:
    assert validate_object(obj) == []
    assert object_advice(obj) == [], why


def test_aggregated_mode_at_zero_warns_about_the_aggregated_pool() -> None:
    (warning,) = object_advice(scale_to_zero(queue_seconds=90, mode="aggregated"))
    assert "90s is shorter" in warning.message and "the aggregated pool (spec.decode) at zero" in warning.message


def test_invalid_documents_get_their_errors_not_warnings() -> None:
    broken = scale_to_zero(decode={"replicas": 5, "minReplicas": 0, "maxReplicas": 2})
    assert validate_object(broken) != []
    assert object_advice(broken) == []
    assert text_advice("{not yaml") == []


def test_validate_prints_the_warning_and_exits_zero(tmp_path: Path) -> None:
    warned, quiet = tmp_path / "warned.yaml", tmp_path / "quiet.yaml"
    warned.write_text(yaml.safe_dump(scale_to_zero()))
    quiet.write_text(yaml.safe_dump(scale_to_zero(queue_seconds=180)))
    result = subprocess.run(["splitserve", "validate", "-f", str(warned)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert f"{warned}: valid" in result.stdout
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"{warned}: WARNING: document 1 (demo): spec.router.timeouts.queueSeconds: 60s is shorter")
    assert "Traceback" not in result.stderr
    clean = subprocess.run(["splitserve", "validate", "-f", str(quiet)], capture_output=True, text=True)
    assert clean.returncode == 0 and clean.stderr == "", clean.stderr
    # A real error still fails, with or without the warning's conditions.
    both = tmp_path / "both.yaml"
    both.write_text(yaml.safe_dump_all([scale_to_zero(), minimal(mode="split")]))
    failed = subprocess.run(["splitserve", "validate", "-f", str(both)], capture_output=True, text=True)
    assert failed.returncode == 1
    assert "WARNING: document 1" in failed.stderr and "document 2 (demo): spec.mode" in failed.stderr


# --------------------------------------------------------------------------- precise-prefix routing

PVC_MODEL = {"name": "m", "source": {"pvc": {"claimName": "weights", "path": "/llama"}}}


def precise(field: str = "decode", **overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"model": PVC_MODEL, "router": {"routingPolicy": {field: "precise-prefix"}}, **overrides}
    return minimal(**spec)


def test_precise_prefix_with_prefix_caching_off_warns_that_no_events_come() -> None:
    obj = precise(engine={"prefixCaching": False})
    assert validate_object(obj) == [], "a warning is not an error"
    (warning,) = object_advice(obj)
    assert warning.path == "spec.engine.prefixCaching"
    assert "prefix caching is off but spec.router.routingPolicy.decode is precise-prefix" in warning.message
    assert "the router would see no events" in warning.message
    assert "Set spec.engine.prefixCaching to true" in warning.message


@pytest.mark.parametrize(
    ("source", "path"),
    [
        ({"uri": "s3://bucket/m"}, "spec.model.source.uri"),
        ({"huggingFace": {"repo": "o/m"}}, "spec.model.source.huggingFace"),
    ],
)
def test_precise_prefix_without_a_pvc_tokenizes_through_a_worker(source: dict[str, Any], path: str) -> None:
    (warning,) = object_advice(precise("prefill", model={"name": "m", "source": source}))
    assert warning.path == path
    assert warning.message.startswith("spec.router.routingPolicy.prefill is precise-prefix")
    assert "asks a worker's POST /tokenize for every prompt" in warning.message


def test_both_pools_precise_prefix_say_so_once_per_problem() -> None:
    obj = minimal(
        engine={"prefixCaching": False},
        router={"routingPolicy": {"prefill": "precise-prefix", "decode": "precise-prefix"}},
    )
    warnings = object_advice(obj)
    assert [w.path for w in warnings] == ["spec.engine.prefixCaching", "spec.model.source.uri"]
    assert all("spec.router.routingPolicy.prefill and .decode are precise-prefix" in w.message for w in warnings)


@pytest.mark.parametrize(
    ("obj", "why"),
    [
        (precise(), "prefix caching on and the tokenizer on the claim: nothing to warn about"),
        (minimal(engine={"prefixCaching": False}), "no precise-prefix: events are not needed"),
        (
            minimal(
                mode="aggregated",
                engine={"prefixCaching": False},
                router={"routingPolicy": {"prefill": "precise-prefix"}},
            ),
            "aggregated mode has no prefill pool: its policy is never used",
        ),
    ],
)
def test_no_precise_prefix_warning_when_it_would_work_or_is_unused(obj: dict[str, Any], why: str) -> None:
    assert validate_object(obj) == []
    assert object_advice(obj) == [], why
