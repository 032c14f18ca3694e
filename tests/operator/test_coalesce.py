"""Coalescer: a burst of child events is one reconcile of the owner; events during a run make one more."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from splitserve.controller.coalesce import Coalescer


async def until(condition: Callable[[], bool], limit_s: float = 10.0) -> None:
    """Wait for what must happen (however slow the machine); what must not happen is checked after it."""
    deadline = asyncio.get_running_loop().time() + limit_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_a_burst_of_ten_events_is_one_reconcile() -> None:
    runs: list[tuple[str, str]] = []

    async def run(namespace: str, name: str) -> None:
        runs.append((namespace, name))

    coalescer = Coalescer(run, window=0.05)
    for _ in range(10):
        coalescer.request("ns", "demo")
    coalescer.request("ns", "other")
    await until(lambda: len(runs) >= 2)
    await asyncio.sleep(0.2)  # a window and more: nothing else comes
    assert sorted(runs) == [("ns", "demo"), ("ns", "other")]
    await coalescer.aclose()


async def test_events_during_a_run_make_exactly_one_more_run() -> None:
    started, release = asyncio.Event(), asyncio.Event()
    runs = 0

    async def run(namespace: str, name: str) -> None:
        nonlocal runs
        runs += 1
        if runs == 1:
            started.set()
            await release.wait()  # the first run is still going while events arrive

    coalescer = Coalescer(run, window=0.01)
    coalescer.request("ns", "demo")
    await started.wait()
    for _ in range(5):
        coalescer.request("ns", "demo")
    release.set()
    await until(lambda: runs >= 2)
    await asyncio.sleep(0.1)
    assert runs == 2
    await coalescer.aclose()


async def test_a_failing_reconcile_does_not_stop_later_ones() -> None:
    runs = 0

    async def run(namespace: str, name: str) -> None:
        nonlocal runs
        runs += 1
        raise RuntimeError("API down")

    coalescer = Coalescer(run, window=0.01)
    coalescer.request("ns", "demo")
    await until(lambda: runs == 1 and not coalescer._pending)
    coalescer.request("ns", "demo")
    await until(lambda: runs == 2)
    await coalescer.aclose()


async def test_closing_cancels_what_is_pending() -> None:
    runs = 0

    async def run(namespace: str, name: str) -> None:
        nonlocal runs
        runs += 1

    coalescer = Coalescer(run, window=10)
    coalescer.request("ns", "demo")
    await coalescer.aclose()
    await asyncio.sleep(0.05)
    assert runs == 0
