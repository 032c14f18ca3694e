"""Coalescer: a burst of requests is one reconcile of the owner; requests during a run make one more;
a spec change (`full`) is never lost in a burst; failures and "not yet" are retried."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from splitserve.controller.coalesce import Coalescer

Call = tuple[str, str, bool]


async def until(condition: Callable[[], bool], limit_s: float = 10.0) -> None:
    """Wait for what must happen (however slow the machine); what must not happen is checked after it."""
    deadline = asyncio.get_running_loop().time() + limit_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def recorder() -> tuple[list[Call], Callable[[str, str, bool], Awaitable[float | None]]]:
    calls: list[Call] = []

    async def run(namespace: str, name: str, full: bool) -> float | None:
        calls.append((namespace, name, full))
        return None

    return calls, run


async def test_a_burst_of_ten_requests_is_one_reconcile_and_keeps_the_spec_change() -> None:
    calls, run = recorder()
    coalescer = Coalescer(run, window=0.05)
    for index in range(10):
        coalescer.request("ns", "demo", full=index == 3)
    coalescer.request("ns", "other")
    await until(lambda: len(calls) >= 2)
    await asyncio.sleep(0.2)  # a window and more: nothing else comes
    assert sorted(calls) == [("ns", "demo", True), ("ns", "other", False)]
    assert coalescer.idle
    await coalescer.aclose()


async def test_requests_during_a_run_make_exactly_one_more_run() -> None:
    started, release = asyncio.Event(), asyncio.Event()
    calls: list[bool] = []

    async def run(namespace: str, name: str, full: bool) -> float | None:
        calls.append(full)
        if len(calls) == 1:
            started.set()
            await release.wait()  # the first run is still going while requests arrive
        return None

    coalescer = Coalescer(run, window=0.01)
    coalescer.request("ns", "demo")
    await started.wait()
    for index in range(5):
        coalescer.request("ns", "demo", full=index == 2)
    release.set()
    await until(lambda: len(calls) >= 2)
    await asyncio.sleep(0.1)
    assert calls == [False, True]
    await coalescer.aclose()


async def test_a_failing_reconcile_is_retried_with_backoff_and_keeps_full() -> None:
    calls: list[bool] = []

    async def run(namespace: str, name: str, full: bool) -> float | None:
        calls.append(full)
        if len(calls) < 3:
            raise RuntimeError("API down")
        return None

    coalescer = Coalescer(run, window=0.01, backoff=(0.02, 0.05))
    coalescer.request("ns", "demo", full=True)
    await until(lambda: len(calls) >= 3)
    await until(lambda: coalescer.idle)
    assert calls == [True, True, True]
    await coalescer.aclose()


async def test_a_spec_that_cannot_be_realised_yet_is_tried_again_after_the_delay_it_asks() -> None:
    calls: list[float] = []
    loop = asyncio.get_running_loop()

    async def run(namespace: str, name: str, full: bool) -> float | None:
        calls.append(loop.time())
        return 0.3 if len(calls) == 1 else None

    coalescer = Coalescer(run, window=0.01)
    coalescer.request("ns", "demo", full=True)
    await until(lambda: len(calls) >= 2)
    assert calls[1] - calls[0] >= 0.3
    await coalescer.aclose()


async def test_an_earlier_request_is_not_held_back_by_a_pending_retry() -> None:
    calls, run = recorder()
    coalescer = Coalescer(run, window=0.01)
    coalescer.request("ns", "demo", after=60)  # a retry, far away
    coalescer.request("ns", "demo", full=True)  # a spec change: now
    await until(lambda: len(calls) >= 1)
    assert calls == [("ns", "demo", True)]
    await coalescer.aclose()


async def test_a_forgotten_owner_runs_nothing() -> None:
    calls, run = recorder()
    coalescer = Coalescer(run, window=0.05)
    coalescer.request("ns", "demo", full=True)
    coalescer.forget("ns", "demo")
    await asyncio.sleep(0.2)
    assert calls == [] and coalescer.idle
    await coalescer.aclose()


async def test_closing_cancels_what_is_pending() -> None:
    calls, run = recorder()
    coalescer = Coalescer(run, window=10)
    coalescer.request("ns", "demo")
    await coalescer.aclose()
    await asyncio.sleep(0.05)
    assert calls == []
