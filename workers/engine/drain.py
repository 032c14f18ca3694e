"""Graceful drain of a worker before its engine stops.

Kubernetes sends SIGTERM after the preStop pause; by then the router has seen the endpoint
`terminating` and sends nothing new. vLLM itself stops at once on SIGTERM, which would kill
running requests and, on a prefill worker, drop KV blocks that decode workers have not pulled
yet. So `splitserve worker` holds the SIGTERM until the engine is idle: nothing running or
waiting, and no KV blocks in use (a prefill worker's blocks stay in use until every decode
worker has pulled them), or until the drain deadline, then forwards it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

IDLE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


def engine_is_idle(metrics_text: str) -> bool:
    """True when every gauge that shows work in the engine reads zero (and all were present)."""
    seen: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name in IDLE_GAUGES:
            seen[family.name] = sum(sample.value for sample in family.samples)
    return set(seen) == set(IDLE_GAUGES) and all(value == 0 for value in seen.values())


def wait_until_drained(
    metrics_url: str,
    deadline_s: float,
    *,
    poll_s: float = 0.5,
    stopped: Callable[[], bool] = lambda: False,
) -> bool:
    """Poll the engine's /metrics until idle twice in a row; False when the deadline passed first.

    Two idle readings in a row, because a request may be between the router's connect and the
    engine's scheduler for a moment. An engine that stops answering counts as drained.
    """
    deadline = time.monotonic() + deadline_s
    idle_readings = 0
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline and not stopped():
            try:
                text = client.get(metrics_url).text
            except httpx.HTTPError:
                return True
            idle_readings = idle_readings + 1 if engine_is_idle(text) else 0
            if idle_readings >= 2:
                return True
            time.sleep(poll_s)
    return stopped()
