"""Dynamic optimization in the real operator: a real Prometheus scrapes a scripted vLLM-shaped exporter;
the operator (against the API emulator) turns speculative decoding on at sustained low load, honours a
veto, undoes a change that made its target metric worse, switches aggregated -> disaggregated
make-before-break, and changes nothing with dynamic off. The CR's spec is never written.

The emulator runs without its fake controllers here: no Deployment becomes ready unless the test says
so (by patching its status), which is what lets the mode switch be observed between its steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from testkit.emulator.client import EmulatorClient
from testkit.emulator.fixtures import EmulatorProcess
from testkit.operator import NAMESPACE, OperatorProcess, eventually, operator_on_emulator
from testkit.prometheus import PrometheusServer, ScrapeTarget, StaticExporter, requires_prometheus

pytestmark = [requires_prometheus, pytest.mark.prometheus, pytest.mark.emulator, pytest.mark.slow]
IDEP = ("splitserve.io/v1alpha1", "inferencedeployments")
BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
# Seconds, not minutes: a sample a second, 4 s of sustained evidence, judged 7 s after a change on the
# samples after a 2 s settle period.
POLICY = {
    "window_s": 4,
    "min_samples": 3,
    "settle_s": 2,
    "evaluation_s": 7,
    "min_interval_s": 14,
    "retry_after_revert_s": 3600,
}
AUTOPILOT_ENV = {
    "SPLITSERVE_AUTOPILOT_INTERVAL_SECONDS": "1",
    "SPLITSERVE_AUTOPILOT_TELEMETRY_WINDOW": "5s",
    "SPLITSERVE_AUTOPILOT_POLICY": json.dumps(POLICY),
    "SPLITSERVE_DIAGNOSIS_INTERVAL_SECONDS": "600",
}
SPECULATIVE_ON = {"engine": {"speculativeDecoding": {"method": "ngram"}}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmulatorProcess, OperatorProcess]]:
    workdir = tmp_path_factory.mktemp("autopilot")
    with operator_on_emulator(workdir, env=AUTOPILOT_ENV, fake_controllers=False, log_tail=6000) as cluster:
        yield cluster


class Histogram:
    """A cumulative Prometheus histogram whose observations all land in one bucket at a time."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.counts = [0] * len(BUCKETS)
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float, times: int) -> None:
        for index, bound in enumerate(BUCKETS):
            if value <= bound:
                self.counts[index] += times
        self.total += times
        self.sum += value * times

    def text(self) -> str:
        lines = [
            f'{self.name}_bucket{{le="{bound}"}} {count}' for bound, count in zip(BUCKETS, self.counts, strict=True)
        ]
        lines += [f'{self.name}_bucket{{le="+Inf"}} {self.total}', f"{self.name}_sum {self.sum}"]
        lines.append(f"{self.name}_count {self.total}")
        return "\n".join(lines) + "\n"


@dataclass
class Load:
    """What the engine reports. p90 of one bucket (lo, hi] reads lo + 0.9 (hi - lo): itl 0.03 -> 0.047."""

    running: float
    itl: float = 0.03
    ttft: float = 0.15
    prefill: float = 0.15
    histograms: dict[str, Histogram] = field(
        default_factory=lambda: {
            "itl": Histogram("vllm:inter_token_latency_seconds"),
            "ttft": Histogram("vllm:time_to_first_token_seconds"),
            "prefill": Histogram("vllm:request_prefill_time_seconds"),
        }
    )

    def tick(self) -> str:
        self.histograms["itl"].observe(self.itl, 20)
        self.histograms["ttft"].observe(self.ttft, 2)
        self.histograms["prefill"].observe(self.prefill, 2)
        body = f"vllm:num_requests_running {self.running}\n"
        return body + "".join(histogram.text() for histogram in self.histograms.values())


@dataclass
class Telemetry:
    load: Load
    prometheus: PrometheusServer


@contextlib.asynccontextmanager
async def telemetry(tmp_path: Path, name: str, load: Load) -> AsyncIterator[Telemetry]:
    """An exporter labelled as the deployment's decode worker, fed every 0.25 s, and a Prometheus on it."""
    exporter = StaticExporter(load.tick())
    await exporter.start()

    async def feed() -> None:
        while True:
            exporter.body = load.tick()
            await asyncio.sleep(0.25)

    feeder = asyncio.create_task(feed())
    labels = {"namespace": NAMESPACE, "deployment": name, "role": "decode"}
    prometheus = PrometheusServer(tmp_path, [ScrapeTarget(exporter.address, labels)])
    await prometheus.start()
    try:
        yield Telemetry(load, prometheus)
    finally:
        prometheus.stop()
        feeder.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await feeder
        await exporter.stop()


def create(client: EmulatorClient, name: str, prometheus_url: str, **spec: Any) -> dict[str, Any]:
    full = {
        "model": {"name": "m", "source": {"uri": "s3://m"}},
        "autoscaling": {"prometheusUrl": prometheus_url},
        **spec,
    }
    client.create(
        {
            "apiVersion": "splitserve.io/v1alpha1",
            "kind": "InferenceDeployment",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": full,
        }
    )
    written: dict[str, Any] = client.get(*IDEP, name, namespace=NAMESPACE)["spec"]
    return written


def deployment(client: EmulatorClient, name: str) -> dict[str, Any] | None:
    return client.get_or_none("apps/v1", "deployments", name, namespace=NAMESPACE)


def engine_args(client: EmulatorClient, name: str) -> list[str]:
    found = deployment(client, name) or {}
    containers = found.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [{}])
    return list(containers[0].get("args", []))


def speculative(client: EmulatorClient, pool: str) -> bool:
    return "--speculative-config" in engine_args(client, pool)


def status(client: EmulatorClient, name: str) -> dict[str, Any]:
    return client.get(*IDEP, name, namespace=NAMESPACE).get("status") or {}


def events(client: EmulatorClient, name: str, reason: str) -> list[dict[str, Any]]:
    return [
        event
        for event in client.list("v1", "events", namespace=NAMESPACE)
        if event.get("reason") == reason and event.get("involvedObject", {}).get("name") == name
    ]


async def pool_name(client: EmulatorClient, name: str, role: str) -> str:
    """`<name>-<role>-<KV generation>`, with the generation the operator reports. It stays the same
    here: neither the mode nor speculative decoding is a KV generation input."""
    generation = await eventually(lambda: status(client, name).get("kvGeneration"), "status.kvGeneration")
    return f"{name}-{role}-{generation}"


def mark_ready(client: EmulatorClient, name: str) -> None:
    """What a kubelet and the Deployment controller would report once the pool's engine is up."""
    client.patch(
        "apps/v1",
        "deployments",
        name,
        {"status": {"replicas": 1, "readyReplicas": 1, "availableReplicas": 1, "updatedReplicas": 1}},
        namespace=NAMESPACE,
        subresource="status",
    )


async def test_sustained_low_load_turns_speculative_decoding_on_and_dynamic_off_serves_the_spec(
    client: EmulatorClient, tmp_path: Path
) -> None:
    name = "spec-on"
    async with telemetry(tmp_path, name, Load(running=2)) as tel:
        written = create(client, name, tel.prometheus.url, mode="aggregated", optimization={"dynamic": True})
        pool = await pool_name(client, name, "aggregated")
        await eventually(lambda: deployment(client, pool), "the aggregated pool")
        assert not speculative(client, pool)
        await eventually(lambda: speculative(client, pool), "speculative decoding turned on")

        args = engine_args(client, pool)
        config = json.loads(args[args.index("--speculative-config") + 1])
        assert config["method"] == "ngram"
        assert client.get(*IDEP, name, namespace=NAMESPACE)["spec"] == written, "the CR's spec must not change"
        observed = status(client, name)
        assert observed["autopilot"]["overrides"] == SPECULATIVE_ON
        entry = observed["optimization"][-1]
        assert entry["kind"] == "speculativeDecoding" and not entry["reverted"]
        assert entry["action"].startswith("turn speculative decoding on")
        assert entry["numbers"]["batch"] == pytest.approx(2.0)
        assert entry["baseline"] == pytest.approx(0.047, rel=0.05)
        assert "batch=2" in entry["reason"]
        optimized = events(client, name, "Optimized")
        assert optimized and "speculative decoding on" in optimized[0]["message"]

        # A veto added later drops the override at once: the spec is served as written again.
        veto = {"spec": {"optimization": {"veto": ["speculativeDecoding"]}}}
        client.patch(*IDEP, name, veto, namespace=NAMESPACE)
        await eventually(lambda: not speculative(client, pool), "speculative decoding back off")
        await eventually(lambda: status(client, name)["autopilot"]["overrides"] == {}, "overrides dropped")
        dropped = await eventually(lambda: events(client, name, "OptimizationDropped"), "OptimizationDropped")
        assert "vetoed" in dropped[0]["message"]


async def test_a_veto_keeps_the_setting_and_says_so(client: EmulatorClient, tmp_path: Path) -> None:
    name = "vetoed"
    async with telemetry(tmp_path, name, Load(running=2)) as tel:
        optimization = {"dynamic": True, "veto": ["speculativeDecoding"]}
        create(client, name, tel.prometheus.url, mode="aggregated", optimization=optimization)
        note = await eventually(
            lambda: "vetoed" in (n := (status(client, name).get("autopilot") or {}).get("note", "")) and n,
            "a vetoed note",
        )
        assert "speculative decoding on" in note
        await asyncio.sleep(3)
        assert not speculative(client, await pool_name(client, name, "aggregated"))
        assert status(client, name).get("optimization", []) == []
        assert not events(client, name, "Optimized")


async def test_a_change_that_makes_its_target_metric_worse_is_undone(client: EmulatorClient, tmp_path: Path) -> None:
    name = "undone"
    async with telemetry(tmp_path, name, Load(running=2)) as tel:
        create(client, name, tel.prometheus.url, mode="aggregated", optimization={"dynamic": True})
        pool = await pool_name(client, name, "aggregated")
        await eventually(lambda: speculative(client, pool), "speculative decoding turned on")
        tel.load.itl = 0.15  # p90 0.19 s instead of 0.047 s: much worse
        await eventually(lambda: deployment(client, pool) and not speculative(client, pool), "the change undone")

        history = status(client, name)["optimization"]
        assert [entry["kind"] for entry in history] == ["speculativeDecoding", "speculativeDecoding"]
        assert history[0]["undone"] and not history[0]["reverted"]
        assert history[1]["reverted"] and history[1]["action"].startswith("undo:")
        assert history[1]["numbers"]["after"] > history[1]["numbers"]["before"] * 1.1
        assert status(client, name)["autopilot"]["overrides"] == {}
        reverted = events(client, name, "OptimizationReverted")
        assert reverted and "itl_p90 got worse" in reverted[0]["message"]
        # Not tried again (retry_after_revert_s) although the load is still low.
        await asyncio.sleep(4)
        assert not speculative(client, pool)


async def test_aggregated_to_disaggregated_is_make_before_break(client: EmulatorClient, tmp_path: Path) -> None:
    name = "switch"
    # Prefill/decode interference: TTFT p90 0.95 s against prefill p90 0.19 s, 20 sequences per worker.
    load = Load(running=20, ttft=0.8, prefill=0.15)
    workers: set[str] = set()
    seen: list[set[str]] = []

    def worker_deployments() -> set[str]:
        return {d["metadata"]["name"] for d in client.list("apps/v1", "deployments", namespace=NAMESPACE)} & workers

    async def watch() -> None:
        while True:
            seen.append(worker_deployments())
            await asyncio.sleep(0.1)

    async with telemetry(tmp_path, name, load) as tel:
        create(client, name, tel.prometheus.url, mode="aggregated", optimization={"dynamic": True})
        aggregated, prefill, decode = [
            await pool_name(client, name, role) for role in ("aggregated", "prefill", "decode")
        ]
        workers.update((aggregated, prefill, decode))
        await eventually(lambda: deployment(client, aggregated), "the aggregated pool")
        mark_ready(client, aggregated)
        assert "--no-prefill-pool" in engine_args(client, f"{name}-router")
        watcher = asyncio.create_task(watch())
        try:
            await eventually(
                lambda: deployment(client, prefill) and deployment(client, decode),
                "the disaggregated pools created",
            )
            assert status(client, name)["autopilot"]["overrides"] == {"mode": "disaggregated"}
            # The router is applied after the pools in the same reconcile: it learns of the prefill pool
            # (it discovers worker Pods; aggregated, it was told there is no prefill pool).
            await eventually(
                lambda: "--no-prefill-pool" not in engine_args(client, f"{name}-router"),
                "the router told about the prefill pool",
            )
            # The new pools are not ready: the aggregated pool keeps serving, and status says so.
            await asyncio.sleep(3)
            assert deployment(client, aggregated) is not None
            during = status(client, name)
            assert during["mode"] == "aggregated"
            progressing = next(c for c in during["conditions"] if c["type"] == "Progressing")
            assert progressing["reason"] == "SwitchingMode"
            mark_ready(client, prefill)
            await asyncio.sleep(2)
            assert deployment(client, aggregated) is not None, "decode is not ready yet"
            mark_ready(client, decode)
            await eventually(lambda: deployment(client, aggregated) is None, "the old pool removed")
            await eventually(lambda: status(client, name)["mode"] == "disaggregated", "status.mode switched")
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        observed = [names for names in seen if names]
        assert observed and all(names for names in seen), "there was a moment with no worker Deployment"
        assert observed[0] == {aggregated} and observed[-1] == {prefill, decode}
        switched = await eventually(lambda: events(client, name, "ModeSwitched"), "a ModeSwitched Event")
        assert aggregated in switched[0]["message"]
        entry = status(client, name)["optimization"][-1]
        assert entry["kind"] == "mode" and entry["numbers"]["ttft_inflation"] == pytest.approx(5.0, rel=0.1)
        assert client.get(*IDEP, name, namespace=NAMESPACE)["spec"]["mode"] == "aggregated"
        assert client.get_or_none("v1", "services", f"{name}-prefill", namespace=NAMESPACE) is not None

        # Dynamic off: the spec (aggregated) is served as written again, make-before-break the other way.
        seen.clear()
        watcher = asyncio.create_task(watch())
        try:
            client.patch(*IDEP, name, {"spec": {"optimization": {"dynamic": False}}}, namespace=NAMESPACE)
            await eventually(lambda: deployment(client, aggregated), "the aggregated pool again")
            await asyncio.sleep(2)
            assert deployment(client, decode) is not None, "decode serves until aggregated is ready"
            assert client.get_or_none("v1", "services", f"{name}-prefill", namespace=NAMESPACE) is not None
            mark_ready(client, aggregated)
            await eventually(
                lambda: deployment(client, decode) is None and deployment(client, prefill) is None,
                "the disaggregated pools removed",
            )
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        assert all(names for names in seen), "there was a moment with no worker Deployment"
        await eventually(
            lambda: client.get_or_none("v1", "services", f"{name}-prefill", namespace=NAMESPACE) is None,
            "the prefill Service removed with its pool",
        )
        assert status(client, name)["autopilot"]["overrides"] == {}
        await eventually(lambda: status(client, name)["mode"] == "aggregated", "status.mode back to aggregated")


async def test_dynamic_off_changes_nothing(client: EmulatorClient, tmp_path: Path) -> None:
    name = "static"
    async with telemetry(tmp_path, name, Load(running=2)) as tel:
        create(client, name, tel.prometheus.url, mode="aggregated")
        pool = await pool_name(client, name, "aggregated")
        await eventually(lambda: deployment(client, pool), "the aggregated pool")
        await asyncio.sleep(8)  # twice the evidence window, sampled every second if the autopilot ran
        assert not speculative(client, pool)
        observed = status(client, name)
        assert "autopilot" not in observed and observed.get("optimization", []) == []
