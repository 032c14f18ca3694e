"""`splitserve up` keeps the logs of its last runs and deletes older run directories."""

from __future__ import annotations

import os
from pathlib import Path

from splitserve.local.cli import KEPT_RUN_DIRS, _run_dir, prune_run_dirs


def make_runs(root: Path, count: int) -> list[Path]:
    runs = []
    for index in range(count):
        run = root / f"demo-{index:03d}"
        run.mkdir(parents=True)
        (run / "router.log").write_text("log\n")
        os.utime(run, (1_000_000 + index, 1_000_000 + index))  # oldest first
        runs.append(run)
    return runs


def test_prune_keeps_the_newest(tmp_path: Path) -> None:
    runs = make_runs(tmp_path, 5)
    (tmp_path / "stray-file").write_text("not a run")
    removed = prune_run_dirs(tmp_path, keep=2)
    assert removed == runs[:3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo-003", "demo-004", "stray-file"]


def test_default_run_dir_prunes_and_requested_dir_does_not(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    make_runs(root, KEPT_RUN_DIRS + 3)
    new = _run_dir(None, "tiny", runs_root=root)
    assert new.is_dir() and new.parent == root.resolve()
    assert len([p for p in root.iterdir() if p.is_dir()]) == KEPT_RUN_DIRS

    elsewhere = tmp_path / "mine"
    make_runs(elsewhere, 3)
    chosen = _run_dir(elsewhere / "demo-000", "tiny", runs_root=root)
    assert chosen == (elsewhere / "demo-000").resolve()
    assert len(list(elsewhere.iterdir())) == 3  # a directory the user chose is never pruned around


def test_missing_root_is_fine(tmp_path: Path) -> None:
    assert prune_run_dirs(tmp_path / "absent", keep=1) == []
