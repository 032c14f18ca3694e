"""The autopilot's timing knobs come from the operator's environment; a bad one is one clear error line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from splitserve.controller.loops.autopilot import AutopilotSettings


def test_defaults_are_minutes_and_the_policy_is_read_from_json() -> None:
    assert AutopilotSettings.from_environment({}).policy.window_s == 600
    settings = AutopilotSettings.from_environment(
        {
            "SPLITSERVE_AUTOPILOT_INTERVAL_SECONDS": "2",
            "SPLITSERVE_AUTOPILOT_TELEMETRY_WINDOW": "30s",
            "SPLITSERVE_AUTOPILOT_POLICY": '{"window_s": 10, "min_interval_s": 60, "evaluation_s": 20, "settle_s": 5}',
        }
    )
    assert (settings.interval_s, settings.telemetry_window) == (2.0, "30s")
    policy = settings.policy
    assert (policy.window_s, policy.min_interval_s, policy.evaluation_s, policy.settle_s) == (10, 60, 20, 5)
    # The sample window covers the evidence window and the evaluation after a change.
    assert settings.max_samples >= (10 + 60) / 2


@pytest.mark.parametrize(
    "policy",
    [
        '{"window_s": ',
        '{"no_such_knob": 1}',
        '{"evaluation_s": 100, "min_interval_s": 50}',
        '{"evaluation_s": 300}',  # not past the default 420 s settle period
    ],
)
def test_a_bad_policy_stops_the_operator_with_one_line(policy: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "splitserve", "operator", "--standalone"],
        env={**os.environ, "SPLITSERVE_AUTOPILOT_POLICY": policy},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("splitserve operator: bad SPLITSERVE_AUTOPILOT_* setting:"), lines
