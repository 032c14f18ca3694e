"""The cheapest possible stand-in for a vLLM worker, so a benchmark measures the router, not the worker.

A raw asyncio protocol (uvloop when installed) speaking just enough HTTP/1.1 keep-alive: a prefill
leg (``kv_transfer_params.do_remote_decode``) gets ``kv_transfer_params`` back at once; a decode or
aggregated request gets a fixed answer of ``--tokens`` tokens (when ``"stream": true``, SSE in chunked
encoding, one chunk per event, as vLLM sends it). No model time at all. Run several on consecutive
ports: ``python fake_worker.py --port 9100 --count 4``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal

_TOKENS = 8


def _sse_answer(tokens: int) -> bytes:
    """A streamed answer as vLLM (uvicorn) sends one: chunked, one chunk per server-sent event."""
    events = [
        b'data: {"id":"cmpl-1","object":"text_completion","created":0,"model":"m","choices":[{"index":0,"text":" t'
        + str(i).encode()
        + b'","logprobs":null,"finish_reason":null}]}\n\n'
        for i in range(tokens)
    ] + [b"data: [DONE]\n\n"]
    chunks = b"".join(b"%x\r\n%b\r\n" % (len(event), event) for event in events)
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    return head + chunks + b"0\r\n\r\n"


def _json_body(tokens: int) -> bytes:
    text = "".join(f" t{i}" for i in range(tokens))
    answer = {
        "id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 10, "completion_tokens": tokens, "total_tokens": 10 + tokens},
    }  # fmt: skip
    return json.dumps(answer, separators=(",", ":")).encode()


_PREFILL = json.dumps(
    {
        "id": "cmpl-p", "object": "text_completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "text": " t0", "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11},
        "kv_transfer_params": {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "fake-engine",
            "remote_block_ids": [1, 2], "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1,
        },
    },
    separators=(",", ":"),
).encode()  # fmt: skip
_MODELS = b'{"object":"list","data":[{"id":"m","object":"model","created":0,"owned_by":"fake"}]}'


def _response(status: bytes, content_type: bytes, body: bytes) -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\nContent-Type: " + content_type + b"\r\nContent-Length: "
        + str(len(body)).encode() + b"\r\nConnection: keep-alive\r\n\r\n" + body
    )  # fmt: skip


class FakeWorker(asyncio.Protocol):
    def __init__(self, sse: bytes, whole: bytes) -> None:
        self._buffer = b""
        self._sse = sse
        self._whole = _response(b"200 OK", b"application/json", whole)
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's transport is not a subclass

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while True:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self._buffer[:end].lower()
            length = 0
            at = head.find(b"content-length:")
            if at >= 0:
                stop = head.find(b"\r\n", at)
                length = int(head[at + 15 : stop if stop >= 0 else len(head)])
            total = end + 4 + length
            if len(self._buffer) < total:
                return
            body = self._buffer[end + 4 : total]
            self._buffer = self._buffer[total:]
            assert self._transport is not None
            self._transport.write(self._answer(head, body))

    def _answer(self, head: bytes, body: bytes) -> bytes:
        if head.startswith(b"get"):
            if b" /v1/models" in head[:40]:
                return _response(b"200 OK", b"application/json", _MODELS)
            return _response(b"200 OK", b"application/json", b"{}")
        if b'"do_remote_decode":true' in body or b'"do_remote_decode": true' in body:
            return _response(b"200 OK", b"application/json", _PREFILL)
        if b'"stream":true' in body or b'"stream": true' in body:
            return self._sse
        return self._whole


async def serve(host: str, port: int, count: int, tokens: int) -> None:
    loop = asyncio.get_running_loop()
    sse, whole = _sse_answer(tokens), _json_body(tokens)
    servers = [
        await loop.create_server(lambda: FakeWorker(sse, whole), host, port + i, backlog=4096) for i in range(count)
    ]
    print(json.dumps({"event": "ready", "urls": [f"http://{host}:{port + i}" for i in range(count)]}), flush=True)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    await stop.wait()
    for server in servers:
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9100)
    parser.add_argument("--count", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=_TOKENS)
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.run(serve(args.host, args.port, args.count, args.tokens))
    except ImportError:
        asyncio.run(serve(args.host, args.port, args.count, args.tokens))


if __name__ == "__main__":
    main()
