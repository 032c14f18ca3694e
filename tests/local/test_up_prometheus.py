"""`splitserve up --prometheus`, then `splitserve diagnose -f FILE --prometheus URL` with no selector (issue 14 §5).

The end-to-end test runs what a user runs: `up` as a subprocess with the engine simulators, the Debian
Prometheus it starts, real streaming requests through the router, and the `diagnose` CLI as a
subprocess. A replica change while serving shows the scrape targets follow the stack's processes.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from splitserve.local.plan import ProcessSpec
from splitserve.local.prometheus import LocalPrometheus, scrape_groups, server_config
from testkit.prometheus import requires_prometheus
from testkit.upctl import ENDPOINT_LINE, REPO, run_up, start_up

PROMETHEUS_LINE = re.compile(r"^Prometheus: (http://127\.0\.0\.1:\d+) ")
TINY = REPO / "deploy/local/tiny-disaggregated.yaml"
DIAGNOSE = (sys.executable, "-m", "splitserve", "diagnose")


def query(url: str, promql: str) -> list[dict[str, object]]:
    response = httpx.get(f"{url}/api/v1/query", params={"query": promql}, timeout=10)
    response.raise_for_status()
    result: list[dict[str, object]] = response.json()["data"]["result"]
    return result


def wait_for(url: str, promql: str, check: object, seconds: float = 60) -> list[dict[str, object]]:
    """Poll until `check(result)` holds: scrapes come every 2 s, how many it takes depends on the machine."""
    deadline = time.monotonic() + seconds
    result: list[dict[str, object]] = []
    while time.monotonic() < deadline:
        result = query(url, promql)
        if callable(check) and check(result):
            return result
        time.sleep(0.5)
    raise AssertionError(f"{promql}: never satisfied; last {result}")


def labels_of(result: list[dict[str, object]]) -> list[dict[str, str]]:
    return [entry["metric"] for entry in result]  # type: ignore[misc]


@pytest.mark.slow
@pytest.mark.prometheus
@requires_prometheus
def test_up_with_prometheus_then_diagnose_with_default_selectors(tmp_path: Path) -> None:
    document = yaml.safe_load(TINY.read_text())
    document["metadata"]["namespace"] = "laptop"  # diagnose matches metadata.namespace when the file has one
    document["spec"]["decode"]["maxReplicas"] = 2
    file = tmp_path / "tiny.yaml"
    file.write_text(yaml.safe_dump(document, sort_keys=False))
    up = start_up(
        "--engine", "sim", "-f", str(file), "--port", "0", "--prometheus", "--prometheus-port", "0", run_dir=tmp_path
    )
    try:
        endpoint = up.wait_for_line(ENDPOINT_LINE, seconds=60).group(1)
        prometheus = up.wait_for_line(PROMETHEUS_LINE, seconds=10).group(1)
        diagnose_hint = up.wait_for_line(re.compile(r"diagnose: (splitserve diagnose .*)$"), seconds=5).group(1)
        assert f"-f {file} --prometheus {prometheus}" in diagnose_hint

        targets = wait_for(prometheus, 'up{deployment="tiny-disaggregated"} == 1', lambda r: len(r) == 3)
        roles = sorted(entry["role"] for entry in labels_of(targets))
        assert roles == ["decode", "prefill", "router"]
        assert all(entry["namespace"] == "laptop" for entry in labels_of(targets))
        assert all(entry.get("generation") for entry in labels_of(targets) if entry["role"] != "router")

        client = openai.OpenAI(base_url=endpoint, api_key="unused", max_retries=0, timeout=30)
        for index in range(12):
            stream = client.completions.create(
                model="tiny-llama", prompt=f"request {index}: " + "word " * 40, max_tokens=16, stream=True
            )
            assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        wait_for(
            prometheus,
            'sum(splitserve_router_requests_total{deployment="tiny-disaggregated",namespace="laptop"})',
            lambda r: bool(r) and float(r[0]["value"][1]) >= 12,
        )
        wait_for(prometheus, 'sum(vllm:generation_tokens_total{role="decode"})', lambda r: bool(r))

        diagnosis = subprocess.run(
            [*DIAGNOSE, "-f", str(file), "--prometheus", prometheus, "--window", "1m", "-o", "json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert diagnosis.returncode == 0, diagnosis.stderr
        report = json.loads(diagnosis.stdout)
        assert report["telemetry"]["available"] is True, report["telemetry"]
        findings = {finding["key"]: finding for finding in report["findings"]}
        # The router's traffic and the engines' counters were found under the default selectors.
        assert findings["output-variance"]["status"] != "unknown", findings["output-variance"]
        assert findings["disaggregation"]["status"] != "unknown", findings["disaggregation"]
        assert "no traffic" not in findings["disaggregation"]["verdict"]

        # Scale decode 1 -> 2 while serving: the new worker is scraped, with the same labels.
        document["spec"]["decode"]["replicas"] = 2
        file.write_text(yaml.safe_dump(document, sort_keys=False))
        up.wait_for_line(re.compile(r"decode 1 -> 2"), seconds=60)
        scaled = wait_for(prometheus, 'up{role="decode",namespace="laptop"} == 1', lambda r: len(r) == 2)
        assert {entry["deployment"] for entry in labels_of(scaled)} == {"tiny-disaggregated"}
    finally:
        up.stop()
    assert up.popen.returncode == 0
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{prometheus}/-/ready", timeout=2)  # stopped with the stack


@pytest.mark.slow
def test_without_a_prometheus_binary_up_says_so_and_serves(tmp_path: Path) -> None:
    up = start_up(
        "--engine",
        "sim",
        "-f",
        str(TINY),
        "--port",
        "0",
        "--prometheus",
        "--prometheus-port",
        "0",
        "--smoke",
        run_dir=tmp_path,
        env={"SPLITSERVE_PROMETHEUS_BINARY": str(tmp_path / "no-such-prometheus")},
    )
    assert up.popen.wait(timeout=60) == 0, up.stderr()
    up.wait_for_line(re.compile(r"warning: --prometheus: no prometheus binary found \(apt-get install"), seconds=5)
    up.wait_for_line(re.compile(r"^answer: '.+'$"), seconds=5)


def test_prometheus_port_needs_prometheus(tmp_path: Path) -> None:
    result = run_up("--engine", "sim", "-f", str(TINY), "--prometheus-port", "9999", run_dir=tmp_path)
    assert result.returncode == 1 and "--prometheus-port needs --prometheus" in result.stderr


def worker(name: str, role: str, port: int, generation: str = "g1") -> ProcessSpec:
    return ProcessSpec(name=name, argv=("x",), port=port, ready_path="/health", role=role, generation=generation)


def test_scrape_groups_carry_the_labels_diagnose_matches() -> None:
    router = ProcessSpec(name="router", argv=("x",), port=8000, ready_path="/health")
    groups = scrape_groups(
        "tiny", "default", [router, worker("decode-0", "decode", 9001), worker("p", "prefill", 9002)]
    )
    assert [group.to_file_sd() for group in groups] == [
        {"targets": ["127.0.0.1:8000"], "labels": {"namespace": "default", "deployment": "tiny", "role": "router"}},
        {
            "targets": ["127.0.0.1:9001"],
            "labels": {"namespace": "default", "deployment": "tiny", "role": "decode", "generation": "g1"},
        },
        {
            "targets": ["127.0.0.1:9002"],
            "labels": {"namespace": "default", "deployment": "tiny", "role": "prefill", "generation": "g1"},
        },
    ]


def test_targets_file_is_rewritten_only_on_change(tmp_path: Path) -> None:
    prometheus = LocalPrometheus(tmp_path, 9090, "prometheus")
    spec = prometheus.process_spec()
    assert spec.ready_path == "/-/ready" and f"--config.file={prometheus.config_path}" in spec.argv
    config = yaml.safe_load(prometheus.config_path.read_text())
    assert config == server_config(prometheus.targets_path)
    assert json.loads(prometheus.targets_path.read_text()) == []  # Prometheus starts with a valid, empty file
    groups = scrape_groups("tiny", "default", [worker("decode-0", "decode", 9001)])
    assert prometheus.write_targets(groups) is True
    assert prometheus.write_targets(groups) is False
    assert json.loads(prometheus.targets_path.read_text()) == [group.to_file_sd() for group in groups]
    assert not list(tmp_path.glob("prometheus/*.partial"))
