"""The worker's drain decision reads vLLM's gauges: idle only when nothing runs, waits or holds KV."""

from __future__ import annotations

import pytest

from splitserve.engine.drain import engine_is_idle


def metrics(running: float, waiting: float, kv: float) -> str:
    return (
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{model_name="m",engine="0"}} {running}\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{model_name="m",engine="0"}} {waiting}\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f'vllm:kv_cache_usage_perc{{model_name="m",engine="0"}} {kv}\n'
    )


@pytest.mark.parametrize(
    ("running", "waiting", "kv", "idle"),
    [
        (0, 0, 0, True),
        (1, 0, 0.1, False),
        (0, 3, 0, False),
        (0, 0, 0.05, False),  # a prefill worker still holding KV for a decode pull
    ],
)
def test_engine_is_idle(running: float, waiting: float, kv: float, idle: bool) -> None:
    assert engine_is_idle(metrics(running, waiting, kv)) is idle


def test_missing_gauges_are_not_idle() -> None:
    assert engine_is_idle("# nothing here\n") is False
