"""precise-prefix against simulated engines that publish vLLM's KV events: routing follows what each
engine's prefix cache really holds, through evictions, a worker restart, a lost publisher and gaps.

The router runs with no tokenizer, so it asks a worker's /tokenize for the token ids (exact by
construction); the simulators publish the same wire format as vLLM (tests/sim). Every wait polls
against a deadline: nothing here depends on how fast the machine is.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from splitserve.local.ports import free_port
from splitserve.router.app import Router
from splitserve.router.kv_feed import KvEventFeed
from splitserve.router.kv_index import KvBlockIndex, request_keys
from splitserve.router.policies import PrecisePrefix
from splitserve.sim import SimWorker, tokenize
from splitserve.sim.config import EngineLimits, KVEventsConfig
from splitserve.sim.kv_events import BlockStored, EventBatch
from testkit.router import router_config, running_router, sim_config
from tests.router.conftest import wait_until

BLOCK = 16
# Room for about three 200-token prompts: a few other prompts evict a family's blocks.
LIMITS = EngineLimits(block_size=BLOCK, num_kv_blocks=48, max_num_seqs=8, max_num_batched_tokens=1024,
                      max_model_len=700)  # fmt: skip
FAMILY = "Shared system prompt for the tenant: " + " ".join(f"rule{i}" for i in range(220))


def member(i: int) -> str:
    return f"{FAMILY} question {i}"


def events_worker(
    port: int = 0, events_port: int | None = None, replay: bool = False, role: str = "aggregated"
) -> SimWorker:
    events = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"tcp://*:{events_port or free_port()}",
        replay_endpoint=f"tcp://*:{free_port()}" if replay else None,
        topic="kv",
    )
    return SimWorker(sim_config(role, limits=LIMITS, kv_events=events, port=port))


async def complete(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int = 2) -> None:
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": max_tokens}
    async with session.post(url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()


def index_of(router: Router) -> KvBlockIndex:
    policy = router.decode.policy
    assert isinstance(policy, PrecisePrefix) and isinstance(policy.cache, KvBlockIndex)
    return policy.cache


def held(index: KvBlockIndex, worker: SimWorker, prompt: str) -> int:
    return index.matched_blocks(worker.url, request_keys(tokenize(prompt), BLOCK))


def served(worker: SimWorker) -> float:
    """Requests the engine finished (every test request stops at max_tokens)."""
    assert worker.engine is not None
    return float(worker.engine.metrics.request_success_length._value.get())


def mirrors(index: KvBlockIndex, worker: SimWorker) -> bool:
    """The index claims nothing the engine does not hold (events lag the engine a little, so poll this;
    the index may miss the second copy of a block the engine holds twice)."""
    assert worker.engine is not None
    return index.engine_hashes(worker.url) <= worker.engine.scheduler.pool.cached_hashes()


@contextlib.asynccontextmanager
async def precise_router(*workers: SimWorker) -> AsyncIterator[tuple[Router, str]]:
    config = router_config(decode_urls=tuple(w.url for w in workers), decode_policy="precise-prefix")
    async with running_router(config) as (router, url):
        await subscribed(index_of(router), *workers)
        yield router, url


async def subscribed(index: KvBlockIndex, *workers: SimWorker) -> None:
    """Until the index has heard from every worker: a SUB socket misses what was published before it
    joined (ZMQ's slow joiner), so probe each engine with a one-block prompt until its event arrives."""
    async with aiohttp.ClientSession() as session:
        for worker in workers:
            for probe in range(200):
                if index.has_events(worker.url):
                    break
                await complete(session, worker.url, f"probe {probe} " + " ".join(["p"] * BLOCK), max_tokens=1)
                await asyncio.sleep(0.02)
            assert index.has_events(worker.url), f"no KV events from {worker.url}"


async def test_routes_to_the_cached_worker_and_follows_its_evictions() -> None:
    async with events_worker() as a, events_worker() as b, precise_router(a, b) as (router, url):
        index = index_of(router)
        async with aiohttp.ClientSession() as session:
            await complete(session, a.url, member(0))  # warm A directly, behind the router's back
            await wait_until(lambda: held(index, a, member(1)) >= 10)
            before_a, before_b = served(a), served(b)
            for i in range(1, 7):
                await complete(session, url, member(i))
            assert (served(a) - before_a, served(b) - before_b) == (6, 0)

            # An eviction storm on A: distinct prompts fill its small cache and push the family out.
            for i in range(12):
                await complete(session, a.url, f"unrelated prompt {i} " + " ".join(f"w{i}x{j}" for j in range(200)))
            await wait_until(lambda: held(index, a, member(1)) == 0)
            await wait_until(lambda: mirrors(index, a))  # once the last events are in
            # B now holds the family: the router must send it there, not to A where it used to be.
            await complete(session, b.url, member(100))
            await wait_until(lambda: held(index, b, member(1)) >= 10)
            before_a, before_b = served(a), served(b)
            for i in range(7, 13):
                await complete(session, url, member(i))
            assert (served(a) - before_a, served(b) - before_b) == (0, 6)


async def test_a_restarted_worker_loses_its_entries_and_no_request_fails() -> None:
    events_port = free_port()
    async with events_worker() as b:
        a = events_worker(events_port=events_port)
        await a.start()
        a_port = a.port
        try:
            async with precise_router(a, b) as (router, url):
                index = index_of(router)
                async with aiohttp.ClientSession() as session:
                    await complete(session, a.url, member(0))
                    await wait_until(lambda: held(index, a, member(1)) >= 10)

                    stop = asyncio.Event()

                    async def traffic() -> int:
                        sent = 0
                        while not stop.is_set():
                            await complete(session, url, member(1000 + sent))  # asserts 200
                            sent += 1
                        return sent

                    load = asyncio.create_task(traffic())
                    await a.stop()  # the engine and its cache are gone
                    await wait_until(lambda: held(index, a, member(1)) == 0)
                    a = events_worker(port=a_port, events_port=events_port)
                    await a.start()  # same ports, empty cache, sequence numbers from 0 again
                    await wait_until(lambda: router.decode.has_healthy_except({b.url}), within=10)
                    stop.set()
                    assert await load > 0
                    # The index rebuilds from the new engine's events, and only from them.
                    await subscribed(index, a)
                    await wait_until(lambda: mirrors(index, a))  # once the last events are in
        finally:
            await a.stop()


async def test_a_lost_publisher_drops_its_entries_until_it_comes_back() -> None:
    async with events_worker() as a, events_worker() as b, precise_router(a, b) as (router, url):
        index = index_of(router)
        async with aiohttp.ClientSession() as session:
            await complete(session, a.url, member(0))
            await wait_until(lambda: held(index, a, member(1)) >= 10)
            await a.close_kv_events()  # the port closes; the engine keeps serving
            await wait_until(lambda: not index.has_events(a.url), within=10)
            for i in range(1, 5):  # routed by load meanwhile, and served
                await complete(session, url, member(i))
            a.reopen_kv_events()
            await subscribed(index, a)
            await wait_until(lambda: mirrors(index, a))  # once the last events are in


def queried(worker: SimWorker) -> float:
    """Prompt tokens the engine looked up in its prefix cache: it computed a prompt when this grows."""
    assert worker.engine is not None
    return float(worker.engine.metrics.prefix_cache_queries._value.get())


async def test_the_prefill_pool_is_routed_by_its_own_events_and_follows_a_cache_reset() -> None:
    prefill_a, prefill_b = events_worker(role="prefill"), events_worker(role="prefill")
    async with prefill_a as a, prefill_b as b, SimWorker(sim_config("decode", limits=LIMITS)) as decode:
        config = router_config(prefill_urls=(a.url, b.url), decode_urls=(decode.url,),
                               prefill_policy="precise-prefix", decode_policy="least-loaded")  # fmt: skip
        async with running_router(config) as (router, url), aiohttp.ClientSession() as session:
            policy = router.prefill.policy
            assert isinstance(policy, PrecisePrefix) and isinstance(policy.cache, KvBlockIndex)
            index = policy.cache
            await subscribed(index, a, b)
            await complete(session, url, member(0))  # through the router: a prefill worker computes it
            await wait_until(lambda: held(index, a, member(1)) + held(index, b, member(1)) >= 10)
            holder, other = (a, b) if held(index, a, member(1)) else (b, a)
            before = queried(holder), queried(other)
            for i in range(1, 6):
                await complete(session, url, member(i))
            assert queried(other) == before[1], "a family member was prefilled where its prefix is not cached"
            assert queried(holder) > before[0]

            # The holder's cache is reset (AllBlocksCleared): the index forgets it, the other worker
            # gets the family next, and from then on keeps it.
            async with session.post(holder.url + "/reset_prefix_cache") as reset:
                assert (await reset.json())["success"] is True
            await wait_until(lambda: held(index, holder, member(1)) == 0)
            before = queried(holder), queried(other)
            await complete(session, other.url, member(50))  # warm the other one directly
            await wait_until(lambda: held(index, other, member(1)) >= 10)
            for i in range(6, 10):
                await complete(session, url, member(i))
            assert queried(holder) == before[0]


# ---- gaps, with a scripted publisher --------------------------------------------------------


class ScriptedPublisher:
    """A vLLM-shaped publisher whose batches the test chooses, to make a gap happen on purpose."""

    def __init__(self, replay: bool) -> None:
        self.context = zmq.asyncio.Context()
        self.pub = self.context.socket(zmq.PUB)
        self.endpoint_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.replay = self.context.socket(zmq.ROUTER) if replay else None
        self.replay_port = self.replay.bind_to_random_port("tcp://127.0.0.1") if self.replay else None
        self.buffer: list[tuple[int, bytes]] = []

    def sources(self) -> dict[str, Any]:
        replay = f"tcp://*:{self.replay_port}" if self.replay_port else None
        return {"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{self.endpoint_port}",
                      "replay_endpoint": replay, "topic": "kv"}}  # fmt: skip

    async def send(self, seq: int, tokens: list[int], parent: int | None, hashes: list[int], wire: bool = True) -> None:
        event = BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=4,
                            lora_id=None, medium="GPU", lora_name=None)  # fmt: skip
        payload = msgspec.msgpack.encode(EventBatch(ts=0.0, events=[event]))
        self.buffer.append((seq, payload))
        if wire:
            await self.pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])

    async def serve_replay(self) -> None:
        assert self.replay is not None
        while True:
            client, _, start = await self.replay.recv_multipart()
            for seq, payload in self.buffer:
                if seq >= int.from_bytes(start, "big"):
                    await self.replay.send_multipart([client, b"", b"kv", seq.to_bytes(8, "big"), payload])
            await self.replay.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self.context.destroy(linger=0)


@pytest.mark.parametrize("replay", [True, False])
async def test_a_sequence_gap_is_replayed_or_the_worker_is_rebuilt(replay: bool) -> None:
    publisher = ScriptedPublisher(replay)
    app = web.Application()

    async def sources(request: web.Request) -> web.Response:  # aiohttp deprecates plain functions as handlers
        return web.json_response(publisher.sources())

    app.router.add_get("/kv_event_sources", sources)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    worker = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    index = KvBlockIndex()
    feed = KvEventFeed(index, retry_seconds=0.1)
    replayer = asyncio.create_task(publisher.serve_replay()) if replay else None
    tokens = list(range(100, 112))
    try:
        feed.watch(worker)
        seq = 0

        async def joined() -> bool:  # a SUB socket misses what is sent before it joins: probe until seen
            nonlocal seq
            await publisher.send(seq, tokens[:4], None, [1])
            seq += 1
            await asyncio.sleep(0.05)
            return index.blocks_held(worker) == 1

        for _ in range(100):
            if await joined():
                break
        assert index.blocks_held(worker) == 1
        replayed_before = feed.gaps_replayed  # joining late may itself have been replayed
        await publisher.send(seq, tokens[4:8], 1, [2], wire=False)  # lost on the wire
        await publisher.send(seq + 1, tokens[8:12], 2, [3])
        keys = request_keys(tokens, 4)
        if replay:
            await wait_until(lambda: index.matched_blocks(worker, keys) == 3)
            assert feed.gaps_replayed == replayed_before + 1
        else:
            # Without replay the worker's entries are dropped; block 3's parent is then unknown, so it is
            # not indexed either: an empty index routes by load, never to blocks that are not there.
            await wait_until(lambda: feed.resets >= 1)
            assert index.matched_blocks(worker, keys) == 0
    finally:
        if replayer is not None:
            replayer.cancel()
        await feed.close()
        publisher.close()
        await runner.cleanup()
