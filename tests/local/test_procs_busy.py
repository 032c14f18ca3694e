"""procs.busy_ticks: how busy cores were, from /proc/stat (the router benchmark's "wrk's cores busy",
the autoscaling benchmark's machine load)."""

from __future__ import annotations

import os
import time

import pytest

from splitserve.local.procs import busy_ticks


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")
def test_a_core_this_process_spins_on_reads_busy() -> None:
    core = min(os.sched_getaffinity(0))
    before_affinity = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        before = busy_ticks([core])
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            pass
        after = busy_ticks([core])
    finally:
        os.sched_setaffinity(0, before_affinity)
    busy, total = after[0] - before[0], after[1] - before[1]
    # The core ran this loop (or, preempted, someone else): either way it was not idle.
    assert total > 0 and busy / total >= 0.8, (busy, total)


def test_the_machine_is_the_sum_of_its_cores() -> None:
    cores = range(os.cpu_count() or 1)
    first = busy_ticks(cores)
    machine = busy_ticks()
    last = busy_ticks(cores)
    # Counters only grow, and the machine's line is the cores' lines summed when it was read. The kernel
    # converts each field of each line from nanoseconds to ticks on its own: per field, the sum of the
    # rounded cores and the rounded sum differ by less than a tick per core. Eight fields are counted.
    slack = 8 * len(cores)
    for index in (0, 1):
        assert first[index] - slack <= machine[index] <= last[index] + slack, (first, machine, last)
