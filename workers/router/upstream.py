"""A lean HTTP/1.1 client for the two upstream calls of every request (prefill leg, decode leg).

Why not aiohttp's client here: it was most of the router's CPU per request (request/response
objects, tracing hooks, cookie and redirect machinery the router never uses). This client does one
``write`` per request on a kept-alive connection from a small per-worker pool, parses the status
line and headers with ``bytes`` methods, and frames the body by Content-Length, chunked encoding or
connection close. Health probes and /metrics polls keep using aiohttp, where cost does not matter.

Errors are ``UpstreamError`` (a ``ConnectionError``, so an ``OSError``) or ``TimeoutError``.
"""

from __future__ import annotations

import asyncio
import time
from types import TracebackType
from urllib.parse import urlsplit


class UpstreamError(ConnectionError):
    """The upstream connection failed or the answer was not valid HTTP/1.1."""


class _Deadlines:
    """Read timeouts of one pool's connections, checked every ``_TICK`` seconds by one task that runs
    while anything waits. One armed and cancelled loop timer per wait cost ~2 µs, three waits a request."""

    _TICK = 0.02

    def __init__(self) -> None:
        self.waiting: set[_Connection] = set()
        self._task: asyncio.Task[None] | None = None

    def watch(self, conn: _Connection) -> None:
        self.waiting.add(conn)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._expire())

    async def _expire(self) -> None:
        try:
            while self.waiting:
                await asyncio.sleep(self._TICK)
                now = time.monotonic()
                for conn in [c for c in self.waiting if c.deadline <= now]:
                    conn.expire()
        finally:
            self._task = None

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


class _Connection(asyncio.Protocol):
    def __init__(self, loop: asyncio.AbstractEventLoop, deadlines: _Deadlines) -> None:
        self._loop = loop
        self._deadlines = deadlines
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.closed = False
        self.idle_since = 0.0
        self.deadline = 0.0
        self.answered = False  # any byte of an answer arrived on this connection since it was taken
        self._waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's TCP transport is not a subclass

    def data_received(self, data: bytes) -> None:
        self.answered = True
        self.buffer += data
        self._wake()

    def eof_received(self) -> bool:
        self.closed = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            self._deadlines.waiting.discard(self)
            if not waiter.done():
                waiter.set_result(None)

    def expire(self) -> None:
        waiter = self._waiter
        self._waiter = None
        self._deadlines.waiting.discard(self)
        if waiter is not None and not waiter.done():
            waiter.set_exception(TimeoutError())

    def wait_data(self, seconds: float) -> asyncio.Future[None]:
        """A future done when more bytes arrive or the connection closes; TimeoutError after ``seconds``
        (to within ``_Deadlines._TICK``)."""
        if self.closed:
            raise UpstreamError("upstream closed the connection")
        waiter = self._loop.create_future()
        self._waiter = waiter
        self.deadline = time.monotonic() + seconds
        self._deadlines.watch(self)
        return waiter

    def close(self) -> None:
        self.closed = True
        self._deadlines.waiting.discard(self)
        if self.transport is not None:
            self.transport.close()


def _next_chunk(buffer: bytearray, at: int) -> tuple[int, int, int] | None:
    """The chunk of a chunked body that starts at ``at`` in ``buffer``, when it is all there:
    (data start, data end, where the next chunk starts). The terminating chunk (and its trailers)
    has no data: start == end. None while the chunk is incomplete."""
    line_end = buffer.find(b"\r\n", at)
    if line_end < 0:
        return None
    try:
        size = int(bytes(buffer[at:line_end]).split(b";", 1)[0], 16)
    except ValueError:
        raise UpstreamError("bad chunk size from upstream") from None
    start = line_end + 2
    if size == 0:
        trailer_end = buffer.find(b"\r\n\r\n", line_end)
        return None if trailer_end < 0 else (start, start, trailer_end + 4)
    if len(buffer) < start + size + 2:
        return None
    return start, start + size, start + size + 2


class UpstreamResponse:
    """An answer being read; use as an async context manager so the connection goes back or closes."""

    def __init__(
        self,
        pool: HttpPool,
        conn: _Connection,
        status: int,
        headers: dict[bytes, bytes],
        read_timeout: float,
        deadline: float,
    ) -> None:
        self.status = status
        self.headers = headers
        self._pool = pool
        self._conn = conn
        self._timeout = read_timeout
        self._deadline = deadline
        self._done = False
        self._framed = False  # read with read_framed: the terminating chunk is part of what it returns
        self._keep_alive = headers.get(b"connection", b"").lower() != b"close"
        length = headers.get(b"content-length")
        self._chunked = b"chunked" in headers.get(b"transfer-encoding", b"").lower()
        self._remaining = int(length) if length is not None and not self._chunked else -1
        if self._remaining == 0 or status in (204, 304):
            self._done = True
        elif self._remaining < 0 and not self._chunked:
            self._keep_alive = False  # body ends when the connection does

    def header(self, name: str, default: str = "") -> str:
        return self.headers.get(name.lower().encode(), default.encode()).decode("latin-1")

    def at_eof(self) -> bool:
        if not self._done and self._chunked and not self._framed:
            # The terminating chunk may already be buffered: then nothing more will come.
            self._done = bytes(self._conn.buffer[:5]) == b"0\r\n\r\n"
            if self._done:
                del self._conn.buffer[:5]
        return self._done

    async def readany(self) -> bytes:
        """The next piece of the body (chunk framing removed); b"" once the body is complete."""
        if self._done:
            return b""
        conn = self._conn
        if self._chunked:
            return await self._read_chunk(conn)
        while not conn.buffer:
            if conn.closed:
                if self._remaining < 0:
                    self._done = True
                    return b""
                raise UpstreamError("upstream closed the connection mid-body")
            await conn.wait_data(self._wait_budget())
        if self._remaining < 0:
            data = bytes(conn.buffer)
            conn.buffer.clear()
            return data
        data = bytes(conn.buffer[: self._remaining])
        del conn.buffer[: len(data)]
        self._remaining -= len(data)
        if self._remaining == 0:
            self._done = True
        return data

    @property
    def chunked(self) -> bool:
        return self._chunked

    async def read_framed(self) -> bytes:
        """The next whole chunks of a chunked body *with* their framing, as they came, ending with the
        terminating chunk; b"" once the body is complete. For relaying a stream without re-framing it:
        only whole chunks are returned, so what was relayed always ends on a chunk boundary."""
        if self._done:
            return b""
        self._framed = True
        conn = self._conn
        while True:
            buffer = conn.buffer
            end = 0
            while (chunk := _next_chunk(buffer, end)) is not None:
                start, stop, end = chunk
                if start == stop:
                    self._done = True
                    break
            if end:
                data = bytes(buffer[:end])
                del buffer[:end]
                return data
            if conn.closed:
                raise UpstreamError("upstream closed the connection mid-body")
            await conn.wait_data(self._wait_budget())

    async def _read_chunk(self, conn: _Connection) -> bytes:
        pieces: list[bytes] = []
        while True:
            buffer = conn.buffer
            end = 0
            while (chunk := _next_chunk(buffer, end)) is not None:  # every complete chunk already here
                start, stop, end = chunk
                if start == stop:
                    self._done = True
                    break
                pieces.append(bytes(buffer[start:stop]))
            del buffer[:end]
            if pieces or self._done:
                return b"".join(pieces)
            await conn.wait_data(self._wait_budget())

    def _wait_budget(self) -> float:
        """Longest wait for the next bytes: the read timeout, cut short by the request's deadline."""
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        return min(self._timeout, remaining)

    async def read(self) -> bytes:
        parts: list[bytes] = []
        while True:
            part = await self.readany()
            if not part and self._done:
                return b"".join(parts)
            parts.append(part)

    async def __aenter__(self) -> UpstreamResponse:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    def release(self) -> None:
        """Back to the pool when the body was read whole on a keep-alive connection, else closed
        (closing is also how an abandoned upstream request is cancelled)."""
        if self._done and self._keep_alive and not self._conn.closed and not self._conn.buffer:
            self._pool.give_back(self._conn)
        else:
            self._conn.close()


class HttpPool:
    """Kept-alive connections to one upstream ``http://host:port``."""

    def __init__(self, base_url: str, connect_timeout: float, keepalive_seconds: float = 4.0) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or parts.hostname is None:
            raise ValueError(f"upstream must be http://host:port, got {base_url!r}")
        self._host = parts.hostname
        self._port = parts.port or 80
        self._host_header = parts.netloc.encode()
        self._connect_timeout = connect_timeout
        self._keepalive = keepalive_seconds
        self._idle: list[_Connection] = []
        self._deadlines = _Deadlines()
        self.closed = False

    def give_back(self, conn: _Connection) -> None:
        if self.closed:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self._idle.append(conn)

    def _take_idle(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and now - conn.idle_since < self._keepalive:
                return conn
            conn.close()
        return None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(loop, self._deadlines), self._host, self._port
                )
        except OSError as error:
            raise UpstreamError(f"cannot connect to {self._host}:{self._port}: {error}") from None
        return conn

    async def post(
        self,
        path: str,
        body: bytes,
        headers: dict[str, str],
        first_byte_timeout: float,
        read_timeout: float,
        deadline: float,
    ) -> UpstreamResponse:
        """Send a POST and read the status line and headers; the body is read from the response."""
        head = [b"POST ", path.encode(), b" HTTP/1.1\r\nHost: ", self._host_header, b"\r\nContent-Length: ",
                str(len(body)).encode(), b"\r\n"]  # fmt: skip
        for name, value in headers.items():
            head += [name.encode(), b": ", value.encode("latin-1"), b"\r\n"]
        head.append(b"\r\n")
        request = b"".join(head) + body
        conn = self._take_idle()
        reused = conn is not None
        if conn is None:
            conn = await self._connect()
        conn.answered = False
        try:
            return await self._exchange(conn, request, first_byte_timeout, read_timeout, deadline)
        except UpstreamError:
            if not reused or conn.answered:
                raise  # a fresh connection failed, or the server had started answering: not stale
        # A kept-alive connection the server had just closed: once more on a fresh one.
        return await self._exchange(await self._connect(), request, first_byte_timeout, read_timeout, deadline)

    async def _exchange(
        self, conn: _Connection, request: bytes, first_byte_timeout: float, read_timeout: float, deadline: float
    ) -> UpstreamResponse:
        try:
            assert conn.transport is not None
            conn.transport.write(request)
            buffer = conn.buffer
            while True:
                end = buffer.find(b"\r\n\r\n")
                if end >= 0:
                    break
                await conn.wait_data(max(0.001, min(first_byte_timeout, deadline - time.monotonic())))
            lines = bytes(buffer[:end]).split(b"\r\n")
            del buffer[: end + 4]
            status_parts = lines[0].split(b" ", 2)
            if len(status_parts) < 2 or not status_parts[0].startswith(b"HTTP/1."):
                raise UpstreamError(f"not an HTTP/1.1 answer: {lines[0][:80]!r}")
            headers: dict[bytes, bytes] = {}
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                headers[name.strip().lower()] = value.strip()
            return UpstreamResponse(self, conn, int(status_parts[1]), headers, read_timeout, deadline)
        except BaseException:
            conn.close()
            raise

    async def close(self) -> None:
        self.closed = True
        self._deadlines.stop()
        for conn in self._idle:
            conn.close()
        self._idle.clear()
