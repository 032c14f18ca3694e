"""Engine vllm builds the tiny model once, in the cache, and reuses it."""

from __future__ import annotations

import io
import sys
import time
from pathlib import Path

import pytest

from splitserve.local import stack
from splitserve.local.deployment import load_deployment
from splitserve.local.plan import Engine, plan_processes
from splitserve.local.supervisor import Progress, StartupError
from testkit.upctl import REPO

FAKE = Path(__file__).with_name("fake_splitserve.py")


@pytest.fixture
def local_stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> stack.LocalStack:
    monkeypatch.setattr(stack, "splitserve_command", lambda: (sys.executable, str(FAKE)))
    monkeypatch.setenv("FAKE_SPLITSERVE_CALLS", str(tmp_path / "calls.txt"))
    options = stack.UpOptions(
        engine=Engine.VLLM,
        router_port=8000,
        run_dir=tmp_path,
        model_dir=tmp_path / "cache" / "tiny-model",
        startup_timeout=30,
        stop_grace=2,
    )
    deployment = load_deployment(REPO / "deploy/local/tiny-disaggregated.yaml")
    return stack.LocalStack(deployment, options, Progress(io.StringIO()))


def test_built_on_first_use_then_reused(local_stack: stack.LocalStack, tmp_path: Path) -> None:
    model_dir = tmp_path / "cache" / "tiny-model"
    assert local_stack._model_path(local_stack.deployment) == str(model_dir)
    assert (model_dir / "config.json").exists()
    assert not list(model_dir.parent.glob("*.partial-*")), "the partial build is renamed, not left behind"
    assert local_stack._model_path(local_stack.deployment) == str(model_dir)
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert len(calls) == 1 and calls[0].startswith("tiny-model ")
    # The finished build must not read as a process that died while serving.
    assert local_stack.supervisor.watch(deadline=time.monotonic() + 0.3) is None


def test_failed_build_is_a_startup_error_with_its_log(
    local_stack: stack.LocalStack, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("FAKE_TINY_MODEL_FAIL", "1")
    with pytest.raises(StartupError, match="tiny-model failed with code 1") as raised:
        local_stack._model_path(local_stack.deployment)
    assert "no more bytes" in raised.value.log_tail
    assert not (tmp_path / "cache" / "tiny-model").exists()
    assert not list((tmp_path / "cache").glob("*.partial-*")), "a failed build leaves nothing behind"


def test_plan_points_workers_at_the_built_model(local_stack: stack.LocalStack, tmp_path: Path) -> None:
    deployment = local_stack.deployment
    generation = local_stack._generation(deployment, local_stack._generation_id(deployment))
    plan = plan_processes(deployment, generation.plan_inputs)
    spec_file = tmp_path / "spec.yaml"
    assert f"uri: {tmp_path / 'cache' / 'tiny-model'}" in spec_file.read_text()
    # The model's folder is part of the KV generation: another folder would be other weights.
    assert generation.inputs["model.source"] == {"uri": str(tmp_path / "cache" / "tiny-model")}
    for worker in plan.workers:
        assert worker.generation == generation.id
        assert worker.argv[worker.argv.index("--model") + 1] == str(tmp_path / "cache" / "tiny-model")
        assert worker.argv[worker.argv.index("-f") + 1] == str(spec_file)
