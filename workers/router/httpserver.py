"""The router's HTTP/1.1 server: an asyncio protocol on httptools (llhttp, the parser of Node.js).

Why not aiohttp's server: at saturation it was most of the router's CPU per request (Request and
StreamResponse objects, middleware chain, multidicts, access-log hooks), and it made the router cost
twice vLLM's Rust router per request (benchmarks/router/README.md has the profiles). This server does
what the router needs and nothing more:

* keep-alive and pipelining (one request at a time per connection, answered in order),
  ``Expect: 100-continue``, chunked request bodies, HEAD for every GET route;
* limits: the request body (413 as soon as the Content-Length or the bytes received pass it), the
  request head (431), idle connections (closed after ``idle_timeout``, which also ends slow heads);
* handler cancellation: when the client goes away its handler task is cancelled, and with it the
  upstream calls (as aiohttp's ``handler_cancellation=True`` did);
* write backpressure: a slow reader pauses the writer (``await request.write``), never the loop;
* errors: every refusal is OpenAI-style JSON (``errors.RouterError``); a handler's unexpected
  exception is logged and answered 500, and a failure after a stream started closes the connection.

Handlers are ``async def handler(request: Request) -> None`` and answer through ``request``:
``respond(...)`` for a whole answer, or ``start_stream(...)``, ``write(...)`` and ``finish(...)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping

import httptools
import orjson

from splitserve.router import errors

log = logging.getLogger(__name__)

Handler = Callable[["Request"], Awaitable[None]]

_MAX_HEAD_BYTES = 64 * 1024
_REASONS = {status.value: status.phrase.encode() for status in http.HTTPStatus}
_REASONS[499] = b"Client Closed Request"


_INTERNAL_ERROR = errors.RouterError(500, "Internal router error.", "internal_error", error_type="server_error")


class ClientGone(Exception):
    """The client closed its connection while the answer was being written."""


def _status_line(status: int) -> bytes:
    return b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))


def _answer_head(
    status: int, headers: Mapping[str, str] | None, framing: bytes, date_line: bytes, close: bool
) -> bytes:
    """Status line, Date, ``headers``, ``framing`` (Content-Type and the length or chunked lines) and,
    when the connection ends after this answer, ``Connection: close``."""
    extra = _header_lines(headers) if headers else b""
    return _status_line(status) + date_line + extra + framing + (b"Connection: close\r\n\r\n" if close else b"\r\n")


def _header_lines(headers: Mapping[str, str]) -> bytes:
    lines = (b"%s: %s\r\n" % (name.encode("latin-1"), value.encode("latin-1")) for name, value in headers.items())
    return b"".join(lines)


class _Clock:
    """The Date header, formatted once a second at most."""

    def __init__(self) -> None:
        self._second = -1
        self._line = b""

    def date_line(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._line = b"Date: " + time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(now)).encode() + b"\r\n"
        return self._line


class Request:
    """One request and the way to answer it. ``headers`` has lower-case names."""

    __slots__ = (
        "_conn",
        "body",
        "finished",
        "headers",
        "keep_alive",
        "method",
        "path",
        "query",
        "started",
        "status",
    )  # fmt: skip

    def __init__(
        self, conn: _Connection, method: str, path: str, query: str, headers: dict[str, str], body: bytes, keep: bool
    ) -> None:
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers
        self.body = body
        self.keep_alive = keep
        self.started = False  # the status line went out
        self.finished = False  # the whole answer went out
        self.status = 0
        self._conn = conn

    def _head(self, status: int, headers: Mapping[str, str] | None, framing: bytes) -> bytes:
        server = self._conn.server
        if server.closing:
            self.keep_alive = False
        return _answer_head(status, headers, framing, server.clock.date_line(), close=not self.keep_alive)

    def respond(
        self,
        status: int,
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
        content_type: str | None = "application/json",
    ) -> None:
        """The whole answer at once (Content-Length framed)."""
        if self.started:
            raise RuntimeError("response already started")
        self.started = self.finished = True
        self.status = status
        framing = b"Content-Length: %d\r\n" % len(body)
        if content_type is not None and not (headers and "Content-Type" in headers):
            framing = b"Content-Type: " + content_type.encode("latin-1") + b"\r\n" + framing
        head = self._head(status, headers, framing)
        self._conn.send(head if self.method == "HEAD" else head + body)
        self._conn.request_done(self)

    def respond_json(self, payload: object, status: int = 200, headers: Mapping[str, str] | None = None) -> None:
        self.respond(status, orjson.dumps(payload), headers)

    def respond_error(self, error: errors.RouterError) -> None:
        self.respond(error.status, error.body(), error.headers)

    def start_stream(
        self, status: int, headers: Mapping[str, str], first: bytes = b"", framed: bool = False, end: bool = False
    ) -> None:
        """Send the head of a chunked answer, with ``first`` as its first chunk (or, with ``framed``,
        bytes already in chunked framing, passed through as they are). ``end``: ``first`` is all there
        is, and the answer ends with it: head, body and end in one write."""
        if self.started:
            raise RuntimeError("response already started")
        self.started = True
        self.status = status
        head = self._head(status, headers, b"Transfer-Encoding: chunked\r\n")
        body = first if framed or not first else b"%x\r\n%b\r\n" % (len(first), first)
        if end and not framed:
            body += b"0\r\n\r\n"
        self._conn.send(head + body)
        if end:
            self.finished = True
            self._conn.request_done(self)

    async def write(self, data: bytes, framed: bool = False) -> None:
        """One more piece of a streamed answer; waits while the client reads slower than we write.
        ``framed``: ``data`` is already whole chunks of chunked encoding."""
        conn = self._conn
        if conn.closed:
            raise ClientGone
        if data:
            conn.send(data if framed else b"%x\r\n%b\r\n" % (len(data), data))
        if conn.write_paused:
            await conn.drain()

    async def finish(self, data: bytes = b"", framed: bool = False) -> None:
        """The last piece of a streamed answer and its end (``framed``: ``data`` already holds the end)."""
        conn = self._conn
        if conn.closed:
            raise ClientGone
        conn.send(data if framed else (b"%x\r\n%b\r\n" % (len(data), data) if data else b"") + b"0\r\n\r\n")
        self.finished = True
        conn.request_done(self)
        if conn.write_paused:
            await conn.drain()


class _Connection(asyncio.Protocol):
    """One client connection: parses requests with httptools and runs one handler at a time."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.closed = False
        self.write_paused = False
        self.last_active = time.monotonic()
        self._drain: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._current: Request | None = None
        self._pending: deque[Request] = deque()
        # The request being parsed.
        self._url = b""
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._body_size = 0
        self._head_size = 0
        self._refused = False

    # ---- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transport is not a subclass
        self.server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        self.last_active = time.monotonic()
        if self._refused:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(errors.bad_request("Protocol upgrades are not supported.", code="invalid_request"))
        except httptools.HttpParserError as error:
            if not self._refused:
                self._refuse(errors.bad_request(f"Malformed HTTP request: {error}", code="invalid_http"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        task = self._task
        if task is not None and not task.done():
            task.cancel()  # the client left: stop its upstream work too

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    # ---- httptools callbacks ------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = {}
        self._body = []
        self._body_size = 0
        self._head_size = 0

    def _head_fits(self, more: int) -> bool:
        """Count ``more`` bytes of the request head; refuse the request (431) once it is too large."""
        self._head_size += more
        if self._head_size <= _MAX_HEAD_BYTES:
            return True
        self._refuse(errors.RouterError(431, "Request head too large.", "headers_too_large"))
        return False

    def on_url(self, url: bytes) -> None:
        if self._head_fits(len(url)):
            self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._head_fits(len(name) + len(value)):
            self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        length = self._headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.server.max_body_bytes:
            self._refuse(errors.too_large(self.server.max_body_bytes))
            return
        if self._headers.get("expect", "").lower() == "100-continue" and self._current is None:
            self.send(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self._refused:
            return
        self._body_size += len(body)
        if self._body_size > self.server.max_body_bytes:
            self._refuse(errors.too_large(self.server.max_body_bytes))
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        url = self._url
        path, _, query = url.partition(b"?")
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        request = Request(self, self.parser.get_method().decode("latin-1"), path.decode("latin-1"),
                          query.decode("latin-1"), self._headers, body, self.parser.should_keep_alive())  # fmt: skip
        if self._current is None:
            self._start(request)
        else:
            # Pipelined: answered after the one in flight; read no further until then.
            self._pending.append(request)
            if self.transport is not None:
                self.transport.pause_reading()

    # ---- requests -----------------------------------------------------------------------------

    def _refuse(self, error: errors.RouterError) -> None:
        """Answer an unreadable request and close: the rest of the byte stream cannot be trusted."""
        self._refused = True
        if self._current is None and self.transport is not None and not self.closed:
            body = error.body()
            framing = b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
            self.send(
                _answer_head(error.status, error.headers, framing, self.server.clock.date_line(), close=True) + body
            )
            # Half-close and keep reading (discarding) for a moment: closing with the client's body still
            # arriving would reset the connection, and the client would never read the answer.
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.server.loop.call_later(1.0, self.close)
        else:
            self.close()

    def _start(self, request: Request) -> None:
        self._current = request
        handler = self.server.route(request)
        self._task = self.server.loop.create_task(self._run(handler, request))

    async def _run(self, handler: Handler, request: Request) -> None:
        try:
            await handler(request)
            if not request.started:
                raise RuntimeError(f"handler of {request.path} sent no answer")
        except (ClientGone, asyncio.CancelledError):
            self.close()
        except Exception as error:
            if not isinstance(error, errors.RouterError):
                log.exception("unhandled error on %s %s", request.method, request.path)
                error = _INTERNAL_ERROR
            if request.started:
                self.close()  # the answer is under way: a closed connection is the only error left to give
            else:
                request.respond_error(error)
        else:
            if not request.finished:
                self.close()  # a stream left unfinished: closing is how the client learns it is incomplete

    def request_done(self, request: Request) -> None:
        """The answer to ``request`` went out whole: close, or go on with the next request."""
        if request is not self._current:
            return
        self._current = None
        self._task = None
        self.last_active = time.monotonic()
        if not request.keep_alive:
            self.close()
            return
        if self._pending:
            self._start(self._pending.popleft())
            if not self._pending and self.transport is not None and not self.closed:
                self.transport.resume_reading()

    @property
    def idle(self) -> bool:
        return self._current is None and not self._pending

    # ---- the socket ---------------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        if not self.closed and self.transport is not None:
            self.transport.write(data)

    async def drain(self) -> None:
        if self.closed:
            raise ClientGone
        if self._drain is None or self._drain.done():
            self._drain = self.server.loop.create_future()
        await self._drain
        if self.closed:
            raise ClientGone

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()


class HttpServer:
    """Routes (path -> method -> handler) served on one listening socket."""

    def __init__(
        self,
        routes: Mapping[str, Mapping[str, Handler]],
        max_body_bytes: int,
        idle_timeout: float = 75.0,
    ) -> None:
        self.routes = {path: dict(methods) for path, methods in routes.items()}
        for methods in self.routes.values():
            if "GET" in methods:
                methods.setdefault("HEAD", methods["GET"])
        self.max_body_bytes = max_body_bytes
        self.idle_timeout = idle_timeout
        self.connections: set[_Connection] = set()
        self.clock = _Clock()
        self.closing = False
        self.loop = asyncio.get_running_loop()
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None

    def route(self, request: Request) -> Handler:
        methods = self.routes.get(request.path)
        if methods is None:
            return _not_found
        handler = methods.get(request.method)
        if handler is None:
            allowed = ", ".join(sorted(methods))
            return _method_not_allowed(allowed)
        return handler

    async def listen(self, host: str, port: int, reuse_port: bool = False, backlog: int = 2048) -> int:
        """Start accepting; returns the port (useful with port 0)."""
        self._server = await self.loop.create_server(
            lambda: _Connection(self), host, port, backlog=backlog, reuse_address=True, reuse_port=reuse_port or None
        )
        self._sweeper = self.loop.create_task(self._sweep_idle())
        return int(self._server.sockets[0].getsockname()[1])

    async def _sweep_idle(self) -> None:
        # One timer for all connections instead of one per request.
        period = max(0.05, min(5.0, self.idle_timeout / 4))
        while True:
            await asyncio.sleep(period)
            limit = time.monotonic() - self.idle_timeout
            for conn in [c for c in self.connections if c.idle and c.last_active < limit]:
                conn.close()

    def stop_accepting(self) -> None:
        """Close the listening socket; open connections keep being served, each closed after its
        current answer (``Connection: close``)."""
        self.closing = True
        if self._server is not None:
            self._server.close()
        for conn in [c for c in self.connections if c.idle]:
            conn.close()

    async def close(self) -> None:
        """Close every connection (cancelling what is still running) and stop."""
        self.stop_accepting()
        for conn in list(self.connections):
            conn.close()
            task = conn._task
            if task is not None and not task.done():
                task.cancel()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        if self._server is not None:
            await self._server.wait_closed()


async def _not_found(request: Request) -> None:
    request.respond_error(errors.RouterError(404, "Not Found", "not_found"))


def _method_not_allowed(allowed: str) -> Handler:
    async def handler(request: Request) -> None:
        error = errors.RouterError(405, "Method Not Allowed", "method_not_allowed", headers={"Allow": allowed})
        request.respond_error(error)

    return handler
