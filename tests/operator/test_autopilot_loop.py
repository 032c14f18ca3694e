"""`optimize_once` in virtual time with the production policy (minutes): an in-process API emulator,
the real Reconciler, and a scripted telemetry source instead of Prometheus. One call per simulated minute."""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import pytest

from splitserve.controller.loops.autopilot import AutopilotSettings, new_samples, optimize_once
from splitserve.controller.reconcile import IDEP
from splitserve.optimization.autopilot import Decision, Sample
from testkit.cache import fill_cache
from testkit.reconciler import ReconcilerOnEmulator as World
from testkit.reconciler import reconciler_on_emulator

NAMESPACE = "serving"
PLURAL = ("splitserve.io/v1alpha1", "inferencedeployments")
MINUTE = 60.0


@dataclass
class ScriptedTelemetry:
    """Answers the diagnosis queries from a few numbers (None: no data)."""

    batch: float | None = 2.0
    itl: float | None = 0.05
    ttft: float | None = 0.2
    prefill: float | None = 0.2
    # Traffic as the router counts it (requests/s, prompt and output tokens/s); None: no router data.
    requests: float | None = None
    prompt_tokens: float | None = None
    output_tokens: float | None = None

    async def query_scalar(self, promql: str) -> float | None:
        if promql == "vector(1)":
            return 1.0
        for needle, value in (
            ("num_requests_running", self.batch),
            ("inter_token_latency", self.itl),
            ("time_to_first_token", self.ttft),
            ("request_prefill_time", self.prefill),
            ("router_prompt_tokens_count", self.requests),
            ("router_prompt_tokens_sum", self.prompt_tokens),
            ("router_output_tokens_sum", self.output_tokens),
        ):
            if needle in promql:
                return value
        return None

    async def query_vector(self, promql: str) -> Mapping[frozenset[tuple[str, str]], float]:
        return {}


H100 = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}


@pytest.fixture
async def world() -> AsyncIterator[World]:
    async with reconciler_on_emulator(NAMESPACE) as cluster:
        yield cluster


async def create(world: World, name: str, **spec: Any) -> None:
    body = {"model": {"name": "m", "source": {"uri": "s3://m"}}, **spec}
    obj = {"apiVersion": IDEP[0], "kind": IDEP[1], "metadata": {"name": name, "namespace": NAMESPACE}, "spec": body}
    await world.api.create(*PLURAL, obj, namespace=NAMESPACE)
    await fill_cache(world.reconciler.cache, world.api, NAMESPACE)
    await world.reconciler.reconcile_by_name(NAMESPACE, name, prune=True)


async def optimize(
    world: World,
    name: str,
    telemetry: ScriptedTelemetry,
    samples: deque[Sample],
    now: float,
    settings: AutopilotSettings,
) -> Decision | None:
    """One autopilot pass, reading the cluster as the operator's watches would show it."""
    await fill_cache(world.reconciler.cache, world.api, NAMESPACE)
    return await optimize_once(world.reconciler, NAMESPACE, name, telemetry, samples, now, settings)


async def pool_of(world: World, name: str, role: str) -> dict[str, Any]:
    """The role's worker Deployment (`<name>-<role>-<KV generation>`; one outside a rollout)."""
    selector = f"splitserve.io/deployment={name},splitserve.io/role={role}"
    (found,) = await world.api.list("apps/v1", "deployments", namespace=NAMESPACE, label_selector=selector)
    return found


async def args_of(world: World, name: str, role: str = "aggregated") -> list[str]:
    found = await pool_of(world, name, role)
    return list(found["spec"]["template"]["spec"]["containers"][0]["args"])


async def status(world: World, name: str) -> dict[str, Any]:
    found: dict[str, Any] = (await world.api.get(*PLURAL, name, namespace=NAMESPACE)).get("status") or {}
    return found


async def test_production_policy_in_virtual_time_turns_speculative_on_then_undoes_it(world: World) -> None:
    await create(world, "vt", mode="aggregated", optimization={"dynamic": True})
    settings = AutopilotSettings()  # production defaults: 10 min window, 30 min between changes, judged at 10 min
    samples = new_samples(settings)
    telemetry = ScriptedTelemetry(batch=2.0, itl=0.05)
    applied_at = None
    for minute in range(30):
        decision = await optimize(world, "vt", telemetry, samples, minute * MINUTE, settings)
        if decision is not None and decision.action is not None:
            applied_at = minute
            break
    # The first sample is at minute 0; 10 minutes of it are needed, all supporting the change.
    assert applied_at == 10
    assert "--speculative-config" in await args_of(world, "vt")
    assert (await status(world, "vt"))["autopilot"]["overrides"] == {
        "engine": {"speculativeDecoding": {"method": "ngram"}}
    }

    # ITL doubles after the change: judged once 10 minutes have passed, then undone.
    telemetry.itl = 0.1
    undone_at = None
    for minute in range(applied_at + 1, applied_at + 30):
        decision = await optimize(world, "vt", telemetry, samples, minute * MINUTE, settings)
        if decision is not None and decision.action is not None:
            undone_at = minute
            assert decision.action.reverts is not None
            break
    assert undone_at == applied_at + 15
    assert "--speculative-config" not in await args_of(world, "vt")
    observed = await status(world, "vt")
    assert observed["autopilot"]["overrides"] == {}
    assert [entry["undone"] for entry in observed["optimization"]] == [True, False]
    reasons = [reason for _, reason, _ in world.events]
    assert reasons.count("Optimized") == 1 and reasons.count("OptimizationReverted") == 1

    # Low load continues, but the undone change is not retried (4 h), nor anything else proposed.
    for minute in range(undone_at + 1, undone_at + 60):
        decision = await optimize(world, "vt", telemetry, samples, minute * MINUTE, settings)
        assert decision is not None and decision.action is None
    assert "undone recently" in (await status(world, "vt"))["autopilot"]["note"]


async def test_a_change_the_spec_cannot_take_is_not_applied(world: World) -> None:
    # Aggregated without a KV connector: switching to disaggregated would be invalid.
    await create(world, "noconn", mode="aggregated", kvTransfer={"connector": "None"}, optimization={"dynamic": True})
    settings = AutopilotSettings()
    samples = new_samples(settings)
    interfering = ScriptedTelemetry(batch=40.0, ttft=2.0, prefill=0.2)  # inflation 10 at batch 40
    for minute in range(15):
        decision = await optimize(world, "noconn", interfering, samples, minute * MINUTE, settings)
        assert decision is not None and decision.action is None
    autopilot = (await status(world, "noconn"))["autopilot"]
    assert autopilot["note"].startswith("not applied (switch to disaggregated)")
    assert "connector" in autopilot["note"]
    assert autopilot["overrides"] == {}
    assert await pool_of(world, "noconn", "aggregated")


async def test_no_telemetry_means_no_change(world: World) -> None:
    await create(world, "blind", mode="aggregated", optimization={"dynamic": True})
    settings = AutopilotSettings()
    samples = new_samples(settings)
    blind = ScriptedTelemetry(batch=None, itl=None, ttft=None, prefill=None)
    for minute in range(20):
        decision = await optimize(world, "blind", blind, samples, minute * MINUTE, settings)
        assert decision is not None and decision.action is None
    observed = await status(world, "blind")
    assert observed.get("optimization", []) == [] and observed["autopilot"]["overrides"] == {}
    assert "speculative" not in " ".join(await args_of(world, "blind"))


async def test_with_the_autoscaler_on_a_ratio_change_widens_its_bounds_not_the_replicas(world: World) -> None:
    await create(
        world,
        "auto",
        model={"name": "m", "source": {"uri": "s3://m"}, "parameterCount": 8_000_000_000},
        # A GPU type the datasheet knows: the only case where capacity may come from it below saturation.
        prefill={"nodeSelector": H100},
        decode={"nodeSelector": H100},
        autoscaling={"enabled": True, "prefillDecodeRatio": {"min": 0.25, "max": 1.0}},
        optimization={"dynamic": True},
    )
    before = {pool: (await pool_of(world, "auto", pool))["spec"]["replicas"] for pool in ("prefill", "decode")}
    settings = AutopilotSettings()
    samples = new_samples(settings)
    # Long prompts, short answers: the traffic needs far more prefill than decode.
    prompt_heavy = ScriptedTelemetry(batch=2.0, requests=20.0, prompt_tokens=160_000.0, output_tokens=200.0)
    action = None
    for minute in range(15):
        decision = await optimize(world, "auto", prompt_heavy, samples, minute * MINUTE, settings)
        assert decision is not None
        if decision.action is not None:
            action = decision.action
            break
    assert action is not None and action.kind == "ratio", "no ratio change in 15 minutes"
    overrides = (await status(world, "auto"))["autopilot"]["overrides"]
    widened = overrides["autoscaling"]["prefillDecodeRatio"]["max"]
    assert set(overrides) == {"autoscaling"} and widened > 1.5  # only the max moved, past the band
    assert action.numbers["needed_ratio"] * 1.5 == pytest.approx(widened, rel=0.01)
    after = {pool: (await pool_of(world, "auto", pool))["spec"]["replicas"] for pool in ("prefill", "decode")}
    assert after == before  # pool sizes stay the autoscaler's
    assert [reason for _, reason, _ in world.events].count("Optimized") == 1


@pytest.mark.parametrize(
    "pools",
    [
        pytest.param({"resources": {"gpus": 0, "cpu": "4", "memory": "16Gi"}}, id="cpu-only"),
        pytest.param({}, id="gpu-type-unknown"),
    ],
)
async def test_no_ratio_change_from_a_datasheet_that_does_not_apply(world: World, pools: dict[str, Any]) -> None:
    # The same prompt-heavy traffic as above, on pools no datasheet describes and that are not saturated:
    # their capacity is unknown, so the ratio lever has nothing to act on (issue 14 §7).
    await create(
        world,
        "cpu",
        model={"name": "m", "source": {"uri": "s3://m"}, "parameterCount": 8_000_000_000},
        prefill=pools,
        decode=pools,
        autoscaling={"enabled": True, "prefillDecodeRatio": {"min": 0.25, "max": 1.0}},
        optimization={"dynamic": True},
    )
    settings = AutopilotSettings()
    samples = new_samples(settings)
    prompt_heavy = ScriptedTelemetry(batch=8.0, requests=20.0, prompt_tokens=160_000.0, output_tokens=200.0)
    for minute in range(15):
        decision = await optimize(world, "cpu", prompt_heavy, samples, minute * MINUTE, settings)
        assert decision is not None
        assert decision.action is None or decision.action.kind != "ratio", decision.action
    assert samples and all(sample.needed_ratio is None for sample in samples)
    assert "prefillDecodeRatio" not in (await status(world, "cpu"))["autopilot"]["overrides"].get("autoscaling", {})
