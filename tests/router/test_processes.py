"""`splitserve router --workers N`: N processes on one port, metrics summed over them."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import sys
import time

import aiohttp
import pytest

from splitserve.sim import SimWorker
from testkit.router import sim_config


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as handle:
        return [int(p) for p in handle.read().split()]


def _listens(pid: int, port: int) -> bool:
    """Whether process `pid` holds a socket listening on 127.0.0.1:`port` (from /proc: no psutil needed)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    with open(f"/proc/{pid}/net/tcp") as handle:
        rows = [line.split() for line in handle.readlines()[1:]]
    # local_address is HEX_IP:HEX_PORT, st 0A is LISTEN, field 9 is the inode.
    return any(row[1].endswith(f":{port:04X}") and row[3] == "0A" and row[9] in inodes for row in rows)


def _counter_total(text: str, name: str) -> float:
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.mark.slow
async def test_processes_share_the_port_and_their_metrics_add_up() -> None:
    async with SimWorker(sim_config("aggregated")) as worker:
        port = _free_port()
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "splitserve.cli", "router", "--host", "127.0.0.1", "--port", str(port),
            "--decode", worker.url, "--workers", "2", "--log-level", "info",
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        assert process.stderr is not None
        try:
            deadline = time.monotonic() + 30
            while len(_children(process.pid)) < 2 or not await _ready(url):
                assert time.monotonic() < deadline, "router processes did not become ready"
                await asyncio.sleep(0.1)
            # Both processes listen before the test counts on them (the kernel spreads connections only
            # over sockets already listening; on a loaded machine the second child can be seconds late).
            # (Its children also include multiprocessing's resource tracker, which listens on nothing.)
            while sum(_listens(child, port) for child in _children(process.pid)) < 2:
                assert time.monotonic() < deadline, "a router process never listened on the port"
                await asyncio.sleep(0.1)
            requests = 40
            body = {"model": "sim-model", "prompt": "hello there", "max_tokens": 4}
            for _ in range(requests):  # a new connection each time, so the kernel spreads them
                status, text = await _fresh("POST", url + "/v1/completions", body)
                assert status == 200, text
            for _ in range(4):  # whichever process answers the scrape reports the sum over both
                _, text = await _fresh("GET", url + "/metrics")
                assert _counter_total(text, "splitserve_router_requests_total") == requests
                assert 'splitserve_router_workers{pool="decode",state="healthy"} 1.0' in text
            process.terminate()
            assert await asyncio.wait_for(process.wait(), 30) == 0
            log = (await process.stderr.read()).decode()
            served_by = set(re.findall(r"splitserve\.router\.requests\[(\d+)\]", log))
            assert len(served_by) == 2, f"requests were served by {served_by} only"
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()


async def _fresh(method: str, url: str, body: object = None) -> tuple[int, str]:
    """One request on its own connection (so SO_REUSEPORT may hand it to either process)."""
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session, session.request(method, url, json=body) as r:
        return r.status, await r.text()


async def _ready(url: str) -> bool:
    try:
        return (await _fresh("GET", url + "/ready"))[0] == 200
    except aiohttp.ClientConnectionError:
        return False


def test_a_port_in_use_is_one_line_and_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    from splitserve.router import cli

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        parser = __import__("argparse").ArgumentParser()
        cli.configure(parser)
        args = parser.parse_args(
            ["--host", "127.0.0.1", "--port", str(port), "--decode", "http://d:1", "--workers", "2"]
        )
        assert cli.run(args) == 1
    err = capsys.readouterr().err.strip()
    assert "cannot listen on" in err and "Traceback" not in err
