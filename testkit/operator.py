"""The real kopf operator (`splitserve operator`) as a subprocess against the API emulator, and the
CRD install and polling it is driven with (tests/operator_e2e, tests/packaging, benchmarks)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from splitserve.api.crd import render_crd_yaml
from testkit.emulator.client import EmulatorClient
from testkit.emulator.fixtures import EmulatorProcess

NAMESPACE = "serving"


class OperatorProcess:
    def __init__(
        self,
        emulator: EmulatorProcess,
        workdir: Path,
        env: Mapping[str, str] | None = None,
        python: str = sys.executable,
        args: Sequence[str] = (),
    ) -> None:
        self.emulator = emulator
        # The interpreter whose `splitserve` runs: the test venv's, or a venv holding only the shipped wheel.
        self.python = python
        self.log_path = workdir / "operator.log"
        # A fast diagnosis timer by default, so status.diagnosis shows up within a test's patience.
        self.env = {"SPLITSERVE_DIAGNOSIS_INTERVAL_SECONDS": "3", **(env or {})}
        self.args = list(args)  # more `splitserve operator` flags (--metrics-port)
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                [self.python, "-m", "splitserve", "operator", "--standalone", "--namespace", NAMESPACE, *self.args],
                env={**self.emulator.env(), **self.env},
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextlib.contextmanager
def operator_on_emulator(
    workdir: Path,
    *,
    env: Mapping[str, str] | None = None,
    fake_controllers: bool = True,
    state_file: Path | None = None,
    log_tail: int = 4000,
) -> Iterator[tuple[EmulatorProcess, OperatorProcess]]:
    """An emulator with the CRD and NAMESPACE installed and the operator running against it, for a
    module's fixture. On the way out the operator stops, the emulator is killed, and the last
    `log_tail` characters of the operator's log go to stderr."""
    emulator = EmulatorProcess(workdir, state_file=state_file, fake_controllers=fake_controllers)
    emulator.start()
    with emulator.client() as client:
        install_crd(client)
    operator = OperatorProcess(emulator, workdir, env=env)
    operator.start()
    try:
        yield emulator, operator
    finally:
        operator.stop()
        emulator.kill()
        sys.stderr.write(operator.log()[-log_tail:])


async def eventually(check: Callable[[], Any], what: str, limit_s: float = 60.0, every_s: float = 0.5) -> Any:
    """Poll `check` until it returns something truthy (returned), or time out saying what was awaited."""
    deadline = time.monotonic() + limit_s
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        await asyncio.sleep(every_s)
    raise TimeoutError(f"timed out waiting for {what} (last: {last!r})")


WORKER_ROLES = ("prefill", "decode", "aggregated")


def worker_pools(
    client: EmulatorClient, name: str, role: str | None = None, namespace: str = NAMESPACE
) -> list[dict[str, Any]]:
    """The worker Deployments of InferenceDeployment `name` (of one role), every KV generation's:
    they are named `<name>-<role>-<generation>`, so tests find them by label, not by name."""
    roles = role or ",".join(WORKER_ROLES)
    selector = f"splitserve.io/deployment={name},splitserve.io/role in ({roles})"
    found: list[dict[str, Any]] = client.list("apps/v1", "deployments", namespace=namespace, label_selector=selector)
    return sorted(found, key=lambda d: str(d["metadata"]["name"]))


def worker_pool(client: EmulatorClient, name: str, role: str, namespace: str = NAMESPACE) -> dict[str, Any] | None:
    """The one worker Deployment of `role` (None while there is none); outside a rollout there is one."""
    found = worker_pools(client, name, role, namespace)
    assert len(found) <= 1, f"{len(found)} {role} Deployments: {[d['metadata']['name'] for d in found]}"
    return found[0] if found else None


def install_crd(client: EmulatorClient) -> None:
    client.apply(yaml.safe_load(render_crd_yaml()), field_manager="test", force=True)
    client.create_namespace(NAMESPACE)


def operator_requests(client: EmulatorClient) -> list[dict[str, Any]]:
    """What the operator (its own client or kopf's) asked the emulator so far, watches aside: a watch
    is one long request, not traffic."""
    return [
        record
        for record in client.requests_log()
        if str(record.get("user_agent", "")).startswith(("splitserve-operator", "kopf"))
        and record.get("verb") != "watch"
    ]


def reconciles_total(metrics_url: str, result: str | None = None) -> float:
    """splitserve_operator_reconciles_total from the operator's /metrics (`result`: one label value,
    None: every result); 0 while it does not answer yet."""
    try:
        text = httpx.get(metrics_url, timeout=5).text
    except httpx.HTTPError:
        return 0.0
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "splitserve_operator_reconciles_total"
        and (result is None or sample.labels.get("result") == result)
    )
