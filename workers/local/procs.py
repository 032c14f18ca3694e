"""What is still running: process-group and process-tree checks through /proc (Linux).

Zombies count as gone: a process that exited but was not reaped yet holds no port and no memory,
and orphans are reaped by init, not by us.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

PROC = Path("/proc")


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (which may contain spaces)."""
    try:
        raw = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return raw[raw.rfind(")") + 2 :].split()


def is_alive(pid: int) -> bool:
    fields = _stat_fields(pid)
    if fields is None:
        return False
    return fields[0] not in ("Z", "X")


def _all_pids() -> list[int]:
    return [int(entry.name) for entry in PROC.iterdir() if entry.name.isdigit()]


def group_members(pgid: int) -> list[int]:
    """Live processes of a process group (one started with its own session has pgid == its pid)."""
    if not PROC.is_dir():  # not Linux: the kernel's answer is all there is
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    members = []
    for pid in _all_pids():
        fields = _stat_fields(pid)
        if fields is not None and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            members.append(pid)
    return members


def descendants(root: int) -> set[int]:
    """Live processes below root in the parent tree (not root itself)."""
    children: dict[int, list[int]] = {}
    for pid in _all_pids():
        fields = _stat_fields(pid)
        if fields is not None and fields[0] not in ("Z", "X"):
            children.setdefault(int(fields[1]), []).append(pid)
    found: set[int] = set()
    pending = [root]
    while pending:
        for child in children.get(pending.pop(), []):
            if child not in found:
                found.add(child)
                pending.append(child)
    return found


def cpu_seconds(pids: Iterable[int]) -> float:
    """User plus system CPU time the processes have used so far, in seconds (those gone count 0)."""
    ticks = 0
    for pid in pids:
        fields = _stat_fields(pid)
        if fields is not None:
            # After the command name: state is field 0, utime and stime fields 11 and 12.
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def busy_ticks(cores: Iterable[int] | None = None) -> tuple[int, int]:
    """(busy, total) CPU ticks since boot of ``cores`` (None: the whole machine), from /proc/stat.
    Idle and iowait are the idle part; guest time is already inside user and nice, so not added again."""
    wanted = None if cores is None else {f"cpu{core}" for core in cores}
    busy = total = 0
    for line in (PROC / "stat").read_text().splitlines():
        name, *fields = line.split()
        if name == "cpu" if wanted is None else name in wanted:
            values = [int(v) for v in fields[:8]]
            total += sum(values)
            busy += sum(values) - values[3] - values[4]
    return busy, total


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds so far of root and every live process below it (all their threads): a server that
    forks workers, or a process that spawns an engine, counted whole."""
    return cpu_seconds([root, *descendants(root)])


def rss_bytes(pid: int) -> int:
    """Resident memory of one process (0 when it is gone or /proc is missing)."""
    try:
        status = (PROC / str(pid) / "status").read_text()
    except OSError:
        return 0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def process_tree(pid: int) -> set[int]:
    """A process, its descendants and its group, whatever groups the descendants moved to.

    `splitserve worker` runs vLLM in a process group of its own, and vLLM's engine core is a child
    of that: stopping a worker means waiting for all of them, not just the worker's group.
    """
    tree = descendants(pid) | set(group_members(pid))
    if is_alive(pid):
        tree.add(pid)
    return tree


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of a process and everything below it (a worker, its vLLM and engine core)."""
    return sum(rss_bytes(member) for member in process_tree(pid))
