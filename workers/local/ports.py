"""Loopback port checks and allocation for the processes of a local run."""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


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


class PortAllocator:
    """Hands out distinct free ports; remembers what it gave so two processes never share one.

    The kernel picks each port (bind to port 0). A port is only reserved until the socket closes,
    so another program could take it before our child binds it; the window is short and a clash
    shows up as a worker that fails at start-up, which the supervisor reports.
    """

    def __init__(self, host: str = LOOPBACK) -> None:
        self._host = host
        self._given: set[int] = set()

    def reserve(self, port: int) -> None:
        self._given.add(port)

    def allocate(self) -> int:
        for _ in range(100):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                probe.bind((self._host, 0))
                port = int(probe.getsockname()[1])
            if port not in self._given:
                self._given.add(port)
                return port
        raise RuntimeError("could not find a free port on the loopback interface")
