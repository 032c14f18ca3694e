"""wrk (Debian package ``wrk``) as the router benchmark's load generator, with its own CPU measured.

A load generator that costs more per request than the router saturates first, and then the "router
saturation" it reports is its own. wrk is C on an event loop and costs a few µs per request; this
module runs it pinned where it is told, reads its latency percentiles through a Lua ``done()`` hook,
and measures what it cost: wrk's own CPU time (``wait4`` rusage) and how busy the cores it ran on
were (``/proc/stat``). :attr:`WrkRun.limited` says when either passed 90%: such a run says nothing
about the router.

Two shapes: closed loop (``delay_ms=0``: every connection sends its next request when the last one is
answered: saturation), and paced (each connection waits ``delay_ms`` after an answer: a fixed rate
of about ``connections / delay`` at the latencies measured here).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from splitserve.local.procs import busy_ticks

# wrk's Lua: the POST body and the pause come from the environment; done() prints one JSON line.
_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = os.getenv("WRK_BODY")
local pause = tonumber(os.getenv("WRK_DELAY_MS") or "0")
if pause > 0 then
  function delay() return pause end
end
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRK_RESULT {"requests":%d,"duration_us":%d,"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d,' ..
    '"p50_us":%d,"p90_us":%d,"p99_us":%d,"max_us":%d}\\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max))
end
"""
LIMIT = 0.9  # a generator (or its cores) busier than this may be what limits the run


@dataclass
class WrkRun:
    requests: int
    seconds: float
    errors: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    cpu_seconds: float  # wrk's own user + system time
    cores_busy: float  # busy share of the cores wrk ran on (whoever used them), 0..1

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    @property
    def cpu_share(self) -> float:
        """wrk's CPU as a share of one core (it runs one thread)."""
        return self.cpu_seconds / self.seconds if self.seconds else 0.0

    def limited(self, cores_shared_with_target: bool) -> bool:
        """Whether the load generator may have been the limit. Where the target shares wrk's cores,
        they are meant to be full; then only wrk's own thread counts."""
        return self.cpu_share > LIMIT or (not cores_shared_with_target and self.cores_busy > LIMIT)


def available() -> str | None:
    return shutil.which("wrk")


async def run(
    url: str,
    body: bytes,
    seconds: float,
    connections: int,
    cores: set[int] | None,
    delay_ms: float = 0.0,
) -> WrkRun:
    """One wrk run against ``url`` (POST ``body``); ``cores``: where wrk runs (None: anywhere)."""
    binary = available()
    if binary is None:
        raise RuntimeError("wrk is not installed (Debian: apt-get install wrk; scripts/setup.sh --with-prometheus)")
    argv = [binary, "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", url]
    if cores is not None and shutil.which("taskset"):
        argv = ["taskset", "-c", ",".join(map(str, sorted(cores))), *argv]
    env = {**os.environ, "WRK_BODY": body.decode(), "WRK_DELAY_MS": f"{delay_ms:g}"}
    watched = cores if cores is not None else set(os.sched_getaffinity(0))
    before = busy_ticks(watched)
    returncode, output, cpu = await asyncio.to_thread(_run, argv, env)
    after = busy_ticks(watched)
    line = next((ln for ln in output.splitlines() if ln.startswith("WRK_RESULT ")), None)
    if returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed ({returncode}): {output[-2000:]}")
    result = json.loads(line.removeprefix("WRK_RESULT "))
    busy, total = after[0] - before[0], after[1] - before[1]
    errors = sum(result[key] for key in ("connect", "read", "write", "status", "timeout"))
    return WrkRun(
        requests=result["requests"],
        seconds=result["duration_us"] / 1e6,
        errors=errors,
        p50_ms=result["p50_us"] / 1e3,
        p90_ms=result["p90_us"] / 1e3,
        p99_ms=result["p99_us"] / 1e3,
        max_ms=result["max_us"] / 1e3,
        cpu_seconds=cpu,
        cores_busy=busy / max(1, total),
    )


def _run(argv: list[str], env: dict[str, str]) -> tuple[int, str, float]:
    """wrk's exit code, output and CPU seconds (from wait4: its own, nothing else's)."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(_SCRIPT)
    try:
        # The script goes before the URL, as wrk's usage has it.
        argv = [*argv[:-1], "-s", script.name, argv[-1]]
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        assert process.stdout is not None
        output = process.stdout.read().decode(errors="replace")
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
    finally:
        Path(script.name).unlink(missing_ok=True)
    return process.returncode, output, usage.ru_utime + usage.ru_stime
