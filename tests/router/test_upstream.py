"""The lean upstream HTTP client against raw servers that frame bodies every legal way."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from splitserve.router.upstream import HttpPool, UpstreamError, UpstreamResponse

Reply = Callable[[bytes], list[bytes]]  # request bytes -> pieces to write (with pauses between)
StartServer = Callable[[Reply], Awaitable[str]]


@pytest.fixture
async def raw_server() -> AsyncIterator[StartServer]:
    servers: list[asyncio.Server] = []
    writers: list[asyncio.StreamWriter] = []

    async def start(reply: Reply) -> str:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writers.append(writer)
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = 0
                    for line in head.split(b"\r\n"):
                        if line.lower().startswith(b"content-length:"):
                            length = int(line.split(b":")[1])
                    request = head + await reader.readexactly(length)
                    for piece in reply(request):
                        if piece == b"<pause>":
                            await asyncio.sleep(0.05)
                        elif piece == b"<close>":
                            writer.close()
                            return
                        else:
                            writer.write(piece)
                            await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        servers.append(server)
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    yield start
    # Server.close() leaves accepted connections open (until Python 3.13): a handler still waiting on a
    # kept-alive one would hold its socket past the loop's end.
    for writer in writers:
        writer.close()
    for server in servers:
        server.close()
        await server.wait_closed()


def _post(pool: HttpPool, timeout: float = 2.0) -> Awaitable[UpstreamResponse]:
    return pool.post("/v1/completions", b'{"x": 1}', {"X-Request-Id": "r1"}, timeout, timeout, time.monotonic() + 10)


async def test_content_length_body_and_connection_reuse(raw_server: StartServer) -> None:
    seen: list[bytes] = []

    def reply(request: bytes) -> list[bytes]:
        seen.append(request)
        return [
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 7\r\n\r\n",
            b"<pause>",
            b'{"a":1}',
        ]

    url = await raw_server(reply)
    pool = HttpPool(url, connect_timeout=1)
    for _ in range(3):
        async with await _post(pool) as response:
            assert response.status == 200
            assert response.header("content-type") == "application/json"
            assert await response.read() == b'{"a":1}'
    assert seen[0].startswith(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"X-Request-Id: r1\r\n" in seen[0] and seen[0].endswith(b'\r\n\r\n{"x": 1}')
    assert len(pool._idle) == 1  # one kept-alive connection served all three
    await pool.close()


async def test_chunked_stream_arrives_piece_by_piece(raw_server: StartServer) -> None:
    def reply(request: bytes) -> list[bytes]:
        return [
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n",
            b"6\r\ndata: \r\n",
            b"<pause>",
            b"3\r\nabc\r\n2\r\n\n\n\r\n",
            b"<pause>",
            b"0\r\n\r\n",
        ]

    pool = HttpPool(await raw_server(reply), connect_timeout=1)
    async with await _post(pool) as response:
        pieces = []
        while not response.at_eof():
            piece = await response.readany()
            if not piece:
                break
            pieces.append(piece)
        assert b"".join(pieces) == b"data: abc\n\n"
        assert len(pieces) >= 2  # not buffered to the end
    assert len(pool._idle) == 1
    await pool.close()


async def test_connection_closed_mid_chunked_body_is_an_error(raw_server: StartServer) -> None:
    def reply(request: bytes) -> list[bytes]:
        return [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", b"3\r\nabc\r\n", b"<pause>", b"<close>"]

    pool = HttpPool(await raw_server(reply), connect_timeout=1)
    async with await _post(pool) as response:
        assert await response.readany() == b"abc"
        with pytest.raises(UpstreamError):
            await response.readany()
    assert not pool._idle
    await pool.close()


async def test_close_delimited_body_and_first_byte_timeout(raw_server: StartServer) -> None:
    def reply(request: bytes) -> list[bytes]:
        return [b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nhello", b"<close>"]

    pool = HttpPool(await raw_server(reply), connect_timeout=1)
    async with await _post(pool) as response:
        assert await response.read() == b"hello"
    assert not pool._idle

    def silent(request: bytes) -> list[bytes]:
        return [b"<pause>", b"<pause>", b"<pause>", b"<pause>"]

    slow = HttpPool(await raw_server(silent), connect_timeout=1)
    with pytest.raises(TimeoutError):
        await _post(slow, timeout=0.05)
    await slow.close()


async def test_stale_kept_alive_connection_is_retried_on_a_fresh_one(raw_server: StartServer) -> None:
    count = 0

    def reply(request: bytes) -> list[bytes]:
        nonlocal count
        count += 1
        # The server closes right after each answer, though it did not say Connection: close.
        return [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", b"<close>"]

    pool = HttpPool(await raw_server(reply), connect_timeout=1)
    for _ in range(3):
        async with await _post(pool) as response:
            assert await response.read() == b"ok"
        await asyncio.sleep(0.05)  # let the close arrive (or not): both paths must work
    assert count == 3
    await pool.close()


async def test_refused_connection_is_an_upstream_error() -> None:
    pool = HttpPool("http://127.0.0.1:9", connect_timeout=1)
    with pytest.raises(UpstreamError):
        await _post(pool)
