"""spec.adapters in `splitserve up`, without processes: the workers' and router's flags, the adapters
file, the tiny adapters, what a new adapter list changes (at run time, no restart, same generation)."""

from __future__ import annotations

import argparse
import io
import itertools
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from splitserve.engine import cli as worker_cli
from splitserve.local import stack
from splitserve.local.adapters import adapters_document, write_adapters_file
from splitserve.local.changes import describe_change
from splitserve.local.deployment import DeploymentFileError, LocalDeployment, load_deployment, parse_deployment
from splitserve.local.plan import Engine, PlanInputs, local_generation, plan_processes
from splitserve.local.supervisor import Progress
from splitserve.router import cli as router_cli
from splitserve.sim import cli as sim_cli
from splitserve.sim.config import LoRAConfig
from testkit.upctl import REPO

TINY_LORA = REPO / "deploy/local/tiny-lora.yaml"
FAKE = Path(__file__).with_name("fake_splitserve.py")
A, B = "tiny-lora-a", "tiny-lora-b"


def _with_adapters(adapters: list[dict[str, Any]], base: Path = TINY_LORA) -> LocalDeployment:
    document = yaml.safe_load(base.read_text())
    document["spec"]["adapters"] = adapters
    if not adapters:
        del document["spec"]["adapters"]
    return parse_deployment(yaml.safe_dump(document))


def _tiny(*names: str) -> list[dict[str, Any]]:
    return [{"name": name, "source": {"uri": f"splitserve://tiny-lora/{name}"}} for name in names]


def _inputs(engine: Engine) -> PlanInputs:
    ports = itertools.count(20000)
    return PlanInputs(
        engine=engine,
        router_port=8000,
        allocate_port=lambda: next(ports),
        splitserve=("python", "-m", "splitserve"),
        model_path="/m/tiny",
        spec_path="/run/spec.yaml",
        adapters_file="/run/adapters.json",
    )


def _parsed(configure: Any, argv: tuple[str, ...], skip: int) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure(parser)
    return parser.parse_args(list(argv[skip:]))


def test_every_worker_follows_the_adapters_file_with_lora_on_and_the_router_routes_by_adapter() -> None:
    deployment = load_deployment(TINY_LORA)
    sim = plan_processes(deployment, _inputs(Engine.SIM))
    for worker in sim.workers:
        args = _parsed(sim_cli.configure, worker.argv, 4)
        assert args.adapters_file == "/run/adapters.json"
        assert sim_cli.config_from_args(args).lora == LoRAConfig(max_loras=2, max_lora_rank=8, max_cpu_loras=4)
    assert router_cli.config_from_args(_parsed(router_cli.configure, sim.router.argv, 4)).lora
    for worker in plan_processes(deployment, _inputs(Engine.VLLM)).workers:
        args = _parsed(worker_cli.configure, worker.argv, 4)
        assert args.adapters_file == "/run/adapters.json"
        # The spec file `splitserve worker` reads gives vLLM its LoRA flags, as in a pod.
        args.file = str(REPO / "deploy/local/tiny-lora.yaml")
        plan = worker_cli.build_plan(args, {})
        assert plan.vllm_args[plan.vllm_args.index("--max-loras") + 1] == "2" and "--lora-modules" not in plan.vllm_args
        assert plan.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"

    without = plan_processes(load_deployment(REPO / "deploy/local/tiny-disaggregated.yaml"), _inputs(Engine.SIM))
    assert not any("--adapters-file" in w.argv or "--enable-lora" in w.argv for w in without.workers)
    assert "--lora" not in without.router.argv


def test_the_adapters_file_is_the_clusters_with_the_tiny_adapters_in_place(tmp_path: Path) -> None:
    deployment = _with_adapters([*_tiny(A), {"name": "mine", "source": {"uri": "/srv/adapters/mine"}}])
    document = adapters_document(deployment, {A: "/cache/tiny-model/loras/tiny-lora-a"})
    assert document == {
        "adapters": [
            {"name": A, "path": "/cache/tiny-model/loras/tiny-lora-a"},
            {"name": "mine", "path": "/srv/adapters/mine"},
        ]
    }
    path = tmp_path / "adapters.json"
    assert write_adapters_file(path, document) is True
    assert json.loads(path.read_text()) == document
    assert write_adapters_file(path, document) is False, "the same list: the file is left as it is"
    assert [p.name for p in tmp_path.iterdir()] == ["adapters.json"], "written whole: no partial file left"


@pytest.mark.parametrize(
    ("adapters", "model_uri", "problem"),
    [
        ([{"name": "p", "source": {"pvc": {"claimName": "c"}}}], None, "source.pvc needs a cluster"),
        (_tiny(A), "/models/llama", "is an adapter of the tiny model"),
        ([{"name": "x", "source": {"uri": "splitserve://tiny-lora/../x"}}], None, "NAME must match"),
    ],
)
def test_adapters_that_cannot_run_locally_are_refused(
    adapters: list[dict[str, Any]], model_uri: str | None, problem: str
) -> None:
    document = yaml.safe_load(TINY_LORA.read_text())
    document["spec"]["adapters"] = adapters
    if model_uri is not None:
        document["spec"]["model"]["source"] = {"uri": model_uri}
    with pytest.raises(DeploymentFileError) as refused:
        parse_deployment(yaml.safe_dump(document))
    assert any(problem in message for message in refused.value.messages), refused.value.messages


def _change(before: LocalDeployment, after: LocalDeployment, listed: LocalDeployment | None = None) -> Any:
    generation = local_generation(before, "/m/tiny")
    return describe_change(before, before, after, generation, local_generation(after, "/m/tiny"), listed)


def test_a_new_adapter_list_is_taken_at_run_time_without_restart_or_new_generation() -> None:
    running = _with_adapters(_tiny(A, B))
    change = _change(running, _with_adapters(_tiny(A, "tiny-lora-c")))
    assert change.adapters == "adapters: tiny-lora-a, tiny-lora-b -> tiny-lora-a, tiny-lora-c"
    assert not change.new_generation and not change.replicas and change.needs_restart == ()
    assert not change.applies_nothing
    moved = _with_adapters([*_tiny(A), {"name": B, "source": {"uri": "/srv/b"}}])
    assert _change(running, moved).adapters == "adapters: tiny-lora-b (source changed)"
    assert _change(running, _with_adapters([])).adapters == "adapters: tiny-lora-a, tiny-lora-b -> none"
    # What the file lists now counts, not what the workers started with.
    assert _change(running, running, listed=_with_adapters(_tiny(A))).adapters is not None
    assert _change(running, running).adapters is None


def test_turning_lora_on_in_a_running_stack_needs_a_restart() -> None:
    without = load_deployment(REPO / "deploy/local/tiny-disaggregated.yaml")
    document = yaml.safe_load((REPO / "deploy/local/tiny-disaggregated.yaml").read_text())
    document["spec"]["adapters"] = _tiny(A)
    change = _change(without, parse_deployment(yaml.safe_dump(document)))
    assert change.adapters is None
    assert change.needs_restart == (
        "adapters: none -> tiny-lora-a (LoRA on needs workers and a router started with it)",
    )


def _local_stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: Engine) -> stack.LocalStack:
    monkeypatch.setattr(stack, "splitserve_command", lambda: (sys.executable, str(FAKE)))
    monkeypatch.setenv("FAKE_SPLITSERVE_CALLS", str(tmp_path / "calls.txt"))
    options = stack.UpOptions(
        engine=engine,
        router_port=8000,
        run_dir=tmp_path / "run",
        model_dir=tmp_path / "cache" / "tiny-model",
        startup_timeout=30,
        stop_grace=2,
    )
    (tmp_path / "run").mkdir()
    return stack.LocalStack(load_deployment(TINY_LORA), options, Progress(io.StringIO()))


def test_vllm_builds_the_tiny_adapters_beside_the_model_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    local = _local_stack(tmp_path, monkeypatch, Engine.VLLM)
    model_dir = tmp_path / "cache" / "tiny-model"
    local._model_path(local.deployment)
    local._write_adapters(local.deployment)
    local._write_adapters(_with_adapters(_tiny(A, "tiny-lora-c")))
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert calls == [
        f"tiny-model {model_dir.with_name(f'tiny-model.partial-{os.getpid()}')}",
        f"tiny-model {model_dir} --loras-only --lora={A} --lora={B}",
        f"tiny-model {model_dir} --loras-only --lora=tiny-lora-c",
    ]
    listed = json.loads(local.adapters_path.read_text())["adapters"]
    assert listed == [
        {"name": A, "path": str(model_dir / "loras" / A)},
        {"name": "tiny-lora-c", "path": str(model_dir / "loras" / "tiny-lora-c")},
    ]


def test_the_simulators_get_adapter_configs_in_the_run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    local = _local_stack(tmp_path, monkeypatch, Engine.SIM)
    local._write_adapters(local.deployment)
    assert not (tmp_path / "calls.txt").exists(), "nothing built for the simulators"
    for entry in json.loads(local.adapters_path.read_text())["adapters"]:
        config = json.loads((Path(entry["path"]) / "adapter_config.json").read_text())
        assert config["r"] == 8 and entry["path"].startswith(str(tmp_path / "run"))
