"""``splitserve router --workers N``: N router processes on one port, one per core.

The router is one asyncio loop per process, so one process uses one core. N processes bind the same
port with SO_REUSEPORT and the kernel spreads connections over them. They share nothing: each runs
its own discovery, health checks and KV-event subscriptions. That costs N subscriptions per worker,
and it keeps precise-prefix routing exact in every process, because each one reads the engines' own
events instead of remembering its own choices (the approximate prefix-aware policy loses exactly
that across processes). Metrics are summed over the processes through prometheus-client's
multiprocess mode. SIGTERM is forwarded to every process; each stops accepting and drains its own
requests, and this parent exits when the last one has.
"""

from __future__ import annotations

import argparse
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from multiprocessing.process import BaseProcess
from types import FrameType

from prometheus_client import multiprocess

from splitserve.router.config import RouterConfig

log = logging.getLogger("splitserve.router")

# A process that dies this soon after starting, this many times in a row, is not restarted again.
_CRASH_WINDOW_SECONDS = 5.0
_MAX_QUICK_CRASHES = 5


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as handle:
            quota, period = handle.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def _port_is_free(host: str, port: int) -> str | None:
    """Why the port cannot be served, or None. Probed without SO_REUSEPORT, so it also refuses a port
    another reuse-port router already holds (which would otherwise silently share its traffic)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            return f"cannot listen on {host}:{port}: {error.strerror}"
    return None


def _child(config: RouterConfig, log_level: str) -> None:
    import asyncio

    from splitserve.router.cli import loop_factory, serve

    logging.basicConfig(
        level=log_level.upper(),
        format=f"%(asctime)s %(levelname)s %(name)s[{os.getpid()}]: %(message)s",
        stream=sys.stderr,
    )
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(serve(config, reuse_port=True))


def run_processes(config: RouterConfig, args: argparse.Namespace) -> int:
    problem = _port_is_free(config.host, config.port)
    if problem:
        print(f"splitserve router: error: {problem}", file=sys.stderr)
        return 1
    own_dir = "PROMETHEUS_MULTIPROC_DIR" not in os.environ
    shared = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or tempfile.mkdtemp(prefix="splitserve-router-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = shared  # read by prometheus-client when each child imports it
    context = multiprocessing.get_context("spawn")  # no inherited event loop, sockets or threads
    stopping = False

    def start() -> BaseProcess:
        process = context.Process(target=_child, args=(config, args.log_level), daemon=False)
        process.start()
        return process

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        for process in children:
            if process.is_alive() and process.pid:
                os.kill(process.pid, signal.SIGTERM)

    children = [start() for _ in range(config.workers)]
    started = {id(p): time.monotonic() for p in children}
    quick_crashes = 0
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log.info("router: %d processes on %s:%d", config.workers, config.host, config.port)
    exit_code = 0
    try:
        while children:
            multiprocessing.connection.wait([p.sentinel for p in children], timeout=1.0)
            for process in [p for p in children if not p.is_alive()]:
                children.remove(process)
                if process.pid:
                    multiprocess.mark_process_dead(process.pid, shared)  # type: ignore[no-untyped-call]
                if stopping:
                    continue
                lived = time.monotonic() - started.pop(id(process), 0.0)
                quick_crashes = quick_crashes + 1 if lived < _CRASH_WINDOW_SECONDS else 0
                log.error("router process %s exited with %s after %.1fs", process.pid, process.exitcode, lived)
                if quick_crashes >= _MAX_QUICK_CRASHES:
                    log.error("router processes keep exiting at start: stopping")
                    exit_code = 1
                    on_signal(signal.SIGTERM, None)
                    continue
                replacement = start()
                started[id(replacement)] = time.monotonic()
                children.append(replacement)
    finally:
        if own_dir:
            shutil.rmtree(shared, ignore_errors=True)
    return exit_code
