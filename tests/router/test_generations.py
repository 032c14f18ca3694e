"""KV generations: the pure pieces (pairing decisions, Pods and endpoints files read into pool
snapshots), the pools' generation filter, and the flow pairing prefill and decode of one generation
against in-process simulated workers."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from multidict import CIMultiDictProxy

from splitserve.router import cli
from splitserve.router.app import make_discovery
from splitserve.router.config import DiscoveryKind, GenerationPairing
from splitserve.router.discovery import PoolSnapshot
from splitserve.router.discovery_file import EndpointsFileError, FileDiscovery, parse_endpoints_file
from splitserve.router.discovery_pods import PodDiscovery, endpoints_of_pods
from splitserve.router.errors import RouterError
from splitserve.router.metrics import RouterMetrics
from splitserve.router.pairing import decode_generations, prefill_generations
from splitserve.router.policies import RoundRobin, RoutingRequest
from splitserve.router.pool import AdmissionBudget, WorkerPool
from splitserve.sim import SimWorker, generate_text, tokenize
from testkit.router import metric_value, router_config, running_router, sim_config
from tests.router.conftest import wait_until

A, B = "aaaaaaaaaa", "bbbbbbbbbb"
PROMPT = "the quick brown fox jumps over the lazy dog and keeps on running far away " * 3


# ---- pairing ----------------------------------------------------------------------------------


def test_decode_is_limited_to_complete_generations_only_while_one_exists() -> None:
    # A has both pools, B only decode so far: split requests stay on A.
    assert decode_generations(frozenset({A}), frozenset({A, B})) == frozenset({A})
    # Both complete (or one generation, the usual case): no limit at all.
    assert decode_generations(frozenset({A, B}), frozenset({A, B})) is None
    assert decode_generations(frozenset({""}), frozenset({""})) is None
    # B's prefill is up first: decode of A keeps serving (no complete pair exists, nothing to gain).
    assert decode_generations(frozenset({B}), frozenset({A})) is None
    # Old generation's prefill gone, new one complete: everything split goes to B.
    assert decode_generations(frozenset({B}), frozenset({A, B})) == frozenset({B})
    assert decode_generations(frozenset(), frozenset({A})) is None


def test_prefill_follows_the_decode_generation_unless_pairing_is_off() -> None:
    assert prefill_generations(A, GenerationPairing.STRICT) == frozenset({A})
    assert prefill_generations("", GenerationPairing.STRICT) == frozenset({""})  # unknown pairs with unknown only
    assert prefill_generations(A, GenerationPairing.OFF) is None


# ---- Pods ---------------------------------------------------------------------------------------


def pod(
    name: str,
    role: str,
    ip: str | None,
    generation: str | None = A,
    ready: bool = True,
    deleting: bool = False,
) -> dict[str, Any]:
    labels = {"splitserve.io/deployment": "llama", "splitserve.io/role": role}
    if generation is not None:
        labels["splitserve.io/generation"] = generation
    metadata: dict[str, Any] = {"name": name, "labels": labels}
    if deleting:
        metadata["deletionTimestamp"] = "2030-01-01T00:00:00Z"
    status: dict[str, Any] = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip is not None:
        status["podIP"] = ip
    return {"metadata": metadata, "status": status}


def test_endpoints_of_pods_by_role_state_and_generation() -> None:
    pools = endpoints_of_pods(
        [
            pod("p1", "prefill", "10.0.0.1"),
            pod("p2", "prefill", "10.0.0.2", generation=B, deleting=True),
            pod("d1", "decode", "10.0.1.1", generation=B),
            pod("agg", "aggregated", "10.0.1.2", generation=None),
            pod("d-not-ready", "decode", "10.0.1.3", ready=False),
            pod("d-no-ip", "decode", None),
            pod("d-deleting-no-ip", "decode", None, deleting=True),
            pod("d6", "decode", "fd00::6"),
            pod("router", "router", "10.0.2.1"),
        ],
        8000,
    )
    assert pools["prefill"] == PoolSnapshot(
        {"http://10.0.0.1:8000"}, {"http://10.0.0.2:8000"}, {"http://10.0.0.1:8000": A, "http://10.0.0.2:8000": B}
    )
    assert pools["decode"] == PoolSnapshot(
        {"http://10.0.1.1:8000", "http://10.0.1.2:8000", "http://[fd00::6]:8000"},
        set(),
        {"http://10.0.1.1:8000": B, "http://10.0.1.2:8000": "", "http://[fd00::6]:8000": A},
    )


def test_a_reused_pod_ip_belongs_to_the_ready_pod() -> None:
    for order in (1, -1):
        pods = [pod("old", "decode", "10.0.0.9", generation=A, deleting=True), pod("new", "decode", "10.0.0.9", B)]
        decode = endpoints_of_pods(pods[::order], 8000)["decode"]
        assert decode == PoolSnapshot({"http://10.0.0.9:8000"}, set(), {"http://10.0.0.9:8000": B})


def test_no_pods_is_two_empty_pools() -> None:
    assert endpoints_of_pods([], 8000) == {"prefill": PoolSnapshot(), "decode": PoolSnapshot()}


# ---- the endpoints file -----------------------------------------------------------------------


def endpoints(**pools: list[tuple[str, str, str]]) -> bytes:
    return orjson.dumps(
        {
            "pools": {
                name: [{"url": u, "generation": g, "state": s} for u, g, s in entries]
                for name, entries in pools.items()
            }
        }
    )


def test_endpoints_file_is_read_into_both_pools() -> None:
    text = endpoints(
        prefill=[("http://127.0.0.1:8101/", A, "ready")],
        decode=[("http://127.0.0.1:8201", A, "terminating"), ("http://127.0.0.1:8202", B, "ready")],
    )
    pools = parse_endpoints_file(text)
    assert pools["prefill"] == PoolSnapshot({"http://127.0.0.1:8101"}, set(), {"http://127.0.0.1:8101": A})
    assert pools["decode"] == PoolSnapshot(
        {"http://127.0.0.1:8202"},
        {"http://127.0.0.1:8201"},
        {"http://127.0.0.1:8201": A, "http://127.0.0.1:8202": B},
    )


def test_endpoints_file_defaults_and_an_absent_prefill_pool() -> None:
    pools = parse_endpoints_file('{"pools": {"decode": [{"url": "http://h:1"}], "embedding": []}}')
    assert pools["prefill"] == PoolSnapshot()
    assert pools["decode"] == PoolSnapshot({"http://h:1"}, set(), {"http://h:1": ""})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not JSON"),
        ("[]", '"pools" object'),
        ('{"pools": {"decode": {}}}', "pools.decode must be a list"),
        ('{"pools": {"decode": ["http://h:1"]}}', r"pools.decode\[0\] must be an object"),
        ('{"pools": {"decode": [{"url": "h:1"}]}}', "http:// URL"),
        ('{"pools": {"decode": [{"url": "http://h:1", "generation": 7}]}}', "generation must be a string"),
        ('{"pools": {"decode": [{"url": "http://h:1", "state": "gone"}]}}', "state must be one of"),
    ],
)
def test_a_malformed_endpoints_file_is_an_error(text: str, message: str) -> None:
    with pytest.raises(EndpointsFileError, match=message):
        parse_endpoints_file(text)


def write_atomically(path: Path, data: bytes) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)


async def test_file_discovery_reports_changes_and_keeps_the_last_snapshot(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.json"
    updates: list[tuple[str, set[str], set[str], dict[str, str]]] = []

    def on_update(
        pool: str, ready: set[str], terminating: set[str], generations: Mapping[str, str] | None = None
    ) -> None:
        updates.append((pool, ready, terminating, dict(generations or {})))

    task = asyncio.create_task(FileDiscovery(str(path), interval=0.01).run(on_update))
    try:
        await asyncio.sleep(0.05)
        assert updates == []  # no file yet: no workers, no crash
        write_atomically(path, endpoints(decode=[("http://h:1", A, "ready")]))
        await wait_until(lambda: len(updates) == 2)
        assert updates[-1] == ("decode", {"http://h:1"}, set(), {"http://h:1": A})
        assert updates[0] == ("prefill", set(), set(), {})
        await asyncio.sleep(0.05)
        assert len(updates) == 2  # unchanged file: nothing reported again
        write_atomically(path, b'{"pools": {"decode": [')  # half a file
        path.unlink()  # ... then none at all
        await asyncio.sleep(0.05)
        assert len(updates) == 2  # the last snapshot stands
        write_atomically(path, endpoints(decode=[("http://h:1", A, "terminating")]))
        await wait_until(lambda: len(updates) == 4)
        assert updates[-1] == ("decode", set(), {"http://h:1"}, {"http://h:1": A})
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# ---- flags -------------------------------------------------------------------------------------


def _config(*argv: str) -> Any:
    parser = argparse.ArgumentParser()
    cli.configure(parser)
    return cli.config_from_args(parser.parse_args(list(argv)))


def test_file_and_pods_flags_build_the_config(tmp_path: Path) -> None:
    config = _config("--discovery", "file", "--endpoints-file", str(tmp_path / "e.json"))
    assert (config.discovery, config.endpoints_file, config.endpoints_poll_interval) == (
        DiscoveryKind.FILE,
        str(tmp_path / "e.json"),
        0.2,
    )
    assert config.has_prefill_source and config.generation_pairing is GenerationPairing.STRICT
    assert isinstance(make_discovery(config), FileDiscovery)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\ncurrent-context: c\ncontexts: [{name: c, context: {cluster: k, user: u}}]\n"
        "clusters: [{name: k, cluster: {server: 'http://127.0.0.1:1'}}]\nusers: [{name: u, user: {token: t}}]\n"
    )
    config = _config(
        *["--discovery", "pods", "--deployment", "llama", "--namespace", "ns", "--worker-port", "8001"],
        *["--no-prefill-pool", "--generation-pairing", "off", "--kubeconfig", str(kubeconfig)],
    )
    assert (config.deployment, config.namespace, config.worker_port) == ("llama", "ns", 8001)
    assert not config.has_prefill_source and config.generation_pairing is GenerationPairing.OFF
    assert isinstance(make_discovery(config), PodDiscovery)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--discovery", "file"), "needs --endpoints-file"),
        (("--discovery", "pods"), "needs --deployment"),
        (("--discovery", "file", "--endpoints-file", "e", "--endpoints-poll-interval", "0"), "must be positive"),
    ],
)
def test_file_and_pods_flag_errors(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _config(*argv)


# ---- the pool's generation filter -------------------------------------------------------------


@contextlib.asynccontextmanager
async def pool_of(generations: dict[str, str], cap: int = 0) -> AsyncIterator[WorkerPool]:
    pool = WorkerPool(
        "prefill",
        RoundRobin(),
        RouterMetrics(),
        AdmissionBudget(100),
        max_inflight_per_worker=cap,
        connect_timeout=1.0,
        eject_after_failures=3,
        eject_min_seconds=1.0,
        health_interval=1.0,
        metrics_poll_interval=1.0,
    )
    pool.set_endpoints(generations, (), generations)
    try:
        yield pool
    finally:
        await pool.close()


async def test_acquire_takes_only_workers_of_the_given_generations() -> None:
    async with pool_of({"http://a1:1": A, "http://a2:1": A, "http://b1:1": B}) as pool:
        assert pool.healthy_generations == {A, B}
        request = RoutingRequest()
        chosen = {pool._try_acquire(request, frozenset(), frozenset({B})).url for _ in range(4)}  # type: ignore[union-attr]
        assert chosen == {"http://b1:1"}
        assert pool._try_acquire(request, frozenset(), frozenset({"cccccccccc"})) is None
        assert pool.has_healthy_in(frozenset({A})) and not pool.has_healthy_in(frozenset({""}))
        assert pool.has_healthy_except({"http://b1:1"}, frozenset({A}))
        assert not pool.has_healthy_except({"http://b1:1"}, frozenset({B}))


async def test_a_waiter_for_one_generation_does_not_hold_back_another() -> None:
    async with pool_of({"http://a1:1": A, "http://b1:1": B}, cap=1) as pool:
        request = RoutingRequest()
        held_a = await pool.acquire(request, _deadline(5), generations=frozenset({A}))
        waiting_a = asyncio.create_task(pool.acquire(request, _deadline(5), generations=frozenset({A})))
        await wait_until(lambda: pool.queue_depth == 1)
        # B has room: a request for B is served at once, past the waiter for A.
        held_b = await asyncio.wait_for(pool.acquire(request, _deadline(5), generations=frozenset({B})), 1)
        assert held_b.generation == B
        waiting_b = asyncio.create_task(pool.acquire(request, _deadline(5), generations=frozenset({B})))
        await wait_until(lambda: pool.queue_depth == 2)
        pool.release(held_b)  # frees B: wakes the waiter for B, not the first one in line
        assert (await asyncio.wait_for(waiting_b, 1)).generation == B
        assert not waiting_a.done()
        pool.release(held_a)
        assert (await asyncio.wait_for(waiting_a, 1)).generation == A


async def test_a_waiter_follows_a_changing_filter_and_gives_up_on_a_generation_gone() -> None:
    async with pool_of({"http://a1:1": A, "http://b1:1": B}, cap=1) as pool:
        request = RoutingRequest()
        held_a = await pool.acquire(request, _deadline(5), generations=frozenset({A}))
        held_b = await pool.acquire(request, _deadline(5), generations=frozenset({B}))
        wanted: list[frozenset[str] | None] = [frozenset({A})]
        follows = asyncio.create_task(pool.acquire(request, _deadline(5), generations=lambda: wanted[0]))
        fixed = asyncio.create_task(pool.acquire(request, _deadline(5), generations=frozenset({A})))
        await wait_until(lambda: pool.queue_depth == 2)
        # A turns terminating: the fixed waiter stops at once (B is there, A is not coming back soon),
        # the other one, told to take anything now, gets B's slot when it frees.
        wanted[0] = None
        pool.set_endpoints(["http://b1:1"], ["http://a1:1"], {"http://a1:1": A, "http://b1:1": B})
        with pytest.raises(RouterError) as error:
            await asyncio.wait_for(fixed, 1)
        assert error.value.status == 503
        pool.release(held_b)
        assert (await asyncio.wait_for(follows, 1)).generation == B
        pool.release(held_a)


def _deadline(seconds: float) -> float:
    return time.monotonic() + seconds


async def test_an_address_back_with_another_generation_is_another_worker() -> None:
    async with pool_of({"http://x:1": A}) as pool:
        old = pool._try_acquire(RoutingRequest(), frozenset())
        assert old is not None and old.generation == A
        pool.set_endpoints(["http://x:1"], (), {"http://x:1": B})
        (new,) = pool.workers
        assert new is not old and new.generation == B and old.removed
        assert pool.describe() == [
            {"url": "http://x:1", "generation": B, "state": "healthy", "inflight": 0},
            {"url": "http://x:1", "generation": A, "state": "departing", "inflight": 1},
        ]
        pool.release(old)
        assert pool.describe() == [{"url": "http://x:1", "generation": B, "state": "healthy", "inflight": 0}]


# ---- the flow, against in-process simulated workers --------------------------------------------


async def _complete(url: str, prompt: str = PROMPT, stream: bool = False) -> tuple[int, str, CIMultiDictProxy[str]]:
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": 6, "stream": stream}
    async with aiohttp.ClientSession() as session, session.post(url + "/v1/completions", json=body) as response:
        raw = await response.read()
        if response.status != 200:
            return response.status, raw.decode(), response.headers
        if not stream:
            return 200, orjson.loads(raw)["choices"][0]["text"], response.headers
        text = ""
        for event in raw.decode().split("\n\n"):
            if event.startswith("data: {"):
                choices = orjson.loads(event[6:])["choices"]
                text += "".join(c.get("text", "") for c in choices)
        return 200, text, response.headers


def _text(generation: str, prompt: str = PROMPT) -> str:
    return generate_text(tokenize(prompt), 6, generation)


def _file_config(**overrides: Any) -> Any:
    # The pools are set directly in these tests; the config must only say a prefill pool exists.
    return router_config(discovery=DiscoveryKind.FILE, endpoints_file="/nonexistent", **overrides)


async def test_no_prefill_of_the_decode_generation_serves_it_whole_on_that_decode() -> None:
    async with (
        SimWorker(sim_config("prefill", generation=B)) as prefill,
        SimWorker(sim_config("decode", generation=A)) as decode,
        running_router(_file_config()) as (router, url),
    ):
        router.prefill.set_endpoints([prefill.url], (), {prefill.url: B})
        router.decode.set_endpoints([decode.url], (), {decode.url: A})
        for stream in (False, True):
            status, text, headers = await _complete(url, stream=stream)
            assert status == 200, text
            assert headers.getall("X-Splitserve-Generation") == [A]
            assert text == _text(A) != _text(B)
        assert metric_value(router, "splitserve_router_fallbacks_total", {"reason": "no_prefill_in_generation"}) == 2
        assert metric_value(router, "splitserve_router_cross_generation_pairs_total") == 0
        assert prefill.metric("splitserve_sim_kv_pulls_refused_total", reason="generation") == 0
        assert (
            metric_value(router, "splitserve_router_generation_requests_total", {"generation": A, "outcome": "success"})
            == 2
        )
        assert metric_value(router, "splitserve_router_generation_ttft_seconds_count", {"generation": A}) == 1


async def test_split_requests_go_to_the_generation_with_a_prefill_pool() -> None:
    async with (
        SimWorker(sim_config("prefill", generation=B)) as prefill,
        SimWorker(sim_config("decode", generation=A)) as decode_a,
        SimWorker(sim_config("decode", generation=B)) as decode_b,
        running_router(_file_config(disagg_threshold_tokens=20, decode_policy="round-robin")) as (router, url),
    ):
        router.prefill.set_endpoints([prefill.url], (), {prefill.url: B})
        router.decode.set_endpoints([decode_a.url, decode_b.url], (), {decode_a.url: A, decode_b.url: B})
        answers = await asyncio.gather(*(_complete(url) for _ in range(8)))
        assert {tuple(h.getall("X-Splitserve-Generation")) for _, _, h in answers} == {(B,)}
        assert all(text == _text(B) for _, text, _ in answers)
        assert (
            metric_value(router, "splitserve_router_requests_total", {"outcome": "success", "mode": "disaggregated"})
            == 8
        )
        # Short prompts are not split: they go to any decode worker, A included.
        short = await asyncio.gather(*(_complete(url, prompt="hi there") for _ in range(16)))
        assert {h["X-Splitserve-Generation"] for _, _, h in short} == {A, B}


async def test_a_failed_decode_is_retried_in_its_generation_or_without_the_kv() -> None:
    async with (
        SimWorker(sim_config("prefill", generation=A)) as prefill_a,
        SimWorker(sim_config("prefill", generation=B)) as prefill_b,
        SimWorker(sim_config("decode", generation=A)) as decode_a1,
        SimWorker(sim_config("decode", generation=A)) as decode_a2,
        SimWorker(sim_config("decode", generation=B)) as decode_b,
        running_router(_file_config(decode_policy="round-robin", eject_after_failures=100)) as (router, url),
    ):
        prefills = {prefill_a.url: A, prefill_b.url: B}
        router.prefill.set_endpoints(prefills, (), prefills)
        # First decode worker in URL order fails: round-robin sends the first request there.
        first, second = sorted([decode_a1, decode_a2], key=lambda w: w.url)
        first.faults.status = 500
        router.decode.set_endpoints([first.url, second.url], (), {first.url: A, second.url: A})
        status, text, headers = await _complete(url)
        assert (status, headers["X-Splitserve-Generation"], text) == (200, A, _text(A))
        assert (
            metric_value(router, "splitserve_router_requests_total", {"outcome": "success", "mode": "disaggregated"})
            == 1
        )
        # Now the only other decode worker is of generation B: the retry goes there without A's KV.
        router.decode.set_endpoints([first.url, decode_b.url], (), {first.url: A, decode_b.url: B})
        if decode_b.url < first.url:
            await _complete(url)  # round-robin: let the cursor come round to the failing worker
        status, text, headers = await _complete(url)
        assert (status, headers["X-Splitserve-Generation"], text) == (200, B, _text(B))
        assert metric_value(router, "splitserve_router_fallbacks_total", {"reason": "decode_other_generation"}) == 1
        assert metric_value(router, "splitserve_router_cross_generation_pairs_total") == 0
        assert decode_b.metric("vllm:nixl_num_failed_transfers_total") == 0


async def test_pairing_off_sends_kv_across_generations_and_the_sim_refuses_it() -> None:
    async with (
        SimWorker(sim_config("prefill", generation=B)) as prefill,
        SimWorker(sim_config("decode", generation=A)) as decode,
        running_router(_file_config(generation_pairing=GenerationPairing.OFF)) as (router, url),
    ):
        router.prefill.set_endpoints([prefill.url], (), {prefill.url: B})
        router.decode.set_endpoints([decode.url], (), {decode.url: A})
        status, text, headers = await _complete(url)
        assert (status, headers["X-Splitserve-Generation"], text) == (200, A, _text(A))
        assert metric_value(router, "splitserve_router_cross_generation_pairs_total") == 1
        assert metric_value(router, "splitserve_router_fallbacks_total", {"reason": "decode_kv_error"}) == 1
        assert prefill.metric("splitserve_sim_kv_pulls_refused_total", reason="generation") == 1


async def test_the_workers_view_lists_generations_states_and_departing_workers() -> None:
    async with running_router(_file_config()) as (router, url):
        router.prefill.set_endpoints(["http://127.0.0.1:9"], (), {"http://127.0.0.1:9": A})
        router.decode.set_endpoints(
            ["http://127.0.0.1:10"], ["http://127.0.0.1:11"], {"http://127.0.0.1:10": B, "http://127.0.0.1:11": A}
        )
        held = router.decode._try_acquire(RoutingRequest(), frozenset())
        assert held is not None
        router.decode.set_endpoints([], ["http://127.0.0.1:11"], {"http://127.0.0.1:11": A})
        async with aiohttp.ClientSession() as session, session.get(url + "/splitserve/workers") as response:
            view = await response.json()
        router.decode.release(held)
    assert view == {
        "prefill": [{"url": "http://127.0.0.1:9", "generation": A, "state": "healthy", "inflight": 0}],
        "decode": [
            {"url": "http://127.0.0.1:11", "generation": A, "state": "terminating", "inflight": 0},
            {"url": "http://127.0.0.1:10", "generation": B, "state": "departing", "inflight": 1},
        ],
    }
