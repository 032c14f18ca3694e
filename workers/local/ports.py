"""Loopback port checks and allocation for the processes of a local run (and the tests' servers)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOOPBACK = "127.0.0.1"
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Linux's default ephemeral range, for systems that do not expose theirs.
DEFAULT_EPHEMERAL_RANGE = (32768, 60999)
# How far below the ephemeral range we look; 20000-32767 on a default Linux.
ALLOCATION_SPAN = 12768
LOWEST_PORT = 1024


def is_port_free(port: int, host: str = LOOPBACK) -> bool:
    """Whether a listening socket could bind host:port right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # Same option the servers use, so a port in TIME_WAIT after a clean stop counts as free.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def ephemeral_port_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's range for ports it picks itself (bind to port 0, the local end of connections)."""
    try:
        low, high = (int(field) for field in path.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL_RANGE
    return low, high


def allocation_range(ephemeral: tuple[int, int]) -> range:
    """Ports to hand out: the span just below the ephemeral range, or above it if that is too low."""
    low, high = ephemeral
    if low - LOWEST_PORT >= ALLOCATION_SPAN // 4:
        return range(max(LOWEST_PORT, low - ALLOCATION_SPAN), low)
    return range(high + 1, min(65536, high + 1 + ALLOCATION_SPAN))


class PortAllocator:
    """Hands out distinct free ports; remembers what it gave so two processes never share one.

    A port is only checked, not held, until the child binds it, and a vLLM engine binds its NIXL
    side channel some 20 s after it starts. Ports the kernel picks (bind to port 0) come from its
    ephemeral range, the same range it takes the local port of every outgoing connection from and
    the one vLLM's own processes draw from while they start, so such a port can be gone by then.
    This allocator therefore draws at random from ports outside that range; the kernel never hands
    those out by itself, and two allocators in different processes rarely pick the same one.
    """

    def __init__(self, host: str = LOOPBACK, *, ephemeral: tuple[int, int] | None = None) -> None:
        self._host = host
        self._given: set[int] = set()
        self._candidates = allocation_range(ephemeral or ephemeral_port_range())
        self._random = random.Random()

    def reserve(self, port: int) -> None:
        self._given.add(port)

    def allocate(self) -> int:
        # A random starting point, then every candidate in turn: distinct allocators spread out,
        # and a busy machine still gets the last free port.
        size = len(self._candidates)
        start = self._random.randrange(size)
        for step in range(size):
            port = self._candidates[(start + step) % size]
            if port not in self._given and is_port_free(port, self._host):
                self._given.add(port)
                return port
        raise RuntimeError(
            f"could not find a free port on {self._host} in {self._candidates.start}-{self._candidates.stop - 1}"
        )


_SHARED = PortAllocator()


def free_port() -> int:
    """A free loopback port outside the kernel's ephemeral range, never the same twice in this process."""
    return _SHARED.allocate()
