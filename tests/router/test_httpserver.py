"""The router's HTTP/1.1 server (httpserver.py), spoken to with raw sockets: what aiohttp's server did
for the router, it must do too (framing, limits, errors, cancellation, backpressure, draining)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Mapping

import pytest

from splitserve.router.httpserver import Handler, HttpServer, Request


@contextlib.asynccontextmanager
async def serving(
    routes: Mapping[str, Mapping[str, Handler]], max_body_bytes: int = 4096, idle_timeout: float = 75.0
) -> AsyncIterator[tuple[HttpServer, int]]:
    server = HttpServer(routes, max_body_bytes, idle_timeout=idle_timeout)
    port = await server.listen("127.0.0.1", 0)
    try:
        yield server, port
    finally:
        await server.close()


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One response: status, headers (lower-case names) and the body, de-chunked."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    status = int(head[0].split(" ")[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:] if line)}
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    if headers.get("transfer-encoding") == "chunked":
        chunks: list[bytes] = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            chunks.append((await reader.readexactly(size + 2))[:-2])
            if size == 0:
                return status, headers, b"".join(chunks)
    return status, headers, b""


async def echo(request: Request) -> None:
    request.respond_json({"path": request.path, "query": request.query, "length": len(request.body)})


async def slow_then_echo(request: Request) -> None:
    await asyncio.sleep(0.05)
    await echo(request)


async def test_keep_alive_and_pipelined_requests_are_answered_in_order() -> None:
    async with serving({"/slow": {"POST": slow_then_echo}, "/fast": {"POST": echo}}) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        # Two requests in one write: the slow one first. Its answer must still come first.
        writer.write(b"POST /slow?a=1 HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"
                     b"POST /fast HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")  # fmt: skip
        first, second = await read_response(reader), await read_response(reader)
        assert json.loads(first[2]) == {"path": "/slow", "query": "a=1", "length": 3}
        assert json.loads(second[2])["path"] == "/fast"
        # The connection stays open for a third.
        writer.write(b"POST /fast HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        assert (await read_response(reader))[0] == 200
        writer.close()


async def test_expect_100_continue_and_chunked_request_bodies() -> None:
    async with serving({"/e": {"POST": echo}}) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /e HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nTransfer-Encoding: chunked\r\n\r\n")
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
        status, _, body = await read_response(reader)
        assert status == 200 and json.loads(body)["length"] == 11
        writer.close()


@pytest.mark.parametrize(
    ("raw", "status", "code"),
    [
        (b"NOT HTTP AT ALL\r\n\r\n", 400, "invalid_http"),
        (b"GET /e HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n", 431, "headers_too_large"),
        (b"POST /e HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n", 413, "request_too_large"),
        (b"POST /e HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1388\r\n" + b"x" * 5000, 413,
         "request_too_large"),
    ],
    ids=["malformed", "head too large", "content-length over the limit", "chunked body over the limit"],
)  # fmt: skip
async def test_unreadable_requests_get_json_errors_and_a_closed_connection(raw: bytes, status: int, code: str) -> None:
    async with serving({"/e": {"POST": echo, "GET": echo}}) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(raw)
        answer, headers, body = await read_response(reader)
        assert answer == status and headers["connection"] == "close"
        assert json.loads(body)["error"]["code"] == code
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed after the answer
        writer.close()


async def test_unknown_paths_methods_and_head() -> None:
    async with serving({"/e": {"GET": echo}}) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, body = await read_response(reader)
        assert status == 404 and json.loads(body)["error"]["code"] == "not_found"
        writer.write(b"DELETE /e HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, body = await read_response(reader)
        assert status == 405 and headers["allow"] == "GET, HEAD"
        assert json.loads(body)["error"]["code"] == "method_not_allowed"
        writer.write(b"HEAD /e HTTP/1.1\r\nHost: x\r\n\r\nGET /e HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK") and b"Content-Length: " in head
        status, _, body = await read_response(reader)  # the HEAD had no body: this is the GET's answer
        assert status == 200 and json.loads(body)["path"] == "/e"
        writer.close()


async def test_a_failing_handler_is_a_500_and_the_server_goes_on() -> None:
    async def broken(request: Request) -> None:
        raise KeyError("bug")

    async def silent(request: Request) -> None:
        return None

    async with serving({"/broken": {"GET": broken}, "/silent": {"GET": silent}, "/e": {"GET": echo}}) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for path in (b"/broken", b"/silent"):
            writer.write(b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n")
            status, _, body = await read_response(reader)
            assert status == 500 and json.loads(body)["error"]["code"] == "internal_error"
        writer.write(b"GET /e HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await read_response(reader))[0] == 200
        writer.close()


async def test_streams_frame_chunks_and_pass_framed_bytes_through() -> None:
    async def stream(request: Request) -> None:
        framed = request.query == "framed"
        if framed:
            request.start_stream(200, {"Content-Type": "text/event-stream"}, b"3\r\nabc\r\n", framed=True)
            await request.write(b"2\r\nde\r\n", framed=True)
            await request.finish(b"1\r\nf\r\n0\r\n\r\n", framed=True)
        else:
            request.start_stream(200, {"Content-Type": "text/event-stream"}, b"abc")
            await request.write(b"de")
            await request.finish(b"f")

    async def whole(request: Request) -> None:
        request.start_stream(200, {}, b"all at once", end=True)

    async with serving({"/s": {"GET": stream}, "/w": {"GET": whole}}) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for target in (b"/s", b"/s?framed", b"/w"):
            writer.write(b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n")
            status, headers, body = await read_response(reader)
            assert status == 200 and headers["transfer-encoding"] == "chunked"
            assert body == (b"all at once" if target == b"/w" else b"abcdef")
        writer.close()


async def test_a_client_that_leaves_cancels_its_handler() -> None:
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def forever(request: Request) -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async with serving({"/f": {"GET": forever}}) as (_, port):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /f HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.wait_for(started.wait(), 5)
        writer.close()
        await asyncio.wait_for(cancelled.wait(), 5)


async def test_a_slow_reader_pauses_the_writer() -> None:
    chunk = b"x" * 65536
    written = 0

    async def flood(request: Request) -> None:
        nonlocal written
        request.start_stream(200, {})
        for _ in range(2000):  # 128 MiB: without backpressure all of it would sit in the server's buffer
            await request.write(chunk)
            written += 1
        await request.finish()

    async with serving({"/flood": {"GET": flood}}) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=2**20)
        writer.write(b"GET /flood HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(0.3)  # not reading
        assert written < 200, f"{written} chunks written to a client that reads nothing"
        _, _, body = await asyncio.wait_for(read_response(reader), 60)
        assert written == 2000 and len(body) == 2000 * len(chunk)
        writer.close()


async def test_idle_connections_are_closed() -> None:
    async with serving({"/e": {"GET": echo}}, idle_timeout=0.2) as (server, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /e HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await read_response(reader))[0] == 200
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the server, idle
        assert not server.connections
        writer.close()


async def test_stop_accepting_finishes_what_is_in_flight_with_connection_close() -> None:
    release = asyncio.Event()

    async def held(request: Request) -> None:
        await release.wait()
        await echo(request)

    async with serving({"/h": {"GET": held}}) as (server, port):
        busy_reader, busy_writer = await asyncio.open_connection("127.0.0.1", port)
        idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)
        busy_writer.write(b"GET /h HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(0.1)
        server.stop_accepting()
        assert await asyncio.wait_for(idle_reader.read(), 5) == b""  # idle keep-alive connections close
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)
        release.set()
        status, headers, _ = await read_response(busy_reader)
        assert status == 200 and headers["connection"] == "close"
        busy_writer.close()
        idle_writer.close()
