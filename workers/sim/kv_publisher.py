"""Publishes KV-cache event batches over ZMQ exactly as vLLM's ``ZmqEventPublisher`` does.

Wire format (vLLM 0.32, ``vllm/distributed/kv_events.py``):

* PUB socket, one message per engine step that produced events: three frames
  ``[topic, seq, payload]``; ``seq`` counts from 0 per process as 8 bytes big-endian, ``payload``
  is the msgpack of a ``KVEventBatch`` (see ``kv_events.py``).
* Optional ROUTER replay socket: a client (REQ, or DEALER sending an empty delimiter) sends a start
  seq as 8 bytes big-endian and gets every buffered batch with ``seq >= start`` as
  ``[topic, seq, payload]``, then ``[b"", seq -1 (8 bytes, signed), b""]``. The last
  ``buffer_steps`` batches are kept.

Encoding and sending run on one daemon thread fed by a bounded queue, so the asyncio engine loop
only enqueues. Where vLLM blocks its scheduler when that queue is full, the simulator drops the
batch and counts it (``dropped``): a simulator must never stall its event loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from itertools import count

import msgspec
import zmq

from splitserve.sim.config import KVEventsConfig
from splitserve.sim.kv_events import EventBatch

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The seq frame that ends a replay."""
SHUTDOWN_TIMEOUT_S = 1.0
_POLL_S = 0.1  # how long the thread waits for a batch before looking at the replay socket again


class KVEventsBindError(OSError):
    """A KV-events endpoint could not be bound or connected (port in use, bad address)."""


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM binds wildcard and ipc/inproc endpoints and connects to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """PUB (+ optional ROUTER replay) publisher; construct binds at once, ``shutdown`` closes."""

    def __init__(self, config: KVEventsConfig, host: str = "127.0.0.1", data_parallel_rank: int = 0) -> None:
        self._dp_rank = data_parallel_rank
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode("utf-8")
        self._seq = count()
        self.dropped = 0
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub: zmq.Socket[bytes] = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.set_hwm(config.hwm)
            if is_bind_endpoint(config.endpoint):
                endpoint = _bind(self._pub, config.endpoint, host)
            else:
                self._pub.connect(config.endpoint)
                endpoint = config.endpoint
            replay_endpoint = None
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                replay_endpoint = _bind(self._replay, config.replay_endpoint, host)
        except zmq.ZMQError as error:
            self._close_sockets()
            raise KVEventsBindError(f"cannot open KV events endpoint: {error}") from error
        # What GET /kv_event_sources reports: the config with the endpoints actually bound.
        self.config = dataclasses.replace(config, endpoint=endpoint, replay_endpoint=replay_endpoint)
        self._running = True
        self._thread = threading.Thread(target=self._run, daemon=True, name="sim-kv-events")
        self._thread.start()

    def publish(self, batch: EventBatch) -> None:
        """Queue ``batch`` for sending (never blocks); the publisher stamps its DP rank like vLLM's."""
        if not self._running:
            raise RuntimeError("the KV events publisher is closed")
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self._dp_rank
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1
            log.warning("KV events queue full; dropped a batch (%d so far)", self.dropped)

    def shutdown(self) -> None:
        """Send what is queued (up to about a second), stop the thread and close the sockets.

        Blocking: call it from a thread (``asyncio.to_thread``) when an event loop is running.
        """
        if not self._running:
            return
        self._running = False
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
        while not self._queue.empty() and time.monotonic() < deadline:
            time.sleep(0.01)
        # The sentinel wakes the thread at once; if the queue is still full the thread stops anyway
        # once it has sent what is queued, since _running is False.
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
        self._thread.join(SHUTDOWN_TIMEOUT_S)
        if self._thread.is_alive():
            log.warning("KV events publisher thread did not stop in %.1f s", SHUTDOWN_TIMEOUT_S)
            return  # the thread still owns the sockets; they close with the process
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    # --- the publisher thread (the only user of the sockets once started) ----------------------

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while self._running or not self._queue.empty():
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except zmq.ZMQError:
                    log.exception("KV events replay failed")
            try:
                batch = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if batch is None:
                break
            try:
                seq = next(self._seq)
                payload = encoder.encode(batch)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
            except zmq.ZMQError:
                log.exception("KV events publishing failed")
                time.sleep(_POLL_S)  # as vLLM: back off instead of spinning on a broken socket

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("invalid KV events replay request: %d frames", len(frames))
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


def _bind(socket: zmq.Socket[bytes], endpoint: str, host: str) -> str:
    """Bind ``endpoint``; ``tcp://*:0`` binds a free port on ``host`` and returns the bound address.

    vLLM binds ``tcp://*:0`` on the node's IP (VLLM_HOST_IP); the simulator's node IP is the host it
    advertises in kv_transfer_params.
    """
    if endpoint != "tcp://*:0":
        socket.bind(endpoint)
        return endpoint
    if ":" in host:
        socket.setsockopt(zmq.IPV6, 1)
        host = f"[{host}]"
    socket.bind(f"tcp://{host}:0")
    bound = socket.getsockopt_string(zmq.LAST_ENDPOINT)
    return f"tcp://{host}:{bound.rsplit(':', 1)[1]}"
