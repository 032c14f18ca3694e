"""Keeps a :class:`KvBlockIndex` in step with every worker's KV-event publisher (the I/O side).

For each worker the pool knows, one task:
1. asks the worker where it publishes (``GET /kv_event_sources``, vLLM's own endpoint), taking
   the host from the worker's URL when the publisher binds ``*``; an explicit override wins;
2. subscribes (ZMQ SUB) and applies every batch to the index, checking the sequence numbers:
   - a gap is filled from the worker's replay socket when it has one; when it has none, or the
     replay no longer covers the gap, the worker's entries are dropped and rebuilt from new events;
   - a sequence number that goes back means the engine restarted: its old entries are dropped;
3. watches the connection (ZMQ socket monitor): when the publisher goes away (the process died, the
   port closed) the worker's entries are dropped at once, and routing falls back to load for it
   until events flow again. ZMQ reconnects by itself.
A worker that leaves discovery is unwatched and forgotten. Nothing here can fail a request: the
worst case of any fault is a worker whose cache looks empty.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from splitserve.router.kv_events import REPLAY_END, EventBatch, MalformedEvent, decode_batch, decode_seq
from splitserve.router.kv_index import KvBlockIndex

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EventSource:
    endpoint: str
    replay_endpoint: str | None
    topic: str


class NotPublishing(Exception):
    """The worker answers, but publishes no KV events (or says nothing about them)."""


def resolve_endpoint(endpoint: str, worker_url: str) -> str:
    """A bind address as a subscriber reaches it: ``*`` (and the any-addresses) become the worker's host."""
    if not endpoint.startswith("tcp://"):
        return endpoint  # ipc:// and inproc:// are only reachable as they are
    host_port = endpoint[len("tcp://") :]
    host, _, port = host_port.rpartition(":")
    if host in ("*", "0.0.0.0", "[::]", "::", ""):
        worker_host = urllib.parse.urlsplit(worker_url).hostname or "127.0.0.1"
        if ":" in worker_host:
            worker_host = f"[{worker_host}]"
        return f"tcp://{worker_host}:{port}"
    return endpoint


def parse_sources(body: object, worker_url: str) -> list[EventSource]:
    """Event sources from a ``/kv_event_sources`` answer (one entry per data-parallel rank)."""
    if not isinstance(body, dict) or not body:
        raise NotPublishing("no KV event sources")
    sources: list[EventSource] = []
    for config in body.values():
        if not isinstance(config, dict) or not config.get("enable_kv_cache_events"):
            continue
        if config.get("publisher", "zmq") != "zmq" or not config.get("endpoint"):
            continue
        replay = config.get("replay_endpoint")
        sources.append(
            EventSource(
                endpoint=resolve_endpoint(str(config["endpoint"]), worker_url),
                replay_endpoint=resolve_endpoint(str(replay), worker_url) if replay else None,
                topic=str(config.get("topic") or ""),
            )
        )
    if not sources:
        raise NotPublishing("KV cache events are off (start vLLM with --kv-events-config)")
    return sources


class KvEventFeed:
    def __init__(
        self,
        index: KvBlockIndex,
        *,
        overrides: Mapping[str, str] | None = None,
        retry_seconds: float = 2.0,
        replay_timeout: float = 2.0,
    ) -> None:
        self.index = index
        self._overrides = {k.rstrip("/"): v for k, v in (overrides or {}).items()}
        self._retry = retry_seconds
        self._replay_timeout = replay_timeout
        self._context = zmq.asyncio.Context()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._session: aiohttp.ClientSession | None = None
        # Counted for /metrics and tests: how the feed has recovered, and how far it has read.
        self.gaps_replayed = 0
        self.resets = 0
        self.last_seq: dict[str, int] = {}  # per worker: the newest batch applied (any DP rank)

    def watch(self, worker_url: str) -> None:
        url = worker_url.rstrip("/")
        if url not in self._tasks:
            self._tasks[url] = asyncio.get_running_loop().create_task(self._follow(url), name=f"kv-events {url}")

    def unwatch(self, worker_url: str) -> None:
        url = worker_url.rstrip("/")
        task = self._tasks.pop(url, None)
        if task is not None:
            task.cancel()
        self._forget(url)

    def _forget(self, url: str) -> None:
        """Drop what the index knows of a worker, and how far its stream was read, together."""
        self.index.forget(url)
        self.last_seq.pop(url, None)

    @property
    def watched(self) -> list[str]:
        return sorted(self._tasks)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._session is not None:
            await self._session.close()
        self._context.destroy(linger=0)

    # ---- one worker -------------------------------------------------------------------------

    async def _follow(self, url: str) -> None:
        quiet = False  # log a worker without events once, not every retry
        while True:
            try:
                sources = await self._sources(url)
                quiet = False
                await self._stream(url, sources)
            except asyncio.CancelledError:
                raise
            except NotPublishing as why:
                if not quiet:
                    log.warning("%s publishes no KV events (%s): precise-prefix routes it by load", url, why)
                    quiet = True
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as error:
                log.debug("KV event sources of %s unavailable: %s", url, error)
            except Exception:  # the feed must outlive anything one worker sends
                log.exception("KV event feed of %s failed; retrying", url)
            self._forget(url)
            await asyncio.sleep(self._retry)

    async def _sources(self, url: str) -> list[EventSource]:
        override = self._overrides.get(url)
        if override:
            return [EventSource(resolve_endpoint(override, url), None, "")]
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0))
        async with self._session.get(url + "/kv_event_sources") as response:
            if response.status == 404:
                raise NotPublishing("GET /kv_event_sources answered 404")
            response.raise_for_status()
            return parse_sources(await response.json(content_type=None), url)

    async def _stream(self, url: str, sources: list[EventSource]) -> None:
        """Apply every source's batches until one of them disconnects (then return)."""
        followers = [_Follower(self, url, source) for source in sources]
        try:
            tasks = [asyncio.ensure_future(f.run()) for f in followers]
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            for task in done:
                task.result()  # re-raise what ended it
        finally:
            for follower in followers:
                follower.close()


class _Follower:
    """One SUB socket (one data-parallel rank) of one worker."""

    def __init__(self, feed: KvEventFeed, url: str, source: EventSource) -> None:
        self._feed = feed
        self._url = url
        self._source = source
        self._sub = feed._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt_string(zmq.SUBSCRIBE, source.topic)
        self._monitor = self._sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._sub.connect(source.endpoint)
        self._last_seq: int | None = None

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._sub.disable_monitor()
        self._monitor.close(linger=0)
        self._sub.close(linger=0)

    async def run(self) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(self._sub, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        connected_once = False
        while True:
            ready = dict(await poller.poll())
            if self._monitor in ready:
                event = parse_monitor_message(await self._monitor.recv_multipart())
                if event["event"] == zmq.EVENT_CONNECTED:
                    connected_once = True
                    log.info("subscribed to KV events of %s at %s", self._url, self._source.endpoint)
                elif event["event"] == zmq.EVENT_DISCONNECTED and connected_once:
                    log.warning("KV event publisher of %s went away: dropping its cache entries", self._url)
                    return  # the caller forgets the worker and starts over
            if self._sub in ready:
                frames = await self._sub.recv_multipart()
                if len(frames) != 3:
                    log.warning("KV event message of %s has %d frames, expected 3", self._url, len(frames))
                    continue
                try:
                    batch = decode_batch(decode_seq(frames[1]), frames[2])
                except MalformedEvent as error:
                    log.warning("malformed KV event batch from %s: %s", self._url, error)
                    self._reset("malformed batch")
                    continue
                await self._receive(batch)

    async def _receive(self, batch: EventBatch) -> None:
        feed, url, last = self._feed, self._url, self._last_seq
        if last is not None and batch.seq <= last:
            # Sequence numbers restart with the engine: what we knew of its cache is gone.
            self._reset(f"sequence went back from {last} to {batch.seq} (engine restart)")
            last = None
        expected = 0 if last is None else last + 1
        # A first batch after 0 only says we subscribed late: without a replay socket there is
        # nothing to undo (orphaned blocks are skipped), but a gap mid-stream loses removals.
        missed = batch.seq > expected and not await self._replay(expected, batch.seq)
        if missed and (last is not None or self._source.replay_endpoint):
            self._reset(f"missed batches {expected}..{batch.seq - 1}")
        feed.index.apply(url, batch.events)
        self._last_seq = batch.seq
        feed.last_seq[url] = batch.seq

    def _reset(self, why: str) -> None:
        log.info("rebuilding the KV index of %s: %s", self._url, why)
        self._feed.resets += 1
        self._feed._forget(self._url)
        self._last_seq = None

    async def _replay(self, start: int, stop: int) -> bool:
        """Apply batches [start, stop) from the replay socket; False when they cannot all be had."""
        endpoint = self._source.replay_endpoint
        if endpoint is None:
            return False
        socket = self._feed._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        try:
            socket.connect(endpoint)
            await socket.send_multipart((b"", start.to_bytes(8, "big")))
            batches: list[EventBatch] = []
            while True:
                frames = await asyncio.wait_for(socket.recv_multipart(), self._feed._replay_timeout)
                if len(frames) != 4:
                    return False
                seq = decode_seq(frames[2])
                if seq == REPLAY_END:
                    break
                if start <= seq < stop:
                    batches.append(decode_batch(seq, frames[3]))
        except (TimeoutError, zmq.ZMQError, MalformedEvent) as error:
            log.info("KV event replay from %s failed: %s", endpoint, error)
            return False
        finally:
            socket.close(linger=0)
        if [b.seq for b in batches] != list(range(start, stop)):
            return False  # the replay buffer no longer reaches back that far
        for replayed in batches:
            self._feed.index.apply(self._url, replayed.events)
        self._feed.gaps_replayed += 1
        return True
