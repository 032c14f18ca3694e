"""Choosing the router's port: the default if free, a free one with a note if not, a busy request refused."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from splitserve.local import cli


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield int(holder.getsockname()[1])


def test_default_port_when_free(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = int(probe.getsockname()[1])
    monkeypatch.setattr(cli, "DEFAULT_ROUTER_PORT", free)
    assert cli._router_port(None) == (free, None)


def test_busy_default_falls_back_with_a_note(monkeypatch: pytest.MonkeyPatch, busy_port: int) -> None:
    monkeypatch.setattr(cli, "DEFAULT_ROUTER_PORT", busy_port)
    port, note = cli._router_port(None)
    assert port != busy_port
    assert note is not None and f"port {busy_port} is busy" in note and str(port) in note


def test_busy_requested_port_is_an_error(busy_port: int) -> None:
    with pytest.raises(ValueError, match=f"port {busy_port} on 127.0.0.1 is in use"):
        cli._router_port(busy_port)


def test_zero_means_any_free_port() -> None:
    port, note = cli._router_port(0)
    assert port > 0 and note is None


@pytest.mark.parametrize("port", [-1, 65536])
def test_out_of_range(port: int) -> None:
    with pytest.raises(ValueError, match="is not a TCP port"):
        cli._router_port(port)
