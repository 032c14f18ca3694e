"""The KV generation (api/generation.py): every listed field changes it and no other field does, it is
stable across parses, the docs' table is the list, and the offline tools built on it (`splitserve
diff`, `splitserve render --from`) say what a change does."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from splitserve.api.generation import (
    KV_GENERATION_FIELDS,
    fields_markdown,
    generation_changes,
    generation_inputs,
    kv_flags,
    kv_generation,
)
from splitserve.api.spec import DEFAULT_WORKER_IMAGE, InferenceDeploymentSpec
from splitserve.cli import main
from splitserve.validation import validate_object
from tests.operator.helpers import REPO, minimal

IMAGE = DEFAULT_WORKER_IMAGE
BASE: dict[str, Any] = {
    "model": {"name": "m", "source": {"huggingFace": {"repo": "org/m", "revision": "v1"}}},
    "prefill": {"replicas": 1, "maxReplicas": 2},
    "decode": {"replicas": 1, "maxReplicas": 4},
}


def _merged(base: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in change.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict) and key != "source":
            merged[key] = _merged(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _doc(change: dict[str, Any] | None = None) -> dict[str, Any]:
    doc = minimal(**_merged(BASE, change or {}))
    assert validate_object(doc) == [], "the table only holds valid specs"
    return doc


def _spec(change: dict[str, Any] | None = None) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.model_validate(_doc(change)["spec"])


def _generation(change: dict[str, Any] | None = None) -> str:
    return kv_generation(_spec(change), IMAGE)


# Generation path -> changes of it (each must start a new generation and be named by generation_changes).
GENERATION_CASES: dict[str, list[dict[str, Any]]] = {
    "model.source": [
        {"model": {"source": {"huggingFace": {"repo": "org/m", "revision": "v2"}}}},
        {"model": {"source": {"huggingFace": {"repo": "org/other", "revision": "v1"}}}},
        {"model": {"source": {"uri": "s3://bucket/m"}}},
        {"model": {"source": {"pvc": {"claimName": "weights", "path": "/m"}}}},
    ],
    "model.dtype": [{"model": {"dtype": "bfloat16"}}],
    "model.quantization": [{"model": {"quantization": "fp8"}}],
    "model.maxModelLen": [{"model": {"maxModelLen": 8192}}],
    "engine.kvCacheDtype": [{"engine": {"kvCacheDtype": "fp8"}}],
    "engine.blockSize": [{"engine": {"blockSize": 32}}],
    "engine.image": [{"engine": {"image": "vllm/vllm-openai:v0.99.0"}}],
    "prefill.tensorParallelSize": [{"prefill": {"tensorParallelSize": 2, "resources": {"gpus": 2}}}],
    "decode.tensorParallelSize": [{"decode": {"tensorParallelSize": 2, "resources": {"gpus": 2}}}],
    "kvTransfer.connector": [{"kvTransfer": {"connector": "ExampleConnector"}}],
    "kvTransfer.bufferDevice": [{"kvTransfer": {"bufferDevice": "cpu"}}],
    "kvTransfer.sharedStoragePath": [{"kvTransfer": {"sharedStoragePath": "/mnt/kv"}}],
    "engine.extraArgs": [
        {"engine": {"extraArgs": ["--revision", "x"]}},
        {"engine": {"extraArgs": ["--kv-cache-dtype=fp8"]}},
        {"engine": {"extraArgs": ["--kv_cache_dtype=fp8"]}},  # vLLM reads underscores as dashes
        {"engine": {"extraArgs": ["--enforce-eager", "--max-model-len", "4096"]}},
    ],
    "prefill.extraArgs": [{"prefill": {"extraArgs": ["--block-size", "64"]}}],
    "decode.extraArgs": [{"decode": {"extraArgs": ["-tp", "2"], "resources": {"gpus": 2}}}],
}

# Changes outside the generation: they roll pods within it, or none.
SAME_GENERATION_CASES: dict[str, dict[str, Any]] = {
    "replicas": {"decode": {"replicas": 3, "maxReplicas": 4}},
    "router settings": {"router": {"replicas": 3, "port": 9000, "routingPolicy": {"prefill": "round-robin"}}},
    "router timeouts": {"router": {"timeouts": {"queueSeconds": 240}}},
    "autoscaling": {"autoscaling": {"enabled": True, "backend": "keda", "prometheusUrl": "http://p:9090"}},
    "engine.maxNumSeqs": {"engine": {"maxNumSeqs": 64}},
    "engine.env": {"engine": {"env": [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}]}},
    "engine.port": {"engine": {"port": 8100}},
    "engine.prefixCaching": {"engine": {"prefixCaching": False}},
    "non-KV extraArgs": {"engine": {"extraArgs": ["--max-num-seqs", "8"]}},
    "non-KV pool extraArgs": {"decode": {"extraArgs": ["--max-num-batched-tokens=4096", "--enforce-eager"]}},
    "resources": {"decode": {"resources": {"cpu": "16", "memory": "64Gi"}}},
    "tolerations": {"prefill": {"tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]}},
    "nodeSelector": {"decode": {"nodeSelector": {"pool": "h100"}}},
    "HF tokenSecretRef": {
        "model": {"source": {"huggingFace": {"repo": "org/m", "revision": "v1", "tokenSecretRef": {"name": "hf"}}}}
    },
    "model.parameterCount": {"model": {"parameterCount": 8_000_000_000}},
    "monitoring": {"monitoring": {"enabled": True, "intervalSeconds": 30}},
    "rollout settings": {
        "rollout": {"prefill": {"maxSurge": 2}, "decode": {"maxSurge": 3}, "analysis": {"windowSeconds": 60}}
    },
    "engine.image = the resolved default": {"engine": {"image": DEFAULT_WORKER_IMAGE}},
    "side channel port": {"kvTransfer": {"sideChannelPort": 5700}},
}


def test_every_documented_field_has_a_case() -> None:
    documented = {path.strip() for kv_field in KV_GENERATION_FIELDS for path in kv_field.path.split("/")}
    assert documented == set(GENERATION_CASES)
    assert set(generation_inputs(_spec(), IMAGE)) == documented, "the hash's inputs are the documented list"


@pytest.mark.parametrize(
    ("path", "change"),
    [(path, change) for path, changes in GENERATION_CASES.items() for change in changes],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_each_generation_field_changes_the_generation(path: str, change: dict[str, Any]) -> None:
    before, after = _spec(), _spec(change)
    assert kv_generation(after, IMAGE) != kv_generation(before, IMAGE)
    changed = generation_changes(generation_inputs(before, IMAGE), generation_inputs(after, IMAGE))
    assert [line.split(":", 1)[0] for line in changed] == [path], changed


@pytest.mark.parametrize("change", SAME_GENERATION_CASES.values(), ids=SAME_GENERATION_CASES.keys())
def test_fields_outside_the_list_keep_the_generation(change: dict[str, Any]) -> None:
    assert _generation(change) == _generation()
    assert generation_changes(generation_inputs(_spec(), IMAGE), generation_inputs(_spec(change), IMAGE)) == []


def test_the_operators_default_image_is_part_of_the_generation() -> None:
    spec = _spec()
    assert kv_generation(spec, "registry/worker:1") != kv_generation(spec, "registry/worker:2")
    pinned = _spec({"engine": {"image": "registry/worker:1"}})
    assert kv_generation(pinned, "registry/worker:2") == kv_generation(spec, "registry/worker:1")


def _reversed_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _reversed_keys(value[key]) for key in reversed(list(value))}
    return value


def test_the_generation_is_stable_across_parses_and_key_order() -> None:
    doc = _doc({"engine": {"kvCacheDtype": "fp8", "extraArgs": ["--revision", "x"]}})
    text = yaml.safe_dump(doc)
    first = kv_generation(InferenceDeploymentSpec.model_validate(yaml.safe_load(text)["spec"]), IMAGE)
    second = kv_generation(InferenceDeploymentSpec.model_validate(yaml.safe_load(text)["spec"]), IMAGE)
    shuffled = kv_generation(InferenceDeploymentSpec.model_validate(_reversed_keys(doc)["spec"]), IMAGE)
    assert first == second == shuffled
    assert len(first) == 10 and int(first, 16) >= 0


def test_the_generation_of_a_fixed_spec_never_changes() -> None:
    # Changing the hash (its inputs, their spelling, the canonical JSON) gives every running
    # deployment a new generation on the next operator upgrade: a full rollout of every GPU pool.
    # Only do that on purpose, and say so in the release notes.
    assert _generation() == kv_generation(_spec(), IMAGE) == "c605bf6f77"


def test_kv_flags_pick_only_kv_shaping_flags_as_written() -> None:
    args = ["--max-num-seqs", "8", "--kv_cache_dtype=fp8", "--enforce-eager", "--max-model-len", "-1", "-tp", "2"]
    assert kv_flags(args) == ["--kv_cache_dtype=fp8", "--max-model-len", "-1", "-tp", "2"]
    assert kv_flags(["--revision", "--enforce-eager"]) == ["--revision"], "a flag, not a value, follows"


def test_changes_name_paths_only_one_side_has() -> None:
    assert generation_changes({"a": 1, "gone": 2}, {"a": 1}) == ["gone: 2 -> null"]


# --------------------------------------------------------------------------- docs

GENERATED_START = "<!-- generated: kv-generation-fields -->"
GENERATED_END = "<!-- end generated -->"


def test_the_docs_table_is_the_field_list() -> None:
    doc = (REPO / "docs" / "rollouts.md").read_text()
    start = doc.index(GENERATED_START) + len(GENERATED_START)
    end = doc.index(GENERATED_END)
    assert doc[start:end].strip() == fields_markdown().strip(), (
        "docs/rollouts.md drifted from KV_GENERATION_FIELDS: paste splitserve.api.generation.fields_markdown()"
    )


# --------------------------------------------------------------------------- splitserve diff / render --from


def _write(tmp_path: Path, name: str, change: dict[str, Any] | None = None) -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(_doc(change)))
    return str(path)


def test_diff_says_a_revision_change_starts_a_new_generation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = _write(tmp_path, "old.yaml")
    new = _write(
        tmp_path,
        "new.yaml",
        {"model": {"source": {"huggingFace": {"repo": "org/m", "revision": "v2"}}}, "decode": {"replicas": 3}},
    )
    assert main(["diff", old, new]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"old generation {_generation()} ({old})"
    assert out[1].startswith("new generation ") and out[1] != out[0].replace("old", "new")
    assert out[2].startswith("starts a new generation: make-before-break")
    assert out[3] == "generation fields changed:"
    assert out[4].startswith("  model.source: ") and '"revision":"v2"' in out[4]
    assert out[5:] == ["other changes:", "  decode.replicas: 1 -> 3"]
    assert main(["diff", "--exit-code", old, new]) == 1
    capsys.readouterr()


def test_diff_within_a_generation_names_the_pods_that_roll(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = _write(tmp_path, "old.yaml")
    new = _write(tmp_path, "new.yaml", {"decode": {"extraArgs": ["--max-num-seqs", "8"]}})
    assert main(["diff", "--exit-code", old, new]) == 0
    out = capsys.readouterr().out
    assert "same generation: pods roll within it" in out
    assert "generation fields changed: none" in out
    assert '  decode.extraArgs: [] -> ["--max-num-seqs","8"]' in out
    assert out.endswith("pods that roll: decode\n")
    assert main(["diff", old, old]) == 0
    assert "no change" in capsys.readouterr().out


def test_diff_lists_a_non_kv_change_inside_a_generation_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = _write(tmp_path, "old.yaml")
    secret = {
        "model": {"source": {"huggingFace": {"repo": "org/m", "revision": "v1", "tokenSecretRef": {"name": "hf"}}}}
    }
    assert main(["diff", old, _write(tmp_path, "new.yaml", secret)]) == 0
    out = capsys.readouterr().out
    assert "generation fields changed: none" in out
    assert "  model.source.huggingFace.tokenSecretRef.name: (unset) -> hf" in out


def test_diff_hashes_the_given_worker_image(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = _write(tmp_path, "old.yaml")
    new = _write(tmp_path, "new.yaml", {"engine": {"image": "registry/worker:7"}})
    assert main(["diff", "--exit-code", "--worker-image", "registry/worker:7", old, new]) == 0
    assert "same generation" in capsys.readouterr().out
    assert main(["diff", "--exit-code", old, new]) == 1
    assert f"engine.image: {DEFAULT_WORKER_IMAGE} -> registry/worker:7" in capsys.readouterr().out


def test_diff_refuses_invalid_or_unreadable_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = _write(tmp_path, "old.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(minimal(mode="split")))
    assert main(["diff", old, str(bad)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and f"{bad}: " in captured.err and "spec.mode" in captured.err
    assert main(["diff", old, str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read" in capsys.readouterr().err
    two = tmp_path / "two.yaml"
    two.write_text(yaml.safe_dump_all([_doc(), {**_doc(), "metadata": {"name": "other", "namespace": "ns"}}]))
    assert main(["diff", old, str(two)]) == 2
    assert "holds 2 InferenceDeployments (demo, other)" in capsys.readouterr().err


def _render(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[list[str], list[dict[str, Any]]]:
    assert main(["render", *argv]) == 0
    out = capsys.readouterr().out
    header = [line for line in out.splitlines() if line.startswith("#")]
    return header, [doc for doc in yaml.safe_load_all(out) if doc is not None]


def test_render_from_shows_both_generations_mid_rollout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keda = {"autoscaling": {"enabled": True, "backend": "keda", "prometheusUrl": "http://p:9090"}}
    old = _write(tmp_path, "old.yaml", keda)
    new = _write(tmp_path, "new.yaml", {**keda, "engine": {"kvCacheDtype": "fp8"}})
    old_generation, new_generation = _generation(keda), _generation({**keda, "engine": {"kvCacheDtype": "fp8"}})
    header, manifests = _render(["-f", new, "--from", old], capsys)
    deployments = [doc["metadata"]["name"] for doc in manifests if doc["kind"] == "Deployment"]
    assert deployments == [
        f"demo-prefill-{new_generation}",
        f"demo-decode-{new_generation}",
        f"demo-prefill-{old_generation}",
        f"demo-decode-{old_generation}",
        "demo-router",
    ]
    old_decode = next(doc for doc in manifests if doc["metadata"]["name"] == f"demo-decode-{old_generation}")
    assert "--kv-cache-dtype" not in old_decode["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not [doc for doc in manifests if doc["kind"] in ("ScaledObject", "HorizontalPodAutoscaler")]
    text = "\n".join(header)
    assert f"new generation {new_generation} ({new})" in text
    assert f"old generation {old_generation} ({old})" in text
    assert "engine.kvCacheDtype: auto -> fp8" in text
    assert f"ScaledObject demo-decode-{new_generation}" in text, "the header names what is withheld"
    # Without --from: the spec's own objects, its autoscalers aimed at its generation.
    header, plain = _render(["-f", new], capsys)
    assert header == []
    scaled = [doc for doc in plain if doc["kind"] == "ScaledObject"]
    assert {doc["spec"]["scaleTargetRef"]["name"] for doc in scaled} == {
        f"demo-prefill-{new_generation}",
        f"demo-decode-{new_generation}",
    }


def test_render_from_the_same_generation_renders_one_set(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = _write(tmp_path, "old.yaml")
    new = _write(tmp_path, "new.yaml", {"decode": {"replicas": 3}})
    header, manifests = _render(["-f", new, "--from", old], capsys)
    assert len(header) == 1 and f"same KV generation {_generation()}" in header[0]
    assert [doc["metadata"]["name"] for doc in manifests if doc["kind"] == "Deployment"] == [
        f"demo-prefill-{_generation()}",
        f"demo-decode-{_generation()}",
        "demo-router",
    ]
    assert main(["render", "-f", new, "--from", str(tmp_path / "missing.yaml")]) == 1
    assert "cannot read" in capsys.readouterr().err


def test_every_example_diffs_against_itself_as_no_change(capsys: pytest.CaptureFixture[str]) -> None:
    for example in sorted((REPO / "deploy" / "examples").glob("*.yaml")):
        assert main(["diff", "--exit-code", str(example), str(example)]) == 0
        assert capsys.readouterr().out.splitlines()[2] == "no change"
