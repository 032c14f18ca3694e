"""Valid CRs pass the CRD's schema and CEL rules; a corpus of invalid ones fails with clear messages."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from splitserve.validation import validate_object, validate_text
from tests.operator.helpers import EXAMPLES, load, minimal
from tests.operator.test_gateway import GATEWAY_INVALID


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_valid(path: Path) -> None:
    assert validate_text(path.read_text()) == []


def test_minimal_spec_is_valid() -> None:
    assert validate_object(minimal()) == []


INVALID: list[tuple[str, dict[str, Any], str, str]] = [
    (
        "two model sources",
        {"model": {"name": "m", "source": {"uri": "/m", "pvc": {"claimName": "w"}}}},
        "spec.model.source",
        "exactly one of huggingFace, pvc or uri",
    ),
    ("no model source", {"model": {"name": "m", "source": {}}}, "spec.model.source", "exactly one of"),
    (
        "min above max",
        {"decode": {"replicas": 2, "minReplicas": 3, "maxReplicas": 2}},
        "spec.decode.minReplicas",
        "minReplicas must be less than or equal to maxReplicas",
    ),
    (
        "replicas outside bounds",
        {"prefill": {"replicas": 9, "minReplicas": 1, "maxReplicas": 4}},
        "spec.prefill.replicas",
        "replicas must lie between minReplicas and maxReplicas",
    ),
    (
        "gpus not a multiple of tp",
        {"decode": {"tensorParallelSize": 4, "resources": {"gpus": 6}}},
        "spec.decode.resources.gpus",
        "multiple of tensorParallelSize",
    ),
    (
        "disaggregated without connector",
        {"kvTransfer": {"connector": "None"}},
        "spec.kvTransfer.connector",
        "disaggregated mode needs a KV connector",
    ),
    (
        "draft model missing",
        {"engine": {"speculativeDecoding": {"method": "draft"}}},
        "spec.engine.speculativeDecoding",
        "needs speculativeDecoding.draftModel",
    ),
    ("unknown field", {"router": {"polcy": "x"}}, "spec.router", "unknown field(s): 'polcy'"),
    ("wrong type", {"router": {"port": "80"}}, "spec.router.port", "is not of type 'integer'"),
    ("bad enum", {"mode": "split"}, "spec.mode", "is not one of"),
    (
        "bad policy",
        {"router": {"routingPolicy": {"decode": "random"}}},
        "spec.router.routingPolicy.decode",
        "not one of",
    ),
    ("negative replicas", {"decode": {"replicas": -1}}, "spec.decode.replicas", "less than the minimum"),
    ("bad quantity", {"decode": {"resources": {"memory": "lots"}}}, "spec.decode.resources.memory", "not valid"),
    (
        "ratio bounds inverted",
        {"autoscaling": {"prefillDecodeRatio": {"min": 2, "max": 1}}},
        "spec.autoscaling.prefillDecodeRatio",
        "min must be <= max",
    ),
    (
        "query override with a misspelt placeholder",
        {"autoscaling": {"enabled": True, "queries": {"running": "sum(x{$wrkers})"}}},
        "spec.autoscaling.queries",
        "bad placeholder 'wrkers'",
    ),
    (
        "query override for an unknown signal",
        {"autoscaling": {"enabled": True, "queries": {"decode.bogus": "1"}}},
        "spec.autoscaling.queries",
        "unknown signal 'decode.bogus'",
    ),
    (
        "gpu utilization over 1",
        {"engine": {"gpuMemoryUtilization": 1.5}},
        "spec.engine.gpuMemoryUtilization",
        "maximum",
    ),
    (
        "kv events on the http port",
        {"engine": {"kvEventsPort": 8000}, "router": {"routingPolicy": {"decode": "precise-prefix"}}},
        "spec.engine.kvEventsPort",
        "must differ from engine.port and kvTransfer.sideChannelPort",
    ),
    (
        "kv events on the nixl side channel",
        {"engine": {"kvEventsPort": 5600}, "router": {"routingPolicy": {"prefill": "precise-prefix"}}},
        "spec.engine.kvEventsPort",
        "must differ from engine.port and kvTransfer.sideChannelPort",
    ),
    *GATEWAY_INVALID,
]


def test_kv_events_port_is_free_to_clash_when_no_pool_publishes_events() -> None:
    # The port is unused without precise-prefix, so an old spec that happens to match is not broken.
    assert validate_object(minimal(engine={"kvEventsPort": 8000})) == []
    assert validate_object(minimal(router={"routingPolicy": {"decode": "precise-prefix"}})) == []


@pytest.mark.parametrize(("case", "overrides", "path", "message"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_specs_are_rejected_with_clear_messages(
    case: str, overrides: dict[str, Any], path: str, message: str
) -> None:
    problems = validate_object(minimal(**overrides))
    assert problems, f"{case} was accepted"
    assert any(p.path == path and message in p.message for p in problems), [str(p) for p in problems]


def test_long_or_uppercase_names_are_rejected() -> None:
    obj = minimal()
    obj["metadata"]["name"] = "Upper-Case"
    assert any("lowercase DNS label" in p.message for p in validate_object(obj))
    obj["metadata"]["name"] = "a" * 41
    assert any("at most 40 characters" in p.message for p in validate_object(obj))


def test_wrong_kind_is_rejected() -> None:
    obj = minimal()
    obj["kind"] = "Deployment"
    assert validate_object(obj)[0].message.startswith("expected splitserve.io/v1alpha1 InferenceDeployment")


@pytest.mark.parametrize(
    ("field", "old", "new", "message"),
    [
        (("model", "name"), "m", "other", "model.name is immutable"),
    ],
)
def test_transition_rules_make_fields_immutable(field: tuple[str, str], old: str, new: str, message: str) -> None:
    before = minimal(kvTransfer={"connector": "NixlConnector"})
    after = minimal(kvTransfer={"connector": "NixlConnector"})
    after["spec"][field[0]][field[1]] = new
    before["spec"][field[0]][field[1]] = old
    assert validate_object(after) == [], "the new object alone is valid"
    problems = validate_object(after, old=before)
    assert any(message in p.message for p in problems), problems
    assert validate_object(before, old=before) == []


def test_changing_the_connector_is_allowed_it_starts_a_new_kv_generation() -> None:
    before = minimal(kvTransfer={"connector": "NixlConnector"})
    after = minimal(kvTransfer={"connector": "ExampleConnector"})
    assert validate_object(after, old=before) == []


def test_multi_document_file_reports_each_document(tmp_path: Path) -> None:
    good = load(EXAMPLES[0])
    bad = minimal(mode="split")
    bad["metadata"]["name"] = "broken"
    path = tmp_path / "many.yaml"
    path.write_text(yaml.safe_dump_all([good, bad]))
    problems = validate_text(path.read_text())
    assert [p.document for p in problems] == ["document 2 (broken)"]


def test_validate_command_exit_codes(tmp_path: Path) -> None:
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(yaml.safe_dump(minimal()))
    bad.write_text(yaml.safe_dump(minimal(decode={"replicas": 5, "maxReplicas": 2})))
    ok = subprocess.run(["splitserve", "validate", "-f", str(good)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    failed = subprocess.run(["splitserve", "validate", "-f", str(bad)], capture_output=True, text=True)
    assert failed.returncode == 1
    assert "spec.decode.minReplicas" not in failed.stderr
    assert "spec.decode.replicas: replicas must lie between" in failed.stderr
    assert "Traceback" not in failed.stderr
    missing = subprocess.run(
        ["splitserve", "validate", "-f", str(tmp_path / "nope.yaml")], capture_output=True, text=True
    )
    assert missing.returncode == 1 and "cannot read" in missing.stderr and "Traceback" not in missing.stderr


def test_render_prints_every_manifest_for_gitops(tmp_path: Path) -> None:
    from tests.operator.helpers import REPO

    result = subprocess.run(
        ["splitserve", "render", "-f", str(REPO / "deploy/examples/keda-backend.yaml"), "-n", "prod"],
        capture_output=True,
        text=True,
        check=True,
    )
    documents = list(yaml.safe_load_all(result.stdout))
    kinds = sorted({doc["kind"] for doc in documents})
    assert {"Deployment", "Service", "Role", "NetworkPolicy", "ScaledObject", "PodMonitor"} <= set(kinds)
    assert all(doc["metadata"]["namespace"] == "prod" for doc in documents)
    assert "&id" not in result.stdout, "no YAML anchors in output meant for review"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(minimal(mode="split")))
    refused = subprocess.run(["splitserve", "render", "-f", str(bad)], capture_output=True, text=True)
    assert refused.returncode == 1 and "spec.mode" in refused.stderr and refused.stdout == ""
