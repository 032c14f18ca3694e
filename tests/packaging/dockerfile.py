"""A Dockerfile read instruction by instruction, and its install steps replayed without a Docker engine.

No Docker engine runs on the project's machines, so the image recipes are checked by running what they
run: each stage's COPY sources go into a build context folder, and each RUN step goes through bash in a
fresh virtual environment standing in for the base image, with the stage's ENV and ARG values set and
the image's absolute paths (/wheels, /src) mapped onto temporary folders.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

# Commands a RUN step may start with that change the host rather than the image's Python environment;
# they are checked statically (test_pkg_images.py checks the user's ids) and never replayed.
HOST_ONLY_COMMANDS = ("groupadd", "useradd")
# Every other command must be one of these, so a new kind of step cannot slip past the replay untested.
REPLAYED_COMMANDS = ("pip", "python3", "python", "splitserve")


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs with line continuations joined and comments dropped."""
    logical: list[str] = []
    pending = ""
    for raw in dockerfile.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, f"{dockerfile.name} ends inside a continued line"
    result = []
    for line in logical:
        keyword, _, rest = line.partition(" ")
        result.append((keyword.upper(), rest.strip()))
    return result


def global_args(dockerfile: Path) -> dict[str, str]:
    """ARG defaults declared before the first FROM (Docker's global build arguments)."""
    found: dict[str, str] = {}
    for keyword, rest in instructions(dockerfile):
        if keyword == "FROM":
            break
        if keyword == "ARG" and "=" in rest:
            name, value = rest.split("=", 1)
            found[name] = value
    return found


@dataclass
class Stage:
    name: str
    base: str
    steps: list[tuple[str, str]] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        values: dict[str, str] = {}
        for keyword, rest in self.steps:
            if keyword == "ENV":
                for pair in shlex.split(rest):
                    name, _, value = pair.partition("=")
                    values[name] = value
        return values

    def run_steps(self) -> list[str]:
        return [rest for keyword, rest in self.steps if keyword == "RUN"]

    def copies(self) -> list[tuple[list[str], str]]:
        found = []
        for keyword, rest in self.steps:
            if keyword == "COPY" and "--from" not in rest:
                *sources, destination = rest.split()
                found.append((sources, destination))
        return found


def stages(dockerfile: Path) -> list[Stage]:
    result: list[Stage] = []
    for keyword, rest in instructions(dockerfile):
        if keyword == "FROM":
            parts = rest.split()
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else f"stage{len(result)}"
            result.append(Stage(name=name, base=parts[0]))
        elif result:
            result[-1].steps.append((keyword, rest))
    return result


def without_mounts(command: str) -> str:
    """A RUN step's command line without BuildKit's --mount options (the replay maps paths instead)."""
    return re.sub(r"^(--mount=\S+\s+)+", "", command)


def commands_of(run_step: str) -> list[str]:
    """The shell commands of one RUN step, split at `&&`."""
    return [part.strip() for part in without_mounts(run_step).split("&&")]


def program_of(command: str) -> str:
    """The program a shell command runs, past any leading VAR=value assignments."""
    words = shlex.split(command)
    return next(word for word in words if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", word))


@dataclass
class Replay:
    """Where one image build is replayed: the build context, the folders the image's paths map to."""

    repo_root: Path
    workdir: Path
    build_stages: list[Stage]
    build_args: dict[str, str]

    @classmethod
    def of(cls, dockerfile: Path, repo_root: Path, workdir: Path) -> Replay:
        """A replay of `dockerfile` with its first stage's build context copied in."""
        replay = cls(repo_root, workdir, stages(dockerfile), global_args(dockerfile))
        replay.copy_context(replay.build_stages[0])
        return replay

    @property
    def context(self) -> Path:
        return self.workdir / "src"

    @property
    def wheels(self) -> Path:
        return self.workdir / "wheels"

    def copy_context(self, stage: Stage) -> None:
        """What the stage's COPY instructions bring in (optional sources such as README.md* may be absent)."""
        for sources, destination in stage.copies():
            for source in sources:
                matches = sorted(self.repo_root.glob(source)) if "*" in source else [self.repo_root / source]
                for path in matches:
                    target = self.context / destination if destination != "./" else self.context / path.name
                    if destination.endswith("/") and destination != "./":
                        target = self.context / destination / path.name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    if path.is_dir():
                        shutil.copytree(path, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
                    else:
                        shutil.copy2(path, target)

    def map_paths(self, command: str) -> str:
        return command.replace("/wheels", str(self.wheels)).replace("/src", str(self.context))

    def run_stage(
        self,
        stage: Stage,
        venv: Path,
        *,
        hermetic: bool = False,
        timeout: float = 900,
    ) -> list[subprocess.CompletedProcess[str]]:
        """Run the stage's RUN steps with `venv`'s python, pip and splitserve first on PATH.

        hermetic: no pip configuration at all, as in a fresh image (for steps that must find everything
        in /wheels); otherwise this machine's pip configuration stands in for the builder's network.
        """
        env = {key: value for key, value in os.environ.items() if key not in {"PYTHONPATH", "VIRTUAL_ENV"}}
        env.update(self.build_args)
        env.update(stage.env())
        env["HOME"] = str(self.workdir / "home")
        env["XDG_CACHE_HOME"] = str(self.workdir / "cache")
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["VIRTUAL_ENV"] = str(venv)
        if hermetic:
            env["PIP_CONFIG_FILE"] = os.devnull
        (self.workdir / "home").mkdir(parents=True, exist_ok=True)
        self.context.mkdir(parents=True, exist_ok=True)
        results = []
        for step in stage.run_steps():
            commands = commands_of(step)
            if program_of(commands[0]) in HOST_ONLY_COMMANDS:
                continue
            for command in commands:
                program = program_of(command)
                assert program in REPLAYED_COMMANDS, f"RUN step with a command the replay does not know: {command}"
            result = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", self.map_paths(without_mounts(step))],
                cwd=self.context,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
            assert result.returncode == 0, (
                f"stage {stage.name}: `{without_mounts(step)}` failed ({result.returncode}):\n"
                f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
            )
            results.append(result)
        return results
