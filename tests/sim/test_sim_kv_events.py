"""KV-cache events: the pool records vLLM's events, the worker publishes them in vLLM's wire format.

The pool and scheduler tests are pure. The worker tests read the ZMQ sockets with a decoder written
here from vLLM's format (three frames: topic, 8-byte big-endian seq, msgpack ``[ts, [event, ...],
dp_rank]`` with tagged-map events), not with the simulator's own structs, so they check the bytes.
Every wait polls with a deadline; nothing sleeps and hopes.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio
from hypothesis import given
from hypothesis import strategies as st
from sim_helpers import fast_config, post

from splitserve.sim import SimWorker, tokenize
from splitserve.sim.cli import config_from_args, configure
from splitserve.sim.config import EngineLimits, KVEventsConfig, LatencyModel
from splitserve.sim.kv import KVBlockPool
from splitserve.sim.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from splitserve.sim.scheduler import Scheduler, Sequence
from splitserve.sim.tokens import HASH_MASK, block_hashes

DEADLINE_S = 10.0


# --- a standalone decoder of vLLM's KV-event messages -----------------------------------------------


@dataclass(frozen=True)
class Message:
    topic: bytes
    seq: int
    ts: float
    events: list[dict[str, Any]]
    dp_rank: int | None


def decode_message(frames: list[bytes]) -> Message:
    topic, seq, payload = frames
    assert len(seq) == 8
    batch = msgspec.msgpack.decode(payload)
    assert isinstance(batch, list) and 2 <= len(batch) <= 3, batch  # EventBatch is array_like
    ts, events = batch[0], batch[1]
    assert all(isinstance(e, dict) and "type" in e for e in events), events  # tagged structs as maps
    return Message(topic, int.from_bytes(seq, "big", signed=True), ts, events, batch[2] if len(batch) > 2 else None)


def of_type(messages: list[Message], kind: str) -> list[dict[str, Any]]:
    return [event for m in messages for event in m.events if event["type"] == kind]


# --- pool and scheduler (pure) -------------------------------------------------------------------------


def limits(**overrides: int) -> EngineLimits:
    base = {"block_size": 4, "num_kv_blocks": 16, "max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 32}
    base.update(overrides)
    return EngineLimits(**base)  # type: ignore[arg-type]


def run(scheduler: Scheduler, steps: int = 50) -> None:
    for _ in range(steps):
        plan = scheduler.schedule()
        if not plan.has_work:
            return
        scheduler.complete(plan)


def stored(events: list[Any]) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored)]


@given(
    st.lists(st.integers(0, 50), max_size=30),
    st.lists(st.integers(0, 50), max_size=30),
    st.integers(1, 6),
    st.lists(st.integers(0, 60), max_size=5),
)
def test_sequence_hashes_chain_over_prompt_then_output(
    prompt: list[int], output: list[int], block_size: int, asks: list[int]
) -> None:
    seq = Sequence("s", prompt, max_tokens=len(output) + 1)
    everything = prompt + output
    for ask in asks:  # in any order and amount, as the scheduler asks while the output grows
        seq.output = output[: max(0, min(ask, len(everything)) - len(prompt))]
        num_tokens = min(ask, len(prompt) + len(seq.output))
        got = seq.hashes(block_size, num_tokens)
        assert got[: num_tokens // block_size] == block_hashes(everything, block_size)[: num_tokens // block_size]
    for start in range(len(everything) + 1):
        seq.output = output
        assert seq.token_slice(start, len(everything)) == everything[start:]
        assert seq.token_slice(0, start) == everything[:start]


def test_prefill_stores_the_full_prompt_blocks_in_one_event() -> None:
    scheduler = Scheduler(limits(), enable_kv_cache_events=True)
    prompt = list(range(100, 110))  # 10 tokens: 2 full blocks and a partial one
    scheduler.add(Sequence("a", prompt, max_tokens=1))
    run(scheduler)
    (event,) = scheduler.pool.take_events()
    assert isinstance(event, BlockStored)
    assert event.block_hashes == block_hashes(prompt, 4)  # the very hashes the prefix cache uses
    assert event.parent_block_hash is None
    assert event.token_ids == prompt[:8]
    assert event.block_size == 4 and event.medium == "GPU" and event.group_idx == 0
    assert event.lora_id is None and event.lora_name is None
    assert scheduler.pool.take_events() == []  # drained


def test_chunked_prefill_and_decode_store_blocks_as_they_fill() -> None:
    scheduler = Scheduler(limits(max_num_batched_tokens=6), enable_kv_cache_events=True)
    prompt = list(range(200, 210))
    seq = Sequence("a", prompt, max_tokens=4)  # ends before a fourth block fills
    scheduler.add(seq)
    per_step: list[list[BlockStored]] = []
    for _ in range(20):
        plan = scheduler.schedule()
        if not plan.has_work:
            break
        scheduler.complete(plan)
        per_step.append(stored(scheduler.pool.take_events()))
    # Step 1 prefills 6 tokens (block 0 full), step 2 the other 4 (block 1 full; block 2 partial).
    assert [len(s) for s in per_step[:2]] == [1, 1]
    (first,), (second,) = per_step[0], per_step[1]
    assert first.parent_block_hash is None and first.token_ids == prompt[:4]
    assert second.parent_block_hash == first.block_hashes[-1] and second.token_ids == prompt[4:8]
    # Block 2 fills with prompt tokens 8-9 and the first two generated tokens, once both are computed.
    later = [event for step in per_step[2:] for event in step]
    assert len(later) == 1
    tokens = prompt + seq.output
    assert later[0].token_ids == tokens[8:12]
    assert later[0].parent_block_hash == second.block_hashes[-1]
    assert later[0].block_hashes == block_hashes(tokens, 4)[2:3]
    assert all(0 <= h <= HASH_MASK for e in (first, second, later[0]) for h in e.block_hashes)


def test_prefix_hits_are_not_announced_again() -> None:
    scheduler = Scheduler(limits(), enable_kv_cache_events=True)
    prompt = list(range(300, 313))  # 13 tokens: 3 full blocks, all reusable
    scheduler.add(Sequence("a", prompt, max_tokens=1))
    run(scheduler)
    scheduler.pool.take_events()
    longer = [*prompt[:12], 7, 7, 7, 7, 7]  # shares 3 blocks, adds a fourth
    scheduler.add(Sequence("b", longer, max_tokens=1))
    run(scheduler)
    (event,) = scheduler.pool.take_events()
    assert isinstance(event, BlockStored)
    assert event.block_hashes == block_hashes(longer, 4)[3:4]
    assert event.parent_block_hash == block_hashes(prompt, 4)[2]
    assert event.token_ids == longer[12:16]


def test_eviction_removes_tail_blocks_first_and_freeing_alone_emits_nothing() -> None:
    pool = KVBlockPool(num_blocks=4, block_size=4, enable_kv_cache_events=True)
    first = pool.allocate(12)
    assert first is not None
    pool.cache_full_blocks(first.block_ids, [11, 22, 33], list(range(12)), 0, 3)
    pool.free(first.block_ids)
    assert stored(pool.take_events())[0].block_hashes == [11, 22, 33]
    assert pool.take_events() == []  # freed blocks keep their content: no event
    # One block was never used: it is handed out before any cached one is evicted.
    other = pool.allocate(4)
    assert other is not None and pool.take_events() == []
    pool.free(other.block_ids)  # unhashed: back to the front of the free queue
    more = pool.allocate(12)
    assert more is not None
    assert pool.take_events() == [
        BlockRemoved(block_hashes=[33], medium="GPU", group_idx=0),
        BlockRemoved(block_hashes=[22], medium="GPU", group_idx=0),
    ]


def test_duplicate_content_is_stored_and_removed_per_block() -> None:
    # Two requests computing the same prompt at once both cache it, as vLLM does.
    scheduler = Scheduler(limits(num_kv_blocks=4, max_model_len=16), enable_kv_cache_events=True)
    prompt = list(range(400, 408))
    for name in ("a", "b"):
        scheduler.add(Sequence(name, prompt, max_tokens=1))
    run(scheduler)
    events = scheduler.pool.take_events()
    assert [e.block_hashes for e in stored(events)] == [block_hashes(prompt, 4)] * 2
    scheduler.add(Sequence("c", list(range(500, 516)), max_tokens=1))  # needs all 4 blocks
    run(scheduler)
    removed = [e for e in scheduler.pool.take_events() if isinstance(e, BlockRemoved)]
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(block_hashes(prompt, 4) * 2)


def test_pulled_kv_is_stored_when_the_pull_completes() -> None:
    scheduler = Scheduler(limits(), enable_kv_cache_events=True)
    prompt = list(range(600, 609))
    remote = Sequence("r", prompt, max_tokens=2, remote_prefill=True)
    scheduler.add(remote)
    scheduler.complete(scheduler.schedule())
    assert scheduler.pool.take_events() == []
    scheduler.pull_done(remote)
    (event,) = scheduler.pool.take_events()
    assert isinstance(event, BlockStored)
    assert event.block_hashes == block_hashes(prompt, 4) and event.token_ids == prompt[:8]
    run(scheduler)
    assert stored(scheduler.pool.take_events()) == []  # the recomputed last token fills no new block


def test_reset_clears_everything_and_refuses_while_blocks_are_used() -> None:
    pool = KVBlockPool(num_blocks=4, block_size=4, enable_kv_cache_events=True)
    held = pool.allocate(8)
    assert held is not None
    pool.cache_full_blocks(held.block_ids, [1, 2], list(range(8)), 0, 2)
    pool.take_events()
    assert pool.reset_prefix_cache() is False and pool.take_events() == []
    pool.free(held.block_ids)
    assert pool.reset_prefix_cache() is True
    assert pool.take_events() == [AllBlocksCleared()]
    again = pool.allocate(9, [1, 2])
    assert again is not None and again.num_cached_tokens == 0
    assert pool.take_events() == []  # nothing left to evict


def test_no_events_are_kept_when_disabled() -> None:
    scheduler = Scheduler(limits())
    scheduler.add(Sequence("a", list(range(20)), max_tokens=3))
    run(scheduler)
    assert scheduler.pool.take_events() == []


# --- the cost of resuming a pulled request ------------------------------------------------------------

SLOW_PREFILL = LatencyModel(
    prefill_overhead_s=1.0,
    prefill_per_token_s=0.1,
    decode_base_s=0.01,
    decode_per_seq_s=0.001,
    kv_transfer_overhead_s=0.0,
    kv_transfer_per_block_s=0.0,
)


def test_a_request_resumed_from_pulled_kv_costs_a_decode_token_not_a_prefill() -> None:
    scheduler = Scheduler(limits())
    remote = Sequence("r", list(range(700, 709)), max_tokens=3, remote_prefill=True)
    scheduler.add(remote)
    scheduler.complete(scheduler.schedule())
    scheduler.pull_done(remote)
    plan = scheduler.schedule()
    assert plan.num_prefill_tokens == 0  # was 1: the step paid prefill_overhead_s for one token
    # Callers that cost a plan from its parts (the benchmarks' virtual engines) get the same answer.
    assert SLOW_PREFILL.step_seconds(len(plan.decode), plan.num_prefill_tokens) == pytest.approx(
        SLOW_PREFILL.step_seconds(1, 0)
    )
    assert plan.seconds(SLOW_PREFILL) == pytest.approx(SLOW_PREFILL.step_seconds(1, 0))
    result = scheduler.complete(plan)
    assert result.prefill_done == [remote] and len(remote.output) == 1


def test_resumed_requests_share_a_step_with_decodes_and_prefills() -> None:
    scheduler = Scheduler(limits())
    local = Sequence("local", list(range(800, 806)), max_tokens=4)
    scheduler.add(local)
    scheduler.complete(scheduler.schedule())  # local prefilled, decodes from now on
    remote = Sequence("remote", list(range(900, 909)), max_tokens=2, remote_prefill=True)
    fresh = Sequence("fresh", list(range(1000, 1005)), max_tokens=1)
    scheduler.add(remote)
    scheduler.complete(scheduler.schedule())
    scheduler.pull_done(remote)
    scheduler.add(fresh)
    plan = scheduler.schedule()
    assert plan.decode == [local, remote] and plan.resumed == [remote] and plan.prefill == [(fresh, 5)]
    assert plan.seconds(SLOW_PREFILL) == pytest.approx(SLOW_PREFILL.step_seconds(2, 5))


def test_a_preempted_resumed_request_is_recomputed_as_a_prefill() -> None:
    scheduler = Scheduler(limits(num_kv_blocks=4, max_model_len=16))
    remote = Sequence("r", list(range(1100, 1108)), max_tokens=2, remote_prefill=True)
    scheduler.add(remote)
    scheduler.complete(scheduler.schedule())
    scheduler.pull_done(remote)
    plan = scheduler.schedule()
    scheduler._preempt(remote, plan)
    assert plan.decode == plan.resumed == [] and not remote.awaiting_last_token
    run(scheduler)
    assert len(remote.output) == 2


# --- config and CLI --------------------------------------------------------------------------------------


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure(parser)
    return parser.parse_args(list(argv))


def test_cli_takes_vllms_json() -> None:
    flag = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv"}'
    config = config_from_args(parse("--kv-events-config", flag))
    assert config.kv_events == KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:5557", topic="kv")
    assert config.kv_events.to_dict() == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
        "replay_endpoint": None,
        "buffer_steps": 10000,
        "hwm": 100000,
        "max_queue_size": 100000,
        "topic": "kv",
    }
    assert config_from_args(parse()).kv_events is None


@pytest.mark.parametrize(
    "flag", ["not json", "[1]", '{"enable_kv_cache_events": 1}', '{"endpoint": "tcp://*:1", "bogus": 2}']
)
def test_cli_rejects_bad_kv_events_config(flag: str) -> None:
    with pytest.raises(SystemExit):
        parse("--kv-events-config", flag)


def test_kv_events_config_defaults_and_offsets() -> None:
    assert KVEventsConfig().publisher == "null" and not KVEventsConfig().publishes
    assert KVEventsConfig(enable_kv_cache_events=True).publisher == "zmq"
    assert not KVEventsConfig(enable_kv_cache_events=True, publisher="null").publishes
    shifted = KVEventsConfig(enable_kv_cache_events=True, replay_endpoint="tcp://*:6000").shifted(2)
    assert (shifted.endpoint, shifted.replay_endpoint) == ("tcp://*:5559", "tcp://*:6002")
    assert KVEventsConfig(endpoint="tcp://*:0").shifted(3).endpoint == "tcp://*:0"
    assert KVEventsConfig(publisher="kafka").problems()


# --- the worker: ZMQ PUB, replay, /kv_event_sources ------------------------------------------------------

SMALL = EngineLimits(block_size=4, num_kv_blocks=8, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=32)


def events_config(**overrides: Any) -> KVEventsConfig:
    """Events on free ports (``tcp://*:0`` binds one and /kv_event_sources reports it)."""
    settings: dict[str, Any] = {
        "enable_kv_cache_events": True,
        "endpoint": "tcp://*:0",
        "replay_endpoint": "tcp://*:0",
        "topic": "kv",
    }
    settings.update(overrides)
    return KVEventsConfig(**settings)


@pytest.fixture
async def zmq_context() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


class Subscriber:
    """A SUB socket that keeps every message it reads."""

    def __init__(self, context: zmq.asyncio.Context, endpoint: str, topic: bytes) -> None:
        self.socket = context.socket(zmq.SUB)
        self.socket.connect(endpoint)
        self.socket.setsockopt(zmq.SUBSCRIBE, topic)
        self.messages: list[Message] = []

    async def read_until(self, done: Callable[[list[Message]], bool], deadline: float) -> bool:
        """Read until ``done(messages)`` holds (True) or the deadline passes (False)."""
        while not done(self.messages):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if await self.socket.poll(int(min(left, 0.2) * 1000)):
                self.messages.append(decode_message(await self.socket.recv_multipart()))
        return True


async def complete(http: aiohttp.ClientSession, worker: SimWorker, prompt: str, max_tokens: int = 1) -> None:
    status, body = await post(http, worker.url + "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens})
    assert status == 200, body


async def subscribed(http: aiohttp.ClientSession, worker: SimWorker, sub: Subscriber) -> None:
    """Send probe prompts until the subscriber sees one: PUB drops what it sends before a SUB joins."""
    deadline = time.monotonic() + DEADLINE_S
    for probe in range(1000):
        assert time.monotonic() < deadline, "the subscriber never received a batch"
        await complete(http, worker, f"probe {probe} one two three four")  # 6 tokens: stores a block
        if await sub.read_until(bool, min(deadline, time.monotonic() + 0.2)):
            return


async def replay(context: zmq.asyncio.Context, endpoint: str, start: int) -> list[Message]:
    """Ask the replay socket for every batch from ``start``; the answer ends with seq -1."""
    dealer = context.socket(zmq.DEALER)  # a DEALER (unlike REQ) can take the many-part answer
    dealer.connect(endpoint)
    try:
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        got: list[Message] = []
        while True:
            assert await dealer.poll(int(DEADLINE_S * 1000)), "no replay answer"
            empty, *frames = await dealer.recv_multipart()
            assert empty == b""
            if int.from_bytes(frames[1], "big", signed=True) == -1:
                assert frames[0] == b"" and frames[2] == b""
                return got
            got.append(decode_message(frames))
    finally:
        dealer.close(linger=0)


async def replay_until(
    context: zmq.asyncio.Context, endpoint: str, start: int, done: Callable[[list[Message]], bool]
) -> list[Message]:
    """Replay until ``done`` holds: a batch is buffered once the publisher thread has sent it."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        got = await replay(context, endpoint, start)
        if done(got):
            return got
        assert time.monotonic() < deadline, f"replay never satisfied the test; got {got}"
        await asyncio.sleep(0.02)  # poll interval: the deadline above bounds the wait


async def test_subscriber_receives_block_stored_for_the_prompts_full_blocks(
    http: aiohttp.ClientSession, zmq_context: zmq.asyncio.Context
) -> None:
    prompt = "the quick brown fox jumps over the lazy dog again"  # 10 tokens: 2 full blocks of 4
    ids = tokenize(prompt)
    hashes = block_hashes(ids, 4)
    async with SimWorker(fast_config(limits=SMALL, kv_events=events_config())) as worker:
        endpoint = worker.kv_event_sources()["0"]["endpoint"]
        assert isinstance(endpoint, str)
        sub = Subscriber(zmq_context, endpoint, b"kv")
        await subscribed(http, worker, sub)
        await complete(http, worker, prompt, max_tokens=2)
        found = await sub.read_until(
            lambda got: any(e["block_hashes"] == hashes for e in of_type(got, "BlockStored")),
            time.monotonic() + DEADLINE_S,
        )
        assert found, sub.messages
    (event,) = [e for e in of_type(sub.messages, "BlockStored") if e["block_hashes"] == hashes]
    # The exact map vLLM 0.32 encodes: required fields always, defaults omitted, group_idx 0 present.
    assert list(event) == [
        "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
        "group_idx",
    ]  # fmt: skip
    assert event["parent_block_hash"] is None and event["token_ids"] == ids[:8] and event["block_size"] == 4
    assert event["medium"] == "GPU" and event["group_idx"] == 0
    assert all(m.topic == b"kv" and m.dp_rank == 0 and m.events for m in sub.messages)
    seqs = [m.seq for m in sub.messages]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # contiguous (the first probes may be missed)


async def test_replay_returns_missed_batches_from_seq_zero(
    http: aiohttp.ClientSession, zmq_context: zmq.asyncio.Context
) -> None:
    prompts = [f"prompt number {i} has some words" for i in range(3)]  # 7 tokens: one full block each
    async with SimWorker(fast_config(limits=SMALL, kv_events=events_config())) as worker:
        replay_endpoint = worker.kv_event_sources()["0"]["replay_endpoint"]
        assert isinstance(replay_endpoint, str)
        for prompt in prompts:
            await complete(http, worker, prompt)  # nobody subscribed: a PUB socket drops these
        everything = await replay_until(zmq_context, replay_endpoint, 0, lambda got: len(got) >= 3)
        tail = await replay(zmq_context, replay_endpoint, 1)
    assert [m.seq for m in everything] == [0, 1, 2]
    stored_hashes = [e["block_hashes"] for e in of_type(everything, "BlockStored")]
    assert stored_hashes == [block_hashes(tokenize(p), 4)[:1] for p in prompts]
    assert [(m.seq, m.events) for m in tail] == [(m.seq, m.events) for m in everything[1:]]


async def test_replay_buffer_keeps_the_last_buffer_steps_batches(
    http: aiohttp.ClientSession, zmq_context: zmq.asyncio.Context
) -> None:
    async with SimWorker(fast_config(limits=SMALL, kv_events=events_config(buffer_steps=2))) as worker:
        replay_endpoint = str(worker.kv_event_sources()["0"]["replay_endpoint"])
        for i in range(4):
            await complete(http, worker, f"buffered prompt {i} with words")
        got = await replay_until(zmq_context, replay_endpoint, 0, lambda got: bool(got) and got[-1].seq == 3)
    assert [m.seq for m in got] == [2, 3]


async def test_eviction_publishes_block_removed(http: aiohttp.ClientSession, zmq_context: zmq.asyncio.Context) -> None:
    tiny = EngineLimits(block_size=4, num_kv_blocks=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=16)
    first = "one two three four five six seven eight nine ten eleven twelve"  # 12 tokens: 3 blocks
    second = "a b c d e f g h i j k l"  # 12 other tokens: needs 3 of the 4 blocks
    first_hashes = block_hashes(tokenize(first), 4)
    async with SimWorker(fast_config(limits=tiny, kv_events=events_config())) as worker:
        replay_endpoint = str(worker.kv_event_sources()["0"]["replay_endpoint"])
        await complete(http, worker, first)
        await complete(http, worker, second)
        got = await replay_until(zmq_context, replay_endpoint, 0, lambda got: len(of_type(got, "BlockRemoved")) >= 2)
    assert [e["block_hashes"] for e in of_type(got, "BlockStored")] == [
        first_hashes,
        block_hashes(tokenize(second), 4),
    ]
    removed = of_type(got, "BlockRemoved")
    # The never-used block is handed out first (no event), then the first prompt's, tail first.
    assert removed == [
        {"type": "BlockRemoved", "block_hashes": [first_hashes[2]], "medium": "GPU", "group_idx": 0},
        {"type": "BlockRemoved", "block_hashes": [first_hashes[1]], "medium": "GPU", "group_idx": 0},
    ]
    assert [m.seq for m in got] == list(range(len(got)))


async def test_reset_prefix_cache_publishes_all_blocks_cleared(
    http: aiohttp.ClientSession, zmq_context: zmq.asyncio.Context
) -> None:
    async with SimWorker(fast_config(limits=SMALL, kv_events=events_config())) as worker:
        replay_endpoint = str(worker.kv_event_sources()["0"]["replay_endpoint"])
        await complete(http, worker, "fill a block with these words")
        status, body = await post(http, worker.url + "/reset_prefix_cache", {})
        assert (status, body) == (200, {"success": True})
        got = await replay_until(zmq_context, replay_endpoint, 0, lambda got: bool(of_type(got, "AllBlocksCleared")))
    assert got[-1].events == [{"type": "AllBlocksCleared"}]


async def test_kv_event_sources_endpoint(http: aiohttp.ClientSession) -> None:
    config = events_config(replay_endpoint=None)
    async with SimWorker(fast_config(kv_events=config)) as worker, http.get(worker.url + "/kv_event_sources") as reply:
        assert reply.status == 200
        sources = await reply.json()
    endpoint = sources["0"].pop("endpoint")
    assert endpoint.startswith("tcp://127.0.0.1:") and int(endpoint.rsplit(":", 1)[1]) > 0
    assert sources == {
        "0": {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "replay_endpoint": None,
            "buffer_steps": 10000,
            "hwm": 100000,
            "max_queue_size": 100000,
            "topic": "kv",
        }
    }
    # vLLM answers {} when no publisher runs: events off, or the "null" publisher.
    for off in (None, KVEventsConfig(), KVEventsConfig(enable_kv_cache_events=True, publisher="null")):
        async with SimWorker(fast_config(kv_events=off)) as worker, http.get(worker.url + "/kv_event_sources") as reply:
            assert reply.status == 200 and await reply.json() == {}
