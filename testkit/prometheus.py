"""A real Prometheus server for tests and benchmarks: the Debian `prometheus` binary, started on 127.0.0.1.

    server = PrometheusServer(tmp_path, targets=[ScrapeTarget("127.0.0.1:8101", {"role": "decode"})])
    await server.start()          # writes prometheus.yml, launches, waits for /-/ready
    await server.wait_for("sum(up)", lambda v: v == 1)
    server.kill()                 # SIGKILL: the API goes away at once
    await server.start()          # same port, same data dir
    server.stop()

`StaticExporter` serves fixed /metrics text (a stand-in for any exporter). Scrape and rule
evaluation every second, a data dir under the given folder, no systemd. Tests that
need it skip when the binary is absent (`requires_prometheus`). Scrape targets that live in the
test's own event loop need the async waits (a blocking wait would stop them answering scrapes).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml
from aiohttp import web

from splitserve.local.ports import free_port

PROMETHEUS_BINARY = os.environ.get("SPLITSERVE_PROMETHEUS_BINARY", "prometheus")
requires_prometheus = pytest.mark.skipif(
    shutil.which(PROMETHEUS_BINARY) is None, reason="needs the prometheus binary (apt-get install prometheus)"
)


@dataclass(frozen=True)
class ScrapeTarget:
    """One static scrape target with the labels the PodMonitor relabelling would have added."""

    address: str
    labels: dict[str, str] = field(default_factory=dict)
    metrics_path: str = "/metrics"


class PrometheusError(RuntimeError):
    pass


class PrometheusServer:
    def __init__(
        self,
        workdir: Path,
        targets: Sequence[ScrapeTarget] = (),
        *,
        port: int | None = None,
        scrape_interval: str = "1s",
        extra_args: Sequence[str] = (),
    ) -> None:
        self.workdir = Path(workdir)
        self.targets = list(targets)
        self.port = port or free_port()
        self.scrape_interval = scrape_interval
        self.extra_args = list(extra_args)
        self.process: subprocess.Popen[bytes] | None = None
        self.config_path = self.workdir / "prometheus.yml"
        self.data_dir = self.workdir / "data"
        self.log_path = self.workdir / "prometheus.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # --- configuration -------------------------------------------------------------------

    def config(self) -> dict[str, object]:
        # One job per (path, labels) pair: static_configs group targets that share labels.
        jobs: dict[str, list[object]] = {}
        for target in self.targets:
            jobs.setdefault(target.metrics_path, []).append({"targets": [target.address], "labels": target.labels})
        return {
            "global": {"scrape_interval": self.scrape_interval, "evaluation_interval": self.scrape_interval},
            "scrape_configs": [
                {
                    "job_name": f"job{index}",
                    "metrics_path": path,
                    "scrape_interval": self.scrape_interval,
                    "scrape_timeout": self.scrape_interval,
                    "static_configs": groups,
                }
                for index, (path, groups) in enumerate(sorted(jobs.items()))
            ],
        }

    def write_config(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(self.config(), sort_keys=False))

    # --- lifecycle -----------------------------------------------------------------------

    def launch(self) -> None:
        """Write the config and start the process (does not wait for it to be ready)."""
        if self.running:
            raise PrometheusError("prometheus is already running")
        self.write_config()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        command = [
            PROMETHEUS_BINARY,
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={self.data_dir}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--web.enable-lifecycle",
            "--storage.tsdb.retention.time=1h",
            *self.extra_args,
        ]
        log = self.log_path.open("ab")
        try:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def _check_alive(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise PrometheusError(f"prometheus exited with {self.process.returncode}:\n{self.log_tail()}")

    async def wait_ready(self, limit_s: float = 30.0) -> None:
        deadline = time.monotonic() + limit_s
        async with httpx.AsyncClient(timeout=1.0) as client:
            while time.monotonic() < deadline:
                self._check_alive()
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{self.url}/-/ready")).status_code == 200:
                        return
                await asyncio.sleep(0.1)
        raise PrometheusError(f"prometheus not ready after {limit_s}s:\n{self.log_tail()}")

    def wait_ready_sync(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=1.0) as client:
            while time.monotonic() < deadline:
                self._check_alive()
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.url}/-/ready").status_code == 200:
                        return
                time.sleep(0.1)
        raise PrometheusError(f"prometheus not ready after {timeout}s:\n{self.log_tail()}")

    async def start(self, limit_s: float = 30.0) -> None:
        self.launch()
        await self.wait_ready(limit_s)

    def start_sync(self, timeout: float = 30.0) -> None:
        self.launch()
        self.wait_ready_sync(timeout)

    def kill(self) -> None:
        """SIGKILL, as a crashed or partitioned Prometheus looks to its clients."""
        self._signal(signal.SIGKILL)

    def stop(self, timeout: float = 10.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def _signal(self, sig: signal.Signals) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(10)

    async def reload(self) -> None:
        """Rewrite prometheus.yml (after changing `targets`) and tell the server to reread it."""
        self.write_config()
        async with httpx.AsyncClient(timeout=5.0) as client:
            response = await client.post(f"{self.url}/-/reload")
            response.raise_for_status()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    # --- queries -------------------------------------------------------------------------

    async def query(self, promql: str) -> float | None:
        """The sum of an instant query's samples, None when it has none (test helper, not the client under test)."""
        async with httpx.AsyncClient(timeout=5.0) as client:
            response = await client.get(f"{self.url}/api/v1/query", params={"query": promql})
        body = response.json()
        if body.get("status") != "success":
            raise PrometheusError(f"query {promql!r} failed: {body}")
        result = body["data"]["result"]
        if body["data"]["resultType"] == "scalar":
            result = [{"value": result}]
        values = [float(sample["value"][1]) for sample in result]
        values = [v for v in values if math.isfinite(v)]
        return sum(values) if values else None

    async def wait_for(
        self, promql: str, predicate: Callable[[float | None], bool] = lambda v: v is not None, limit_s: float = 20.0
    ) -> float | None:
        """Poll until `predicate(value)` holds; returns the value (for scrapes to land, rates to fill)."""
        deadline = time.monotonic() + limit_s
        value: float | None = None
        while time.monotonic() < deadline:
            self._check_alive()
            with contextlib.suppress(httpx.HTTPError):
                value = await self.query(promql)
                if predicate(value):
                    return value
            await asyncio.sleep(0.2)
        raise PrometheusError(f"{promql!r} never satisfied the condition in {limit_s}s (last value {value})")


class StaticExporter:
    """Serves whatever Prometheus text `body` holds at /metrics (change it between scrapes)."""

    def __init__(self, body: str = "") -> None:
        self.body = body
        self.port = free_port()
        self._runner: web.AppRunner | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.body, content_type="text/plain", charset="utf-8")

    async def start(self) -> None:
        app = web.Application()
        app.add_routes([web.get("/metrics", self._metrics)])
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
