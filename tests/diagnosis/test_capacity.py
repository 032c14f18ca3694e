"""Capacity from what the pools do, saturation named, and the TTFT split into its legs (issue 14 §1-3).

The telemetry tables are the shapes of real runs: `KV_HANDOFF_STALL` is the reported vLLM-CPU run
(decode "running" 89 requests while producing 80 tokens/s, the router's KV handoff taking most of TTFT).
"""

from __future__ import annotations

from typing import Any

import pytest

from splitserve.diagnosis.capacity import pool_capacity, pool_load, ttft_breakdown
from splitserve.diagnosis.model_facts import KvShape, ModelFacts
from splitserve.diagnosis.questions import per_token_latency
from splitserve.diagnosis.scale import disaggregation, traffic_needs
from splitserve.diagnosis.telemetry import PoolReadings, Reading, RouterReadings, Telemetry
from tests.diagnosis.conftest import InputFactory, SpecFactory

FACTS_8B = ModelFacts(8.03e9, "model config (test)", KvShape(32, 8, 128), "model config (test)", 32, 131072)
CPU = {"resources": {"gpus": 0, "cpu": "4", "memory": "16Gi"}}
CPU_POOLS = {"prefill": CPU, "decode": CPU}
H100 = {"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}}


def readings(cls: type[Any], **values: float | None) -> Any:
    return cls(**{name: Reading(value, f"q_{name}") for name, value in values.items()})


def telemetry(
    *, prefill: dict[str, Any], decode: dict[str, Any], router: dict[str, Any] | None = None, **values: Any
) -> Telemetry:
    return Telemetry(
        prefill=readings(PoolReadings, **prefill),
        decode=readings(PoolReadings, **decode),
        router=readings(RouterReadings, **(router or {})),
        **{name: Reading(value, f"q_{name}") for name, value in values.items()},  # type: ignore[arg-type]
    )


TRAFFIC: dict[str, Any] = {
    "request_rate": 1.68,
    "prompt_tokens_rate": 1.68 * 576,
    "generation_tokens_rate": 80.0,
    "ttft_p90": 63.0,
    "prefill_time_p90": 0.29,
    "prefix_hits_rate": 0.82 * 1.68 * 576,
    "prefix_queries_rate": 1.68 * 576,
    "output_tokens_count_rate": 1.68,
}
UNSATURATED_PREFILL = {
    "replicas": 1,
    "running": 0.4,
    "waiting": 0.0,
    "prompt_tokens_rate": 970.0,
    "prefix_hits_rate": 795.0,
}
# The reported run: most of decode's "running" requests wait for their KV, few decode.
KV_HANDOFF_STALL = telemetry(
    prefill=UNSATURATED_PREFILL,
    decode={"replicas": 1, "running": 60.0, "waiting": 20.0, "generation_tokens_rate": 80.0, "itl_mean": 0.05},
    router={
        "arrival_rate": 3.0,
        "completion_rate": 1.68,
        "ttft_mean": 30.0,
        "ttft_p90": 51.0,
        "ttft_p99": 60.0,
        "queue_wait_mean": 0.0,
        "prefill_leg_mean": 0.6,
        "kv_handoff_mean": 24.0,
        "kv_handoff_p90": 65.0,
        "queue_depth": 0.0,
    },
    kv_transfer_mean=0.041,
    **TRAFFIC,
)


def test_cpu_pools_never_use_a_datasheet_even_when_a_gpu_is_named(
    make_spec: SpecFactory, make_input: InputFactory
) -> None:
    quiet = telemetry(
        prefill=UNSATURATED_PREFILL,
        decode={"replicas": 1, "running": 2.0, "waiting": 0.0, "generation_tokens_rate": 80.0, "itl_mean": 0.02},
        **TRAFFIC,
    )
    inp = make_input(make_spec(CPU_POOLS), gpu="H100-80GB", telemetry=quiet, facts=FACTS_8B)
    for role in ("prefill", "decode"):
        capacity = pool_capacity(inp, role, 600)
        assert capacity.basis == "lower bound" and "CPU-only pool" in capacity.source
        assert "datasheet" not in capacity.source.replace("no GPU datasheet", "")
    assert traffic_needs(inp) is None  # nothing to size on: the autopilot's ratio lever has no figure either
    result = disaggregation(inp)
    assert result.status == "ok" and result.patch is None and "not estimated" in result.verdict


def test_the_reported_run_names_decode_and_its_kv_handoff(make_spec: SpecFactory, make_input: InputFactory) -> None:
    inp = make_input(make_spec(CPU_POOLS), telemetry=KV_HANDOFF_STALL, facts=FACTS_8B)
    load = pool_load("decode", KV_HANDOFF_STALL.decode)
    assert load is not None and load.saturated and load.decoding == pytest.approx(4.0)
    capacity = pool_capacity(inp, "decode", 600)
    assert capacity.basis == "observed" and capacity.per_replica == pytest.approx(80.0)
    result = disaggregation(inp)
    assert result.status == "problem"
    assert result.verdict.startswith("decode pool saturated: KV handoff takes 80% of TTFT")
    assert "41 ms" in result.verdict and "produce no token" in result.verdict
    # Offered 3 req/s x 48 tokens = 144 tokens/s at 70% of 80 per replica: 3 replicas.
    assert result.patch == {"decode": {"replicas": 3}}
    assert "--max-inflight-per-worker" in result.recommendation and "machine" in result.recommendation
    texts = " | ".join(e.render() for e in result.evidence)
    assert "decode capacity per replica: 80 tokens/s generated (observed)" in texts
    assert "prefill capacity per replica: at least" in texts and "CPU-only pool" in texts


def test_a_saturated_gpu_pool_is_cross_checked_against_its_datasheet(
    make_spec: SpecFactory, make_input: InputFactory
) -> None:
    inp = make_input(make_spec({"prefill": H100, "decode": H100}), gpu=None, telemetry=KV_HANDOFF_STALL, facts=FACTS_8B)
    capacity = pool_capacity(inp, "decode", 600)
    assert capacity.basis == "observed" and capacity.per_replica == pytest.approx(80.0)
    assert "GPU H100-80GB datasheet" in capacity.source and "disagrees" in capacity.source
    # Not saturated, a datasheet that applies is used, and the observation is shown next to it.
    prefill = pool_capacity(inp, "prefill", 600)
    assert prefill.basis == "datasheet" and "observed 175 per replica, not saturated" in prefill.source


def test_an_observed_throughput_far_above_the_datasheet_sets_it_aside(
    make_spec: SpecFactory, make_input: InputFactory
) -> None:
    busy = telemetry(
        prefill={"replicas": 1, "running": 1.0, "waiting": 0.0, "prompt_tokens_rate": 1e9},
        decode={"replicas": 1, "running": 2.0, "waiting": 0.0, "generation_tokens_rate": 80.0, "itl_mean": 0.02},
        **TRAFFIC,
    )
    inp = make_input(make_spec({"prefill": H100, "decode": H100}), gpu=None, telemetry=busy, facts=FACTS_8B)
    capacity = pool_capacity(inp, "prefill", 600)
    assert capacity.basis == "lower bound" and "the datasheet does not fit this pool" in capacity.source


def test_an_unknown_gpu_type_is_not_sized_on_the_default_datasheet(
    make_spec: SpecFactory, make_input: InputFactory
) -> None:
    quiet = telemetry(prefill=UNSATURATED_PREFILL, decode={"replicas": 1, "generation_tokens_rate": 80.0}, **TRAFFIC)
    inp = make_input(make_spec(), gpu=None, telemetry=quiet, facts=FACTS_8B)
    capacity = pool_capacity(inp, "decode", 600)
    assert capacity.basis == "lower bound" and "GPU type unknown" in capacity.source


def test_waiting_for_kv_is_not_waiting_for_a_slot(make_spec: SpecFactory, make_input: InputFactory) -> None:
    # vLLM reports a request pulling its KV as waiting (reason "deferred"): that is the handoff's time,
    # not a full engine. Only waiting for capacity, or stalled "running" requests, saturate the pool.
    pulling = {
        "replicas": 1,
        "running": 3.0,
        "waiting": 2.0,
        "waiting_for_capacity": 0.0,
        "waiting_deferred": 2.0,
        "generation_tokens_rate": 100.0,
        "itl_mean": 0.03,
    }
    load = pool_load("decode", readings(PoolReadings, **pulling))
    assert load is not None and not load.saturated and load.deferred == 2.0
    full = pool_load("decode", readings(PoolReadings, **{**pulling, "waiting_for_capacity": 2.0}))
    assert full is not None and full.saturated and "wait for a batch slot" in full.signs[0]
    # Without the by-reason gauge (older engines), the total counts.
    old = pool_load("decode", readings(PoolReadings, **{**pulling, "waiting_for_capacity": None}))
    assert old is not None and old.saturated


def test_a_growing_queue_saturates_before_its_average_is_high() -> None:
    growing = readings(
        PoolReadings, replicas=1, waiting=0.2, waiting_growth=0.2, waiting_floor=1.0, prompt_tokens_rate=900.0
    )
    load = pool_load("prefill", growing)
    assert load is not None and load.saturated and "grows by 0.20" in load.signs[0]


def test_a_flickering_queue_is_not_growth() -> None:
    """An engine with free slots admits its queue at the next step: a 0/1 waiting gauge whose deriv comes out
    positive (seen in CI: +0.06/s on a decode pool at a quarter of its slots) emptied lately, so it is noise."""
    flickering = readings(
        PoolReadings, replicas=1, waiting=0.2, waiting_growth=0.06, waiting_floor=0.0, generation_tokens_rate=454.0
    )
    load = pool_load("decode", flickering)
    assert load is not None and not load.saturated, load.signs
    by_reason = readings(
        PoolReadings,
        replicas=1,
        waiting=0.2,
        waiting_for_capacity=0.2,
        waiting_for_capacity_growth=0.06,
        waiting_for_capacity_floor=0.0,
        waiting_floor=1.0,  # the total did not empty, but only "deferred" requests kept it up
        generation_tokens_rate=454.0,
    )
    load = pool_load("decode", by_reason)
    assert load is not None and not load.saturated, load.signs


def test_every_pool_saturated_is_named_as_overload(make_spec: SpecFactory, make_input: InputFactory) -> None:
    both = telemetry(
        prefill={"replicas": 1, "running": 4.0, "waiting": 9.0, "prompt_tokens_rate": 400.0},
        decode={"replicas": 1, "running": 16.0, "waiting_for_capacity": 5.0, "generation_tokens_rate": 80.0},
        router={"arrival_rate": 3.0, "completion_rate": 1.0},
        **{**TRAFFIC, "prefix_hits_rate": 0.0},
    )
    result = disaggregation(make_input(make_spec(CPU_POOLS), telemetry=both, facts=FACTS_8B))
    assert result.status == "problem"
    assert result.verdict.startswith("overload: offered 3.00 req/s is above the capacity of every pool")
    assert set(result.patch or {}) == {"prefill", "decode"}


def test_a_backlog_with_no_pool_saturated_blames_admission(make_spec: SpecFactory, make_input: InputFactory) -> None:
    jammed = telemetry(
        prefill=UNSATURATED_PREFILL,
        decode={"replicas": 1, "running": 2.0, "waiting": 0.0, "generation_tokens_rate": 80.0, "itl_mean": 0.02},
        router={"arrival_rate": 6.0, "completion_rate": 1.68, "queue_depth": 12.0},
        **TRAFFIC,
    )
    result = disaggregation(make_input(make_spec(CPU_POOLS), telemetry=jammed, facts=FACTS_8B))
    assert result.status == "problem" and result.verdict.startswith("overload with no pool to blame")
    assert result.patch is None and "router" in result.recommendation


def test_ttft_breakdown_adds_the_legs_and_keeps_the_rest() -> None:
    breakdown = ttft_breakdown(KV_HANDOFF_STALL)
    assert breakdown is not None and breakdown.largest.name == "KV handoff"
    assert [leg.name for leg in breakdown.legs] == ["prefill", "KV handoff", "other"]
    assert sum(leg.seconds for leg in breakdown.legs) == pytest.approx(30.0)
    assert ttft_breakdown(Telemetry()) is None


def test_a_p99_far_outside_the_ttft_slo_is_a_finding(make_spec: SpecFactory, make_input: InputFactory) -> None:
    tail = telemetry(
        prefill=UNSATURATED_PREFILL,
        decode={"replicas": 1, "running": 2.0, "waiting": 0.0, "generation_tokens_rate": 80.0, "itl_mean": 0.02},
        router={"arrival_rate": 1.68, "completion_rate": 1.68, "ttft_mean": 0.8, "ttft_p90": 1.5, "ttft_p99": 9.0},
        **TRAFFIC,
    )
    spec = make_spec({**CPU_POOLS, "autoscaling": {"prefill": {"ttftSloSeconds": 2.0}}})
    result = disaggregation(make_input(spec, telemetry=tail, facts=FACTS_8B))
    assert result.status == "problem" and "holds the 2 s SLO but p99 9.00 s is 4.5x it" in result.verdict
    calm = telemetry(
        prefill=UNSATURATED_PREFILL,
        decode={"replicas": 1, "running": 2.0, "generation_tokens_rate": 80.0},
        router={"arrival_rate": 1.68, "completion_rate": 1.68, "ttft_mean": 0.8, "ttft_p90": 1.5, "ttft_p99": 3.0},
        **TRAFFIC,
    )
    assert disaggregation(make_input(spec, telemetry=calm, facts=FACTS_8B)).status == "ok"


@pytest.mark.parametrize(
    ("engine_p99", "router_p90", "router_p99", "status"),
    [
        (3.9, 0.04, 2.5, "problem"),  # the reported run: p90 inside the SLO, the tail far outside
        (0.08, 0.07, 0.09, "problem"),  # clients see a p90 over the SLO the engines meet
        (0.08, 0.04, 0.09, "ok"),  # the tail within 2x the SLO
    ],
)
def test_itl_is_judged_on_its_tail_and_at_the_router(
    make_spec: SpecFactory,
    make_input: InputFactory,
    engine_p99: float,
    router_p90: float,
    router_p99: float,
    status: str,
) -> None:
    tel = telemetry(
        prefill={},
        decode={},
        router={"itl_p90": router_p90, "itl_p99": router_p99},
        itl_p90=0.048,
        itl_p99=engine_p99,
        running_per_replica=20.0,
    )
    result = per_token_latency(make_input(make_spec(CPU_POOLS), telemetry=tel, facts=FACTS_8B))
    assert result.status == status, result.verdict
    if status == "problem":
        assert "ITL p90 48 ms meets the 50 ms SLO, but the tail does not" in result.verdict


def test_decode_requests_waiting_beyond_the_kv_transfer_are_its_intake_queue(
    make_spec: SpecFactory, make_input: InputFactory
) -> None:
    # 4 req/s at 41 ms per transfer keeps ~0.16 requests in the transfers themselves (Little's law):
    # 3 deferred requests on average are queued for decode's KV intake, not moving bytes.
    queued = {"replicas": 1, "running": 4.0, "waiting_deferred": 3.0, "waiting_for_capacity": 0.0}
    decode = readings(PoolReadings, **queued, requests_rate=4.0, generation_tokens_rate=150.0, itl_mean=0.02)
    load = pool_load("decode", decode, kv_transfer_s=0.041)
    assert load is not None and load.saturated
    assert "2.8 requests wait for their KV beyond the 41 ms transfer itself" in load.signs[0]
    # Without the transfer time the deferred requests may all be transfers: no sign.
    unknown = pool_load("decode", decode)
    assert unknown is not None and not unknown.saturated
    # Transfers slow enough to explain the deferred requests are not a queue: 4 req/s x 0.7 s = 2.8.
    slow = pool_load("decode", decode, kv_transfer_s=0.7)
    assert slow is not None and not slow.saturated
    # Prefill has no KV intake.
    prefill = pool_load("prefill", readings(PoolReadings, **queued, requests_rate=4.0), kv_transfer_s=0.041)
    assert prefill is not None and not prefill.saturated

    tel = telemetry(
        prefill=UNSATURATED_PREFILL,
        decode={**queued, "requests_rate": 4.0, "generation_tokens_rate": 150.0, "itl_mean": 0.02},
        router={"arrival_rate": 4.0, "completion_rate": 4.0, "ttft_mean": 3.0, "prefill_leg_mean": 0.2,
                "kv_handoff_mean": 2.5, "queue_wait_mean": 0.0},
        kv_transfer_mean=0.041,
        **TRAFFIC,
    )  # fmt: skip
    result = disaggregation(make_input(make_spec(CPU_POOLS), telemetry=tel, facts=FACTS_8B))
    assert result.status == "problem" and result.verdict.startswith("decode pool saturated"), result.verdict
    assert "decode's KV intake queues" in result.verdict


def test_requests_held_in_decodes_server_are_a_backlog_its_engine_does_not_count(
    make_spec: SpecFactory, make_input: InputFactory
) -> None:
    # The router has 26 requests in flight at decode; its engine counts 10 running (all decoding: 200
    # tokens/s x 50 ms) and 2 pulling their KV: 14 are held by vLLM's API server, in no queue the engine reports.
    engine = {
        "replicas": 1,
        "running": 10.0,
        "waiting": 2.0,
        "waiting_deferred": 2.0,
        "waiting_for_capacity": 0.0,
        "generation_tokens_rate": 200.0,
        "itl_mean": 0.05,
    }
    load = pool_load("decode", readings(PoolReadings, **engine), router_inflight=26.0)
    assert load is not None and load.saturated
    assert "14.0 of the 26.0 requests the router has sent it are not in its engines yet" in load.signs[0]
    # In flight at the router and counted by the engine: nothing held.
    calm = pool_load("decode", readings(PoolReadings, **engine), router_inflight=12.5)
    assert calm is not None and not calm.saturated
    # No router gauge: no sign either way.
    blind = pool_load("decode", readings(PoolReadings, **engine))
    assert blind is not None and not blind.saturated

    tel = telemetry(
        prefill=UNSATURATED_PREFILL,
        decode=engine,
        router={"arrival_rate": 4.0, "completion_rate": 3.0, "ttft_mean": 4.0, "prefill_leg_mean": 0.3,
                "kv_handoff_mean": 3.2, "queue_wait_mean": 0.0, "decode_inflight": 26.0},
        **TRAFFIC,
    )  # fmt: skip
    result = disaggregation(make_input(make_spec(CPU_POOLS), telemetry=tel, facts=FACTS_8B))
    assert result.status == "problem" and result.verdict.startswith("decode pool saturated"), result.verdict
    assert "14.0 of the 26.0 requests in flight at decode are not in its engine yet" in result.verdict
