"""Processes for test_waits.py: a NIXL agent left idle, and one end of a pair of vLLM shared-memory queues.

Run in child processes (spawn), so each starts with the waits its test installs and nothing else.
"""

from __future__ import annotations

import os
import sys
import time
from multiprocessing.connection import Connection

from splitserve.engine.wait_settings import WaitSettings
from splitserve.engine.waits import install, patch_shm_broadcast
from splitserve.local.procs import cpu_seconds

SHM_BROADCAST = "vllm.distributed.device_communicators.shm_broadcast"


def idle_nixl_agent_cpu(settings: WaitSettings, seconds: float) -> float:
    """Cores used by this process while a NIXL agent with a UCX backend sits idle for `seconds`."""
    install(settings)
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(f"idle-{os.getpid()}", nixl_agent_config(backends=["UCX"]))
    time.sleep(0.5)  # past the backend's start-up
    started, cpu = time.monotonic(), cpu_seconds([os.getpid()])
    time.sleep(seconds)
    used = (cpu_seconds([os.getpid()]) - cpu) / (time.monotonic() - started)
    del agent
    return used


def setup_waits(mode: str) -> None:
    """`vllm`: vLLM's own waits; `events`: splitserve's; `events-vllm-writer`: splitserve's reader waits
    beside vLLM's own hint writer."""
    if mode == "events":
        install(WaitSettings("events"))
    elif mode == "events-vllm-writer":
        import importlib

        patch_shm_broadcast(importlib.import_module(SHM_BROADCAST), spin_us=0, reliable_hints=False)


def echo(pipe: Connection) -> None:
    """Answer every message of the queue whose handle comes down `pipe` with the same message, until None.

    Forked by `pingpong` once the waits are set up and vLLM imported, and before any ZMQ context exists
    (a forked context is unusable): the echo starts with the same waits, without importing torch again.
    """
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    inbox = MessageQueue.create_from_handle(pipe.recv(), 0)
    outbox = MessageQueue(1, 1)
    pipe.send(outbox.export_handle())
    inbox.wait_until_ready()
    outbox.wait_until_ready()
    while (message := inbox.dequeue()) is not None:
        outbox.enqueue(message)
    outbox.enqueue(None)


def pingpong(mode: str, rounds: int, idle_seconds: float, recheck_ms: int, pipe: Connection) -> None:
    """Send `rounds` messages back to back through an echo process, then leave the echo idle for
    `idle_seconds` before one last round; report the round trips, the late hints this end saw and the
    CPU the echo process used while idle. A reader whose hint never comes finds its message at the
    next recheck, every `recheck_ms`: long enough here to tell a lost hint from a slow one."""
    import multiprocessing

    from splitserve.engine import waits

    waits.ACTIVE_RECHECK_MS = recheck_ms
    setup_waits(mode)
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    from splitserve.engine.waits import counters

    context = multiprocessing.get_context("fork")
    here, there = context.Pipe()
    peer = context.Process(target=echo, args=(there,), daemon=True)
    peer.start()
    outbox = MessageQueue(1, 1)
    here.send(outbox.export_handle())
    inbox = MessageQueue.create_from_handle(here.recv(), 0)
    outbox.wait_until_ready()
    inbox.wait_until_ready()
    round_trips = []
    for index in range(rounds):
        started = time.perf_counter()
        outbox.enqueue(index)
        assert inbox.dequeue() == index
        round_trips.append(time.perf_counter() - started)
    reads, late = counters.reads, counters.late_hints
    cpu = cpu_seconds([peer.pid])
    time.sleep(idle_seconds)
    idle_cpu = cpu_seconds([peer.pid]) - cpu
    started = time.perf_counter()
    outbox.enqueue("after the pause")
    assert inbox.dequeue() == "after the pause"
    after_pause = time.perf_counter() - started
    outbox.enqueue(None)
    inbox.dequeue()
    peer.join(10)
    pipe.send(
        {
            "round_trips": round_trips,
            "reads": reads,
            "late_hints": late,
            "echo_idle_cpu_seconds": idle_cpu,
            "after_pause_seconds": after_pause,
        }
    )


if __name__ == "__main__":
    sys.exit("imported by tests/engine/test_waits.py")
