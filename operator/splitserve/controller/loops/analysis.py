"""The rollout analysis loop: while a new KV generation rolls out, compare it with the generations it
replaces over spec.rollout.analysis' window, and pause the rollout on a regression.

One pass (`analyse_once`) per InferenceDeployment, read from the reconciler's cache:
- nothing to do unless status.rollout is present and not paused and spec.rollout.analysis is set;
- the numbers come from the router's per-generation metrics in Prometheus
  (splitserve.autoscaling.rollout_analysis builds the PromQL and judges);
- the verdict text goes into status.generations[].analysis (the new generation's entry; the old ones'
  get the baseline numbers);
- a failed verdict sets status.rollout.paused (reason RolloutPaused, message: the numbers) and asks
  for a reconcile: the plan then scales the new generation to 0, which puts the traffic back on the
  old one, and posts the Warning Event RolloutPaused.

Missing data (Prometheus unreachable, the router not scraped, no old requests) gives an "Unknown: ..."
verdict and never pauses: a rollout must not stop because monitoring is down.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from pydantic import ValidationError

from splitserve.api.spec import RolloutAnalysis
from splitserve.api.status import InferenceDeploymentStatus, RolloutStatus
from splitserve.autoscaling.rollout_analysis import (
    Verdict,
    WindowNumbers,
    analyse,
    analysis_interval_seconds,
    analysis_prometheus_url,
    baseline_text,
    router_presence_query,
    unknown,
    window_queries,
)
from splitserve.controller.reconcile import Reconciler, read_live
from splitserve.io.prometheus import PrometheusUnavailable

log = logging.getLogger("splitserve.analysis")

PAUSED_REASON = "RolloutPaused"


class ScalarSource(Protocol):
    """What the loop needs of Prometheus (io.prometheus.PrometheusClient, or a script in tests)."""

    async def query_scalar(self, promql: str) -> float | None: ...


# The Prometheus to ask, by URL (spec.rollout.analysis.prometheusUrl or autoscaling.prometheusUrl).
SourceFor = Callable[[str], ScalarSource]
# Asks for a reconcile of (namespace, name); the operator passes its coalescer's request.
ReconcileRequest = Callable[[str, str], Awaitable[None] | None]


async def read_window(
    prometheus: ScalarSource, namespace: str, name: str, generations: list[str], window_seconds: int
) -> WindowNumbers:
    """One generation's numbers (or several generations' together) over the window."""
    queries = window_queries(namespace, name, generations, window_seconds)
    requests, failed, ttft = await asyncio.gather(
        prometheus.query_scalar(queries.requests),
        prometheus.query_scalar(queries.failed),
        prometheus.query_scalar(queries.ttft_p90),
    )
    return WindowNumbers(requests=requests, failed=failed, ttft_p90=ttft)


async def judge(
    prometheus: ScalarSource, namespace: str, name: str, rollout: RolloutStatus, analysis: RolloutAnalysis
) -> tuple[Verdict, WindowNumbers | None]:
    """The verdict on rollout.generation against rollout.replacing, and the old numbers (None when
    unread). Never raises for Prometheus trouble: that is an Unknown verdict."""
    window = analysis.window_seconds
    try:
        new, old = await asyncio.gather(
            read_window(prometheus, namespace, name, [rollout.generation], window),
            read_window(prometheus, namespace, name, rollout.replacing, window),
        )
        if new.requests is None and old.requests is None:
            present = await prometheus.query_scalar(router_presence_query(namespace, name))
            if not present:
                return unknown(
                    f"no router metrics for {namespace}/{name} in Prometheus "
                    "(is spec.monitoring on and the router scraped?)"
                ), None
    except PrometheusUnavailable as exc:
        return unknown(str(exc)), None
    return analyse(new, old, analysis), old


def _recorded(
    status: InferenceDeploymentStatus,
    generation: str,
    verdict: Verdict,
    baseline: str | None,
) -> tuple[InferenceDeploymentStatus, bool]:
    """The status with the verdict written (and the rollout paused when it failed); True if it paused now."""
    rollout = status.rollout
    if rollout is None or rollout.generation != generation or rollout.paused:
        return status, False  # the rollout moved on (or was paused) while Prometheus was asked
    generations = [
        entry.model_copy(update={"analysis": verdict.text})
        if entry.id == generation
        else (entry.model_copy(update={"analysis": baseline}) if baseline and entry.id in rollout.replacing else entry)
        for entry in status.generations
    ]
    update: dict[str, Any] = {"generations": generations}
    pausing = verdict.state == "failed"
    if pausing:
        update["rollout"] = rollout.model_copy(
            update={"paused": True, "reason": PAUSED_REASON, "message": verdict.text}
        )
    return status.model_copy(update=update), pausing


def _rollout_under_analysis(body: Mapping[str, Any]) -> RolloutStatus | None:
    """The rollout to judge; None when there is none, it is paused, or the status is behind the spec."""
    try:
        status = InferenceDeploymentStatus.model_validate(body.get("status") or {})
    except ValidationError:
        return None
    rollout = status.rollout
    if rollout is None or rollout.paused or not rollout.replacing:
        return None
    # The status still describes an earlier spec's rollout: the plan is about to replace it.
    if status.kv_generation and status.kv_generation != rollout.generation:
        return None
    return rollout


def analysis_settings(spec: Mapping[str, Any]) -> RolloutAnalysis | None:
    """spec.rollout.analysis of a raw spec (kopf's), None when unset or invalid (the reconciler reports that)."""
    raw = (spec.get("rollout") or {}).get("analysis")
    if not raw:
        return None
    try:
        return RolloutAnalysis.model_validate(raw)
    except ValidationError:
        return None


def interval_seconds(spec: Mapping[str, Any]) -> float:
    """Seconds between passes for a raw spec (see analysis_interval_seconds)."""
    analysis = analysis_settings(spec)
    return analysis_interval_seconds(analysis if analysis is not None else RolloutAnalysis())


async def analyse_once(
    reconciler: Reconciler,
    namespace: str,
    name: str,
    prometheus: SourceFor,
    *,
    reconcile: ReconcileRequest | None = None,
) -> Verdict | None:
    """One pass for one InferenceDeployment; returns the verdict, None when nothing was judged.

    `reconcile` asks for the reconcile that acts on a pause (default: `reconciler.reconcile_by_name`
    at once; the operator passes its coalescer, which serialises and retries it)."""
    found = read_live(reconciler.cache, namespace, name)
    if found is None:
        return None
    body, spec = found
    analysis = spec.rollout.analysis
    rollout = _rollout_under_analysis(body)
    if analysis is None or rollout is None:
        return None
    verdict, old = await judge(prometheus(analysis_prometheus_url(spec)), namespace, name, rollout, analysis)
    baseline = baseline_text(rollout.generation, old, analysis.window_seconds) if old is not None else None
    paused = False

    def record(status: InferenceDeploymentStatus) -> InferenceDeploymentStatus:
        nonlocal paused
        status, paused = _recorded(status, rollout.generation, verdict, baseline)
        return status

    await reconciler.update_status(namespace, name, record)
    if not paused:
        return verdict
    # The reconcile this asks for posts the one RolloutPaused Event (controller/rollout.py), with
    # these numbers and where the traffic went.
    log.warning("%s/%s: rollout of %s paused: %s", namespace, name, rollout.generation, verdict.text)
    if reconcile is None:
        await reconciler.reconcile_by_name(namespace, name)
    else:
        result = reconcile(namespace, name)
        if result is not None:
            await result
    return verdict
