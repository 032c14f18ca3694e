"""Port allocation: free, distinct ports outside the kernel's ephemeral range."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from splitserve.local.ports import (
    DEFAULT_EPHEMERAL_RANGE,
    PortAllocator,
    allocation_range,
    ephemeral_port_range,
    free_port,
    is_port_free,
)


def test_ports_come_from_below_the_ephemeral_range_and_are_never_repeated() -> None:
    low, high = ephemeral_port_range()
    allocator = PortAllocator()
    ports = [allocator.allocate() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(not low <= port <= high for port in ports)
    assert all(is_port_free(port) for port in ports)


def test_a_port_in_use_is_never_handed_out() -> None:
    ephemeral = (20010, 60999)  # leaves 20000-20009 (and more below) to choose from
    candidates = allocation_range(ephemeral)
    held: list[socket.socket] = []
    try:
        for port in range(20000, 20010):
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                sock.close()
                continue
            sock.listen()
            held.append(sock)
        taken = {sock.getsockname()[1] for sock in held}
        allocator = PortAllocator(ephemeral=ephemeral)
        for _ in range(100):
            port = allocator.allocate()
            assert port in candidates and port not in taken
    finally:
        for sock in held:
            sock.close()


def test_reserved_ports_are_skipped() -> None:
    allocator = PortAllocator(ephemeral=(1300, 60999))  # too little room below: use the space above
    candidates = allocation_range((1300, 60999))
    assert candidates.start == 61000 and candidates.stop == 65536
    for port in candidates:
        if port != 61000:
            allocator.reserve(port)
    if not is_port_free(61000):
        pytest.skip("port 61000 is in use on this machine")
    assert allocator.allocate() == 61000
    with pytest.raises(RuntimeError, match="could not find a free port"):
        allocator.allocate()


def test_the_kernel_range_is_read_from_proc_and_defaults_when_unreadable(tmp_path: Path) -> None:
    configured = tmp_path / "ip_local_port_range"
    configured.write_text("40000\t50000\n")
    assert ephemeral_port_range(configured) == (40000, 50000)
    assert ephemeral_port_range(tmp_path / "missing") == DEFAULT_EPHEMERAL_RANGE
    configured.write_text("garbage\n")
    assert ephemeral_port_range(configured) == DEFAULT_EPHEMERAL_RANGE
    assert allocation_range((40000, 50000)) == range(40000 - 12768, 40000)


def test_the_shared_helper_gives_distinct_ports() -> None:
    assert len({free_port() for _ in range(50)}) == 50
