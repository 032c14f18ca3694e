"""`splitserve up --prometheus`: a Prometheus server scraping every process of the local stack.

The labels are the ones the operator's PodMonitors put on cluster series (`namespace`, `deployment`,
`role`, `generation`), so `splitserve diagnose -f FILE --prometheus URL` finds the local stack with
its default selectors, as it finds a cluster deployment. Targets live in a file_sd file that the
stack rewrites whenever its processes change (a rollout, a replica change); Prometheus rereads it
on its own, so nothing restarts.

Uses the `prometheus` binary on PATH (Debian: apt-get install prometheus); without it `up` says so
and serves without one.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from splitserve.local.plan import ProcessSpec
from splitserve.local.ports import LOOPBACK

BINARY = "prometheus"
DEFAULT_PORT = 9090
SCRAPE_INTERVAL = "2s"  # a 1-2 minute benchmark gives the diagnosis 30+ samples per series
RETENTION = "6h"  # a laptop session; the data folder lives in the run folder and goes with it
INSTALL_HINT = "apt-get install prometheus (Debian/Ubuntu), or put a prometheus binary on PATH"


def find_binary() -> str | None:
    return shutil.which(os.environ.get("SPLITSERVE_PROMETHEUS_BINARY", BINARY))


@dataclass(frozen=True)
class ScrapeGroup:
    """One file_sd entry: a process's address and its labels."""

    address: str
    labels: Mapping[str, str]

    def to_file_sd(self) -> dict[str, Any]:
        return {"targets": [self.address], "labels": dict(self.labels)}


def scrape_groups(deployment: str, namespace: str, processes: Iterable[ProcessSpec]) -> list[ScrapeGroup]:
    """What to scrape: every worker with its role and KV generation, and the router (role="router")."""
    groups = []
    for process in processes:
        labels = {"namespace": namespace, "deployment": deployment, "role": process.role or "router"}
        if process.generation:
            labels["generation"] = process.generation
        groups.append(ScrapeGroup(f"{LOOPBACK}:{process.port}", labels))
    return sorted(groups, key=lambda group: group.address)


def server_config(targets_file: Path) -> dict[str, Any]:
    return {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
        "scrape_configs": [
            {
                "job_name": "splitserve-local",
                "scrape_interval": SCRAPE_INTERVAL,
                "scrape_timeout": SCRAPE_INTERVAL,
                "metrics_path": "/metrics",
                "file_sd_configs": [{"files": [str(targets_file)], "refresh_interval": "5s"}],
            }
        ],
    }


class LocalPrometheus:
    """The server's files in RUN_DIR/prometheus, its process spec, and the targets file kept current."""

    def __init__(self, run_dir: Path, port: int, binary: str) -> None:
        self.folder = run_dir / "prometheus"
        self.port = port
        self.binary = binary
        self.config_path = self.folder / "prometheus.yml"
        self.targets_path = self.folder / "targets.json"
        self._written: list[dict[str, Any]] | None = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def process_spec(self) -> ProcessSpec:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(server_config(self.targets_path), sort_keys=False))
        if self._written is None:
            self.write_targets([])
        return ProcessSpec(
            name="prometheus",
            argv=(
                self.binary,
                f"--config.file={self.config_path}",
                f"--storage.tsdb.path={self.folder / 'data'}",
                f"--storage.tsdb.retention.time={RETENTION}",
                f"--web.listen-address={LOOPBACK}:{self.port}",
            ),
            port=self.port,
            ready_path="/-/ready",
        )

    def write_targets(self, groups: Iterable[ScrapeGroup]) -> bool:
        """Rewrite the targets file if they changed (atomically: Prometheus never reads half a file)."""
        entries = [group.to_file_sd() for group in groups]
        if entries == self._written:
            return False
        self.folder.mkdir(parents=True, exist_ok=True)
        partial = self.targets_path.with_suffix(".json.partial")
        partial.write_text(json.dumps(entries, indent=2) + "\n")
        os.replace(partial, self.targets_path)
        self._written = entries
        return True
