"""`splitserve worker`: building the plan from a spec file or from rendered arguments, and user errors."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

import pytest

from splitserve.builders.vllm_args import build_engine_launch, option_value
from splitserve.cli import main
from splitserve.engine import cli
from splitserve.engine.launcher import VLLM_SERVER_MODULE, LaunchError
from tests.engine.specs import make_spec

SPEC_YAML = """\
apiVersion: splitserve.io/v1alpha1
kind: InferenceDeployment
metadata: {{name: tiny}}
spec:
  model: {{name: tiny, source: {{uri: {model}}}, maxModelLen: 2048}}
  kvTransfer: {{bufferDevice: cpu, sideChannelPort: 5611}}
"""


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    return directory


@pytest.fixture
def spec_file(tmp_path: Path, model_dir: Path) -> Path:
    path = tmp_path / "deployment.yaml"
    path.write_text(SPEC_YAML.format(model=model_dir))
    return path


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.configure(parser)
    return parser.parse_args(argv)


def test_plan_from_a_spec_file_matches_the_builder(spec_file: Path, model_dir: Path) -> None:
    plan = cli.build_plan(parse(["--role", "prefill", "-f", str(spec_file), "--cpu", "--port", "8123"]), {})
    spec = make_spec(
        model={"name": "tiny", "source": {"uri": str(model_dir)}, "maxModelLen": 2048},
        kvTransfer={"bufferDevice": "cpu", "sideChannelPort": 5611},
    )
    from splitserve.api.spec import Role

    expected = build_engine_launch(spec, Role.PREFILL, port=8123, cpu=True)
    assert plan.vllm_args == expected.args
    assert plan.argv[1:3] == ["-m", VLLM_SERVER_MODULE]
    assert plan.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5611"
    assert plan.env["OMP_NUM_THREADS"] == "1"
    assert plan.port == 8123
    assert plan.side_channel_port() == 5611


def test_a_bare_spec_document_and_environment_override(tmp_path: Path, model_dir: Path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text(f"model: {{name: m, source: {{uri: {model_dir}}}}}\n")
    plan = cli.build_plan(parse(["--role", "decode", "-f", str(path)]), {"VLLM_NIXL_SIDE_CHANNEL_PORT": "6001"})
    assert plan.side_channel_port() == 6001
    assert "OMP_NUM_THREADS" not in plan.env


def test_plan_from_rendered_args_with_overrides(model_dir: Path) -> None:
    argv = ["--role", "decode", "--cpu", "--port", "9001", "--model", str(model_dir), "--kv-cache-bytes", "1G"]
    plan = cli.build_plan(parse([*argv, "--", "--model", "/models/x", "--port", "8000", "--seed", "3"]), {})
    assert option_value(plan.vllm_args, "--port") == "9001"
    assert option_value(plan.vllm_args, "--model") == str(model_dir)
    assert option_value(plan.vllm_args, "--kv-cache-memory-bytes") == "1G"
    assert option_value(plan.vllm_args, "--seed") == "3"
    assert "--enforce-eager" in plan.vllm_args


def test_both_or_neither_sources_is_an_error(spec_file: Path) -> None:
    with pytest.raises(LaunchError, match="not both"):
        cli.build_plan(parse(["--role", "decode", "-f", str(spec_file), "--", "--model", "m"]), {})
    with pytest.raises(LaunchError, match="nothing to run"):
        cli.build_plan(parse(["--role", "decode"]), {})


def test_dry_run_prints_environment_and_command(spec_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["worker", "--role", "decode", "-f", str(spec_file), "--cpu", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT=5611" in lines
    command = shlex.split(lines[-1])
    assert command[1:3] == ["-m", VLLM_SERVER_MODULE]
    assert '"kv_role":"kv_consumer"' in option_value(command, "--kv-transfer-config")  # type: ignore[operator]


@pytest.mark.parametrize(
    ("contents", "message"),
    [
        ("kind: Other\n", "no InferenceDeployment"),
        ("a: [\n", "not valid YAML"),
        (
            "kind: InferenceDeployment\nspec:\n  model: {name: m, source: {uri: /m}}\n  kvTransfer: {connector: Foo}\n",
            "kvTransfer.connector",
        ),
        (
            "kind: InferenceDeployment\nspec:\n  model: {name: m, source: {uri: /m}}\n"
            "  engine: {speculativeDecoding: {method: draft}}\n",
            "draftModel",
        ),
    ],
)
def test_bad_spec_files_give_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], contents: str, message: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(contents)
    assert main(["worker", "--role", "decode", "-f", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("splitserve worker: error: ")
    assert message in err


def test_missing_file_and_missing_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["worker", "--role", "decode", "-f", str(tmp_path / "none.yaml")]) == 1
    assert "cannot read" in capsys.readouterr().err
    assert main(["worker", "--role", "decode", "--", "--model", str(tmp_path / "absent")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    # Depending on the machine, vLLM itself may be what is missing; both are one clear line.
    assert "does not exist" in err or "vLLM is not installed" in err


def test_kv_events_port_moves_the_publisher_of_a_precise_prefix_pool(tmp_path: Path, model_dir: Path) -> None:
    spec_file = tmp_path / "precise.yaml"
    spec_file.write_text(SPEC_YAML.format(model=model_dir) + "  router: {routingPolicy: {prefill: precise-prefix}}\n")
    plan = cli.build_plan(parse(["--role", "prefill", "-f", str(spec_file), "--cpu", "--kv-events-port", "23999"]), {})
    assert '"endpoint":"tcp://*:23999"' in (option_value(plan.vllm_args, "--kv-events-config") or "")
    assert option_value(plan.vllm_args, "--prefix-caching-hash-algo") == "sha256_cbor"
    decode = cli.build_plan(parse(["--role", "decode", "-f", str(spec_file), "--kv-events-port", "23999"]), {})
    assert option_value(decode.vllm_args, "--kv-events-config") is None, "decode is routed least-loaded"


def test_kv_events_port_needs_a_spec_file() -> None:
    with pytest.raises(LaunchError, match=r"--kv-events-port needs -f SPEC\.yaml"):
        cli.build_plan(parse(["--role", "decode", "--kv-events-port", "23999", "--", "--model", "/m"]), {})
