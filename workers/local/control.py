"""How `splitserve up --apply FILE` reaches a running stack: files in the stack's run directory.

While it serves, a stack keeps
- `RUN_DIR/control.json`: `{"pid", "deployment", "file", "endpoint", "run_dir", "requests"}`, and a copy of it
  in `~/.cache/splitserve/stacks/PID.json` so that `--apply` finds a stack by its deployment's name
  wherever its run directory is (`--run-dir` picks one explicitly);
- `RUN_DIR/apply/`: the request folder. `--apply` drops `ID.json` there (`{"file", "text"}`, written under
  another name and renamed, so the stack never reads half a request), then follows `ID.out` (the
  stack's progress lines for it) until `ID.result.json` (`{"ok", "message"}`) appears.

The stack looks at the folder every half second between rollouts, takes requests in the order they
were made (ID starts with the time in nanoseconds) and deletes each as it takes it. Plain files and
no socket: nothing to bind, nothing to clean up after a crash but two small files (a registry entry whose
pid is gone is ignored and removed), and the whole exchange can be read in the run directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from splitserve.local.endpoints import write_atomically
from splitserve.local.procs import is_alive

CONTROL_FILE = "control.json"
REQUESTS_DIR = "apply"


@dataclass(frozen=True)
class StackInfo:
    pid: int
    deployment: str
    file: str
    endpoint: str
    run_dir: Path

    @property
    def requests(self) -> Path:
        return self.run_dir / REQUESTS_DIR

    def document(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "deployment": self.deployment,
            "file": self.file,
            "endpoint": self.endpoint,
            "run_dir": str(self.run_dir),
            "requests": str(self.requests),
        }

    @classmethod
    def from_document(cls, document: dict[str, Any]) -> StackInfo:
        return cls(
            pid=int(document["pid"]),
            deployment=str(document["deployment"]),
            file=str(document["file"]),
            endpoint=str(document["endpoint"]),
            run_dir=Path(str(document["run_dir"])),
        )

    @property
    def alive(self) -> bool:
        return is_alive(self.pid)


def _read_info(path: Path) -> StackInfo | None:
    try:
        return StackInfo.from_document(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError):
        return None


# ------------------------------------------------------------------------------------- the stack's side


@dataclass
class ApplyRequest:
    """One `--apply` handed to the stack: the text to apply and where the answer goes."""

    id: str
    file: str
    text: str
    folder: Path

    def say(self, line: str) -> None:
        with contextlib.suppress(OSError), (self.folder / f"{self.id}.out").open("a", encoding="utf-8") as out:
            out.write(line + "\n")

    def finish(self, ok: bool, message: str) -> None:
        with contextlib.suppress(OSError):
            write_atomically(self.folder / f"{self.id}.result.json", json.dumps({"ok": ok, "message": message}) + "\n")


class ControlChannel:
    """The stack's end: publishes control.json (and the registry entry) and takes requests."""

    def __init__(self, info: StackInfo, registry: Path | None) -> None:
        self.info = info
        self._registry_entry = registry / f"{info.pid}.json" if registry is not None else None

    def open(self) -> None:
        self.info.requests.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.info.document(), indent=2) + "\n"
        write_atomically(self.info.run_dir / CONTROL_FILE, text)
        if self._registry_entry is not None:
            with contextlib.suppress(OSError):
                self._registry_entry.parent.mkdir(parents=True, exist_ok=True)
                write_atomically(self._registry_entry, text)

    def close(self) -> None:
        for path in (self.info.run_dir / CONTROL_FILE, self._registry_entry):
            if path is not None:
                with contextlib.suppress(OSError):
                    path.unlink()
        # Requests nobody will take now: answer them, so no `--apply` waits for nothing.
        for request in self.pending():
            request.finish(False, "the stack stopped before applying this file")

    def pending(self) -> list[ApplyRequest]:
        """Requests waiting, oldest first; each is taken (its file removed) as it is returned."""
        requests = []
        try:
            names = sorted(path.name for path in self.info.requests.glob("*.json") if ".result" not in path.name)
        except OSError:
            return []
        for name in names:
            path = self.info.requests / name
            try:
                document = json.loads(path.read_text(encoding="utf-8"))
                path.unlink()
            except (OSError, ValueError):
                continue
            request_id = name.removesuffix(".json")
            folder = self.info.requests
            if not isinstance(document, dict):
                ApplyRequest(request_id, "?", "", folder).finish(False, "malformed request")
                continue
            requests.append(
                ApplyRequest(request_id, str(document.get("file", "?")), str(document.get("text", "")), folder)
            )
        return requests


# ------------------------------------------------------------------------------------ `--apply`'s side


class NoStack(Exception):
    """No running stack to apply to (or more than one to choose from)."""


def find_stack(deployment: str, run_dir: Path | None, registry: Path) -> StackInfo:
    """The running stack `--apply` talks to: the one in `run_dir`, or the only one serving `deployment`."""
    if run_dir is not None:
        info = _read_info(run_dir / CONTROL_FILE)
        if info is None or not info.alive:
            raise NoStack(f"no running `splitserve up` in {run_dir} (no {CONTROL_FILE} of a live stack there)")
        return info
    stacks = []
    for entry in sorted(registry.glob("*.json")) if registry.is_dir() else []:
        info = _read_info(entry)
        if info is None or not info.alive:
            with contextlib.suppress(OSError):
                entry.unlink()  # left by a stack that was killed outright
            continue
        if info.deployment == deployment:
            stacks.append(info)
    if not stacks:
        raise NoStack(
            f"no running `splitserve up` serves deployment {deployment!r}; start one with "
            "`splitserve up -f FILE`, or point at its run directory with --run-dir"
        )
    if len(stacks) > 1:
        where = ", ".join(f"{info.run_dir} (pid {info.pid})" for info in stacks)
        raise NoStack(f"{len(stacks)} stacks serve deployment {deployment!r}: {where}; choose one with --run-dir")
    return stacks[0]


def submit(stack: StackInfo, file: Path, text: str) -> str:
    """Hand a file's text to the stack; returns the request's id."""
    request_id = f"{time.time_ns():020d}-{os.getpid()}"
    document = json.dumps({"file": str(file), "text": text})
    write_atomically(stack.requests / f"{request_id}.json", document)
    return request_id


@dataclass(frozen=True)
class ApplyResult:
    ok: bool
    message: str


def follow(
    stack: StackInfo,
    request_id: str,
    print_line: Callable[[str], None],
    *,
    poll_seconds: float = 0.1,
    on_waiting: Callable[[], None] | None = None,
    waiting_after: float = 2.0,
) -> ApplyResult:
    """Print the stack's lines for a request as they come, until its result (or the stack's end)."""
    out_path = stack.requests / f"{request_id}.out"
    result_path = stack.requests / f"{request_id}.result.json"
    request_path = stack.requests / f"{request_id}.json"
    started = time.monotonic()
    waiting_noted = False
    reader = _LineReader(out_path)
    read_lines = reader.read
    try:
        while True:
            for line in read_lines():
                print_line(line)
            if result_path.exists():
                for line in read_lines():
                    print_line(line)
                document = json.loads(result_path.read_text(encoding="utf-8"))
                _clean_up(out_path, result_path)
                return ApplyResult(bool(document.get("ok")), str(document.get("message", "")))
            if not stack.alive:
                return ApplyResult(False, f"the stack (pid {stack.pid}) stopped before answering")
            if not waiting_noted and request_path.exists() and time.monotonic() - started > waiting_after:
                waiting_noted = True
                if on_waiting is not None:
                    on_waiting()
            time.sleep(poll_seconds)
    finally:
        reader.close()


class _LineReader:
    """The complete lines appended to a file since the last call (the file may not exist yet)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._handle: TextIO | None = None
        self._pending = ""

    def read(self) -> list[str]:
        if self._handle is None:
            try:
                self._handle = self._path.open("r", encoding="utf-8", errors="replace")
            except OSError:
                return []
        self._pending += self._handle.read()
        *complete, self._pending = self._pending.split("\n")
        return complete

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()


def _clean_up(*paths: Path) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            path.unlink()


# ------------------------------------------------------------------------------------ the file's edits


class FileWatch:
    """Notices saves of the stack's own deployment file (looked at every half second by the stack).

    A save (a new modification time, size or inode: editors that write a new file and rename it
    over the old one included) is taken once the file has stayed the same for one look, as an editor
    may write it in several steps. Saving the file applies it, even unchanged: after an `--apply` of
    another file, saving this one again goes back to it.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen = self._stat()
        self._settling: tuple[int, int, int] | None = None

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            stat = self.path.stat()
        except OSError:
            return None
        return stat.st_mtime_ns, stat.st_size, stat.st_ino

    def poll(self) -> tuple[int, str] | None:
        """(modification time in ns, text) of a settled save, else None."""
        stat = self._stat()
        if stat is None or stat == self._seen:
            self._settling = None
            return None
        if stat != self._settling:
            self._settling = stat
            return None
        self._seen, self._settling = stat, None
        try:
            return stat[0], self.path.read_text(encoding="utf-8")
        except OSError:
            return None
