"""Static checks of deploy/images (no Docker engine runs on the project's machines).

The Dockerfiles are parsed instruction by instruction; the slow test builds the package wheel from
exactly the files the .dockerignore allow-list sends to Docker, as the image's first stage does.
"""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from dockerfile import instructions
from pkg_sources import CHART_DIR, REPO_ROOT
from test_pkg_install_script import tool

IMAGES_DIR = REPO_ROOT / "deploy" / "images"
DOCKERFILES = {"operator": IMAGES_DIR / "Dockerfile.operator", "worker": IMAGES_DIR / "Dockerfile.worker"}


def resolved_args(dockerfile: Path) -> dict[str, str]:
    return {
        name: value
        for keyword, rest in instructions(dockerfile)
        if keyword == "ARG" and "=" in rest
        for name, value in [rest.split("=", 1)]
    }


def final_stage(dockerfile: Path) -> list[tuple[str, str]]:
    steps = instructions(dockerfile)
    last_from = max(index for index, (keyword, _) in enumerate(steps) if keyword == "FROM")
    return steps[last_from:]


def base_image(dockerfile: Path) -> str:
    _keyword, rest = final_stage(dockerfile)[0]
    image = rest.split()[0]
    for name, value in resolved_args(dockerfile).items():
        image = image.replace("${" + name + "}", value)
    return image


def test_operator_image_is_python_slim_with_splitserve_entrypoint() -> None:
    assert base_image(DOCKERFILES["operator"]) == "python:3.11-slim"
    stage = dict(final_stage(DOCKERFILES["operator"]))
    assert stage["ENTRYPOINT"] == '["splitserve"]'


def test_worker_image_is_vllms_serving_image_with_worker_entrypoint() -> None:
    assert base_image(DOCKERFILES["worker"]) == "vllm/vllm-openai:v0.32.0"
    stage = dict(final_stage(DOCKERFILES["worker"]))
    assert stage["ENTRYPOINT"] == '["splitserve", "worker"]'


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_images_run_as_the_non_root_user_the_chart_expects(image: str) -> None:
    stage = final_stage(DOCKERFILES[image])
    users = [rest for keyword, rest in stage if keyword == "USER"]
    assert users, "final stage must switch to a non-root user"
    uid, _, gid = users[-1].partition(":")
    values: dict[str, Any] = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    assert int(uid) == values["podSecurityContext"]["runAsUser"] != 0
    assert int(gid) == values["podSecurityContext"]["runAsGroup"]
    # The router pods the operator creates run the operator image as its own user too.
    if image == "operator":
        from splitserve.builders.router import IMAGE_USER_ID

        assert int(uid) == int(gid) == IMAGE_USER_ID
    # The user exists with the same ids (runAsNonRoot needs a numeric USER; tools need /etc/passwd).
    created = " ".join(rest for keyword, rest in stage if keyword == "RUN")
    assert f"--uid {uid}" in created and f"--gid {gid}" in created
    # Anything after USER runs unprivileged; package installation must come before it.
    user_index = max(i for i, (keyword, _) in enumerate(stage) if keyword == "USER")
    assert not [rest for keyword, rest in stage[user_index:] if keyword == "RUN"]


def dockerignore_allows(dockerfile: Path, relative: str) -> bool:
    """Docker's rule: the last matching pattern wins; `!` re-includes."""
    allowed = True
    for raw in Path(f"{dockerfile}.dockerignore").read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        matched = fnmatch.fnmatch(relative, pattern) or relative.startswith(pattern + "/")
        if pattern.startswith("**/"):
            matched = matched or fnmatch.fnmatch(Path(relative).name, pattern[3:])
        if matched:
            allowed = negate
    return allowed


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_every_copied_path_exists_and_is_sent_to_docker(image: str) -> None:
    dockerfile = DOCKERFILES[image]
    copies = [rest for keyword, rest in instructions(dockerfile) if keyword == "COPY" and "--from" not in rest]
    assert copies
    for arguments in copies:
        *sources, _destination = arguments.split()
        for source in sources:
            if "*" in source:  # optional files such as README.md*
                continue
            assert (REPO_ROOT / source).exists(), source
            assert dockerignore_allows(dockerfile, source), f"{source} is excluded by the .dockerignore"
    assert not dockerignore_allows(dockerfile, "tests/packaging/test_pkg_images.py")
    assert not dockerignore_allows(dockerfile, ".venv/bin/python")
    assert not dockerignore_allows(dockerfile, "workers/router/__pycache__/app.cpython-311.pyc")


def test_makefile_builds_both_images_with_the_chart_defaults() -> None:
    makefile = (IMAGES_DIR / "Makefile").read_text()
    values: dict[str, Any] = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    assert f"REGISTRY ?= {values['image']['repository'].rsplit('/', 1)[0]}" in makefile
    assert f"VERSION ?= {values['image']['tag']}" in makefile
    assert "$(REGISTRY)/splitserve:$(VERSION)" in makefile
    assert f"$(REGISTRY)/{values['workerImage']['repository'].rsplit('/', 1)[1]}:$(VERSION)" in makefile
    make = shutil.which("make")
    if make is None:
        pytest.skip("make not installed: Makefile not dry-run")
    dry_run = subprocess.run(
        [make, "-n", "-C", str(IMAGES_DIR), "images"], capture_output=True, text=True, check=True, timeout=30
    )
    assert re.search(r"docker build -f \S+/Dockerfile.operator -t ghcr.io/splitserve/splitserve:0.1.0 ", dry_run.stdout)
    assert re.search(r"docker build -f \S+/Dockerfile.worker .*-t ghcr.io/splitserve/worker:0.1.0 ", dry_run.stdout)


@pytest.mark.slow
def test_package_builds_from_the_docker_context(tmp_path: Path) -> None:
    context = tmp_path / "context"
    for top in ("pyproject.toml", "README.md", "operator", "workers"):
        source = REPO_ROOT / top
        if not source.exists():
            continue
        assert dockerignore_allows(DOCKERFILES["operator"], top)
        if source.is_dir():
            shutil.copytree(source, context / top, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            context.mkdir(exist_ok=True)
            shutil.copy2(source, context / top)
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "out"),
            ".",
        ],
        cwd=context,
        capture_output=True,
        text=True,
        check=False,
        timeout=240,
    )
    assert build.returncode == 0, build.stderr
    [wheel] = list((tmp_path / "out").glob("splitserve-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "splitserve/cli.py" in names
    for package in (
        "splitserve/router/__init__.py",
        "splitserve/engine/__init__.py",
        "splitserve/controller/__init__.py",
    ):
        assert package in names
    entry_points = next(name for name in names if name.endswith("entry_points.txt"))
    assert "splitserve = splitserve.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_hadolint_is_clean(image: str) -> None:
    """hadolint's default threshold fails on every finding, info and style included."""
    result = subprocess.run(
        [tool("hadolint"), "--no-color", str(DOCKERFILES[image])],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_operator_image_installs_the_version_pyproject_declares() -> None:
    """The image pins the package it installs (hadolint DL3013); that pin must follow pyproject.toml."""
    import tomllib

    version = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert resolved_args(DOCKERFILES["operator"])["SPLITSERVE_VERSION"] == version
    installs = " ".join(rest for keyword, rest in final_stage(DOCKERFILES["operator"]) if keyword == "RUN")
    assert '"splitserve[fast]==${SPLITSERVE_VERSION}"' in installs
