"""The autoscaler's signal reader: its PromQL (splitserve.autoscaling.queries) run against Prometheus,
then the pure evaluation (splitserve.autoscaling.evaluation)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from splitserve.api.spec import InferenceDeploymentSpec
from splitserve.autoscaling.decision import AutoscalerState
from splitserve.autoscaling.evaluation import Evaluation, evaluated, held
from splitserve.autoscaling.queries import (
    FIELD_BY_SIGNAL,
    Pool,
    PoolSignals,
    QueryTemplateError,
    autoscaled_pools,
    queries_for_pool,
)
from splitserve.io.prometheus import PrometheusClient, PrometheusUnavailable


async def read_pool(client: PrometheusClient, queries: dict[str, str]) -> PoolSignals:
    """Run one pool's queries (signal name → PromQL) concurrently. PrometheusUnavailable propagates."""
    signals = list(queries)
    values = await asyncio.gather(*(client.query_scalar(queries[signal]) for signal in signals))
    return PoolSignals(**{FIELD_BY_SIGNAL[signal]: value for signal, value in zip(signals, values, strict=True)})


async def read_signals(
    client: PrometheusClient, spec: InferenceDeploymentSpec, namespace: str, name: str
) -> dict[Pool, PoolSignals]:
    """Every autoscaled pool's signals. Raises PrometheusUnavailable when Prometheus cannot answer."""
    pools = autoscaled_pools(spec)
    results = await asyncio.gather(
        *(read_pool(client, queries_for_pool(spec.autoscaling, pool, namespace, name)) for pool in pools)
    )
    return dict(zip(pools, results, strict=True))


async def evaluate(
    spec: InferenceDeploymentSpec,
    namespace: str,
    name: str,
    current: Mapping[str, int],
    state: AutoscalerState,
    now: float,
    client: PrometheusClient,
    *,
    ready: Mapping[str, int] | None = None,
) -> Evaluation:
    """Read every pool's signals and decide. Never raises for Prometheus trouble: it holds sizes instead."""
    try:
        signals = await read_signals(client, spec, namespace, name)
    except (PrometheusUnavailable, QueryTemplateError) as exc:
        # Both hold the sizes; a bad override is the user's to fix (validation reports it too), so it
        # gets its own reason instead of looking like an outage.
        reason = "InvalidQuery" if isinstance(exc, QueryTemplateError) else "PrometheusUnavailable"
        return held(spec, current, state, now, reason, str(exc), ready=ready)
    return evaluated(spec, current, signals, state, now, ready=ready)
