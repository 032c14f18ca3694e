"""A rollout from KV generation A to B under continuous load, with real processes: four
`splitserve sim-worker` (a prefill and a decode per generation) and one `splitserve router
--discovery file`, the test playing the rollout's writer of the endpoints file.

Every step waits on state the router itself reports (GET /splitserve/workers) or on answers
received, never on a sleep: B joins; once B has answered, A turns terminating; once the router
shows A's in-flight count at 0 A leaves the file; once the router lists A no more, A's processes
stop. No request may fail, none may pair KV across generations, and each answer's text must be
the one its generation's engines produce.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import json
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.sim import generate_text, tokenize

pytestmark = pytest.mark.slow

A, B = "aaaaaaaaaa", "bbbbbbbbbb"
HEADER = "X-Splitserve-Generation"
MAX_TOKENS = 6
# The router splits prompts of at least this many (approximate, 4-byte) tokens; the load's are longer.
THRESHOLD_TOKENS = 16
FILLER = "please summarise the following notes about disaggregated serving and its rollout " * 2


@dataclass
class Proc:
    """A child process started by the test, its stderr in a file (read when a test fails)."""

    process: asyncio.subprocess.Process
    log: Path
    url: str = ""

    async def stop(self) -> None:
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), 20)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()

    def tail(self) -> str:
        return self.log.read_text()[-2000:] if self.log.exists() else ""


@dataclass
class Generation:
    name: str
    prefill: Proc
    decode: Proc

    @property
    def urls(self) -> set[str]:
        return {self.prefill.url, self.decode.url}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _spawn(tmp: Path, name: str, *argv: str) -> Proc:
    log = tmp / f"{name}.log"
    with log.open("wb") as stderr:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "splitserve.cli", *argv,
            stdout=asyncio.subprocess.PIPE, stderr=stderr, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
    return Proc(process, log)


async def _sim(tmp: Path, role: str, generation: str, *extra: str) -> Proc:
    proc = await _spawn(
        tmp, f"{role}-{generation}", "sim-worker", "--role", role, "--port", "0", "--generation", generation,
        "--time-scale", "0.01", "--model", "sim-model", *extra,
    )  # fmt: skip
    assert proc.process.stdout is not None
    line = await asyncio.wait_for(proc.process.stdout.readline(), 60)
    assert line, f"sim {role} {generation} did not start: {proc.tail()}"
    ready = json.loads(line)
    assert ready["generation"] == generation
    proc.url = ready["url"]
    return proc


async def _generation(tmp: Path, name: str) -> Generation:
    prefill, decode = await asyncio.gather(_sim(tmp, "prefill", name), _sim(tmp, "decode", name))
    return Generation(name, prefill, decode)


def _write_endpoints(path: Path, pools: dict[str, list[tuple[str, str, str]]]) -> None:
    """Replace the endpoints file atomically, as its writer must."""
    document = {"pools": {p: [{"url": u, "generation": g, "state": s} for u, g, s in e] for p, e in pools.items()}}
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(document))
    os.replace(temporary, path)


def _entries(*generations: tuple[Generation, str]) -> dict[str, list[tuple[str, str, str]]]:
    return {
        "prefill": [(g.prefill.url, g.name, state) for g, state in generations],
        "decode": [(g.decode.url, g.name, state) for g, state in generations],
    }


@contextlib.asynccontextmanager
async def _router(tmp: Path, endpoints: Path, *extra: str) -> AsyncIterator[tuple[Proc, httpx.AsyncClient]]:
    port = _free_port()
    proc = await _spawn(
        tmp, "router", "router", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
        "--discovery", "file", "--endpoints-file", str(endpoints), "--endpoints-poll-interval", "0.05",
        "--model", "sim-model", "--disagg-threshold-tokens", str(THRESHOLD_TOKENS), "--log-level", "warning", *extra,
    )  # fmt: skip
    proc.url = f"http://127.0.0.1:{port}"
    limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
    try:
        async with httpx.AsyncClient(base_url=proc.url, timeout=60, limits=limits) as client:
            deadline = time.monotonic() + 60
            while True:
                with contextlib.suppress(httpx.TransportError):
                    if (await client.get("/ready")).status_code == 200:
                        break
                assert proc.process.returncode is None, f"router exited: {proc.tail()}"
                assert time.monotonic() < deadline, f"router not ready: {proc.tail()}"
                await asyncio.sleep(0.05)
            yield proc, client
    finally:
        await proc.stop()


async def _until(check: Callable[[], Awaitable[bool]], what: str, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


Workers = list[dict[str, Any]]


def _router_shows(client: httpx.AsyncClient, predicate: Callable[[Workers], bool]) -> Callable[[], Awaitable[bool]]:
    """A check of the router's own view of its workers (both pools, departing ones included)."""

    async def check() -> bool:
        view = (await client.get("/splitserve/workers")).json()
        return predicate(view["prefill"] + view["decode"])

    return check


def _healthy(urls: set[str]) -> Callable[[Workers], bool]:
    return lambda workers: {w["url"] for w in workers if w["state"] == "healthy"} >= urls


def _terminating(urls: set[str]) -> Callable[[Workers], bool]:
    return lambda workers: all(w["state"] == "terminating" for w in workers if w["url"] in urls)


def _idle(urls: set[str]) -> Callable[[Workers], bool]:
    return lambda workers: all(w["inflight"] == 0 for w in workers if w["url"] in urls)


def _gone(urls: set[str]) -> Callable[[Workers], bool]:
    return lambda workers: not {w["url"] for w in workers} & urls


def _samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [
        (s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples if s.name == name
    ]


async def _metric(url: str, name: str, **labels: str) -> float:
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(url + "/metrics")).text
    return sum(v for found, v in _samples(text, name) if labels.items() <= found.items())


def _prompt(i: int) -> str:
    return f"request {i}: {FILLER}"


@dataclass
class Load:
    """Issues ``total`` requests from ``concurrency`` tasks; the last ``held_back`` wait for ``release``."""

    client: httpx.AsyncClient
    total: int
    concurrency: int
    held_back: int = 0
    release: asyncio.Event = field(default_factory=asyncio.Event)
    issued: int = 0
    done: int = 0
    by_generation: collections.Counter[str] = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)

    async def run(self) -> None:
        await asyncio.gather(*(self._worker() for _ in range(self.concurrency)))

    async def _worker(self) -> None:
        while self.issued < self.total:
            i = self.issued
            self.issued += 1
            if i >= self.total - self.held_back:
                await self.release.wait()
            try:
                await self._one(i)
            except Exception as error:  # any failure is counted, the load goes on
                self.failures.append(f"request {i}: {error!r}")
            self.done += 1

    async def _one(self, i: int) -> None:
        prompt = _prompt(i)
        stream = i % 2 == 1
        body = {"model": "sim-model", "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": stream}
        async with self.client.stream("POST", "/v1/completions", json=body) as response:
            raw = await response.aread()
        if response.status_code != 200:
            self.failures.append(f"request {i}: HTTP {response.status_code} {raw[:200]!r}")
            return
        generations = response.headers.get_list(HEADER)
        if len(generations) != 1 or generations[0] not in (A, B):
            self.failures.append(f"request {i}: generation headers {generations}")
            return
        generation = generations[0]
        if stream:
            events = [e[6:] for e in raw.decode().split("\n\n") if e.startswith("data: ")]
            if not events or events[-1] != "[DONE]":
                self.failures.append(f"request {i}: stream did not end with [DONE]")
                return
            text = "".join(c.get("text", "") for e in events[:-1] for c in json.loads(e)["choices"])
        else:
            text = json.loads(raw)["choices"][0]["text"]
        if text != generate_text(tokenize(prompt), MAX_TOKENS, generation):
            self.failures.append(f"request {i}: text is not generation {generation}'s: {text!r}")
            return
        self.by_generation[generation] += 1


async def _at_least(counter: Callable[[], int], n: int) -> bool:
    return counter() >= n


async def test_rollout_from_a_to_b_under_load_fails_nothing_and_never_crosses(tmp_path: Path) -> None:
    total = 2000
    old, new = await asyncio.gather(_generation(tmp_path, A), _generation(tmp_path, B))
    processes = [old.prefill, old.decode, new.prefill, new.decode]
    endpoints = tmp_path / "endpoints.json"
    _write_endpoints(endpoints, _entries((old, "ready")))
    try:
        async with _router(tmp_path, endpoints) as (router, client):
            shows = functools.partial(_router_shows, client)
            load = Load(client, total=total, concurrency=16, held_back=200)
            started = time.monotonic()
            load_task = asyncio.create_task(load.run())
            marks: dict[str, int] = {}  # requests answered when each step was reached

            async def rollout() -> None:
                await _until(lambda: _at_least(lambda: load.done, 300), "A serving")
                _write_endpoints(endpoints, _entries((old, "ready"), (new, "ready")))
                await _until(shows(_healthy(new.urls)), "B healthy")
                await _until(lambda: _at_least(lambda: load.by_generation[B], 100), "B answering")
                _write_endpoints(endpoints, _entries((old, "terminating"), (new, "ready")))
                await _until(shows(_terminating(old.urls)), "A terminating")
                marks["A terminating"] = load.done
                # From here on the router gives A nothing new; wait for what A still has to finish.
                await _until(shows(_idle(old.urls)), "A idle")
                marks["A idle"] = load.done
                assert await _metric(old.prefill.url, "splitserve_sim_kv_pulls_refused_total") == 0
                assert await _metric(old.decode.url, "vllm:nixl_num_failed_transfers_total") == 0
                _write_endpoints(endpoints, _entries((new, "ready")))
                await _until(shows(_gone(old.urls)), "A gone")
                marks["A gone"] = load.done
                await asyncio.gather(old.prefill.stop(), old.decode.stop())
                assert old.prefill.process.returncode == 0 and old.decode.process.returncode == 0  # drained
                load.release.set()

            rollout_task = asyncio.create_task(rollout())
            try:
                # Bounds are for a machine shared with other work: alone, the load takes seconds.
                await asyncio.wait_for(asyncio.gather(rollout_task, load_task), 240)
            finally:
                for task in (rollout_task, load_task):
                    task.cancel()
            elapsed = time.monotonic() - started
            assert load.failures == [], (load.failures[:10], router.tail())
            assert load.done == total
            # The whole rollout ran under load: requests were still flowing once A was out of rotation.
            assert marks["A gone"] < total - load.held_back < total, marks
            metrics = (await client.get("/metrics")).text

        by_generation = collections.Counter[str]()
        for labels, value in _samples(metrics, "splitserve_router_generation_requests_total"):
            assert labels["outcome"] == "success", labels
            by_generation[labels["generation"]] += int(value)
        assert sum(by_generation.values()) == total
        assert by_generation == load.by_generation and by_generation[A] > 0 and by_generation[B] > 0
        assert _samples(metrics, "splitserve_router_cross_generation_pairs_total") == [({}, 0.0)]
        fallbacks = {
            labels["reason"]: value for labels, value in _samples(metrics, "splitserve_router_fallbacks_total")
        }
        assert fallbacks.get("decode_kv_error", 0) == 0, fallbacks
        assert await _metric(new.prefill.url, "splitserve_sim_kv_pulls_refused_total") == 0
        assert await _metric(new.decode.url, "vllm:nixl_num_failed_transfers_total") == 0
        print(
            f"rollout: {total} requests in {elapsed:.1f}s, by generation {dict(by_generation)}, "
            f"fallbacks {fallbacks}, answered at each step {marks}"
        )
    finally:
        await asyncio.gather(*(p.stop() for p in processes))


async def test_without_pairing_kv_crosses_generations_and_the_metric_says_so(tmp_path: Path) -> None:
    # Decode of A, prefill of B only: every split request pairs across generations.
    prefill, decode = await asyncio.gather(_sim(tmp_path, "prefill", B), _sim(tmp_path, "decode", A))
    endpoints = tmp_path / "endpoints.json"
    _write_endpoints(endpoints, {"prefill": [(prefill.url, B, "ready")], "decode": [(decode.url, A, "ready")]})
    try:
        async with _router(tmp_path, endpoints, "--generation-pairing", "off") as (router, client):
            load = Load(client, total=20, concurrency=4)
            await load.run()
            assert load.failures == [], (load.failures[:10], router.tail())
            assert load.by_generation == {A: 20}  # whole answers, in A's text
            metrics = (await client.get("/metrics")).text
        assert _samples(metrics, "splitserve_router_cross_generation_pairs_total") == [({}, 20.0)]
        assert ({"reason": "decode_kv_error"}, 20.0) in _samples(metrics, "splitserve_router_fallbacks_total")
        assert await _metric(prefill.url, "splitserve_sim_kv_pulls_refused_total", reason="generation") == 20
        assert await _metric(decode.url, "vllm:nixl_num_failed_transfers_total") == 20
    finally:
        await asyncio.gather(prefill.stop(), decode.stop())
