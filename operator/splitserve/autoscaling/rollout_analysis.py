"""The rollout analysis (spec.rollout.analysis), pure: the PromQL for one generation's window, and
the verdict on the new generation against the old from the numbers those queries return.

The controller's loop (controller/loops/analysis.py) runs the queries, calls `analyse` and, on a
failed verdict, pauses the rollout; this module only decides.

Series and labels
-----------------
The router counts finished requests by the KV generation of the decode worker that served them,
`splitserve_router_generation_requests_total{generation,outcome}`, and times their first byte in
`splitserve_router_generation_ttft_seconds_bucket{generation,le}`. Its ServiceMonitor relabels the
router pods' `splitserve.io/deployment` label into `deployment` (plus the usual `namespace`), so a
deployment's router series are selected as `namespace="<ns>",deployment="<name>"`: autoscaling/queries.py's
`$router` without its `pool` label, which these series do not have.

Queries (W = windowSeconds, X = the generation's counter or bucket series)
-------------------------------------------------------------------------
- requests: `sum(clamp_min(X - (X offset Ws or X * 0), 0))` over every outcome;
- failed:   the same over `outcome=~"upstream_error|stream_error|no_capacity"`;
- TTFT p90: `histogram_quantile(0.9, sum by (le) (clamp_min(B - (B offset Ws or B * 0), 0)))`.

"Value now minus value W ago, a series that did not exist then counting as 0" rather than
`increase()`/`rate()`, for the reason queries.py gives for prefillFallbacks: those ignore a counter's
first sample, and the new generation's series are all born during the window (the router creates a
generation's series with that generation's first request), so `increase()` would drop the first
scrape's worth of exactly the requests being judged. `clamp_min` per series: a router restart
(counter reset) counts as nothing in that series, never as minus many.

Legacy pools (worker Deployments made by an operator without generations, id "legacy") run pods
without a generation label, which the router counts under `generation=""`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from splitserve.api.spec import InferenceDeploymentSpec, RolloutAnalysis

REQUESTS_METRIC = "splitserve_router_generation_requests_total"
TTFT_BUCKET_METRIC = "splitserve_router_generation_ttft_seconds_bucket"
# Outcomes the new generation is to blame for; client errors, rejections and cancellations are not.
FAILED_OUTCOMES: tuple[str, ...] = ("upstream_error", "stream_error", "no_capacity")
# The id the controller gives worker Deployments without a generation label.
LEGACY_GENERATION = "legacy"
# Analysis passes per window at least, and the slowest pass: a regression pauses within 30 s of showing.
PASSES_PER_WINDOW = 4
MAX_INTERVAL_SECONDS = 30.0
# Status strings (generations[].analysis, rollout.message) and Event messages stay well under the API's limits.
TEXT_LIMIT = 1024
# Exceeding a limit means by more than float rounding: 0.31 s x 1.5 is 0.46499999999999997, and 0.465 s is not more.
_SLACK = 1e-9

VerdictState = Literal["pending", "passed", "failed", "unknown"]


# --------------------------------------------------------------------------- queries


def router_selector(namespace: str, name: str) -> str:
    """The deployment's router series (see the module docstring)."""
    return f'namespace="{namespace}",deployment="{name}"'


def _router_label(generation: str) -> str:
    return "" if generation == LEGACY_GENERATION else generation


def generation_matcher(generations: Sequence[str]) -> str:
    """A label matcher for one generation (`generation="G"`) or several (`generation=~"A|B"`)."""
    labels = sorted({_router_label(g) for g in generations})
    if not labels:
        raise ValueError("at least one generation is needed")
    for label in labels:
        # Ids are hex hashes (api/generation.py) or "legacy": anything else is a bug, not something to quote.
        if not re.fullmatch(r"[A-Za-z0-9_-]*", label):
            raise ValueError(f"not a generation id: {label!r}")
    if len(labels) == 1:
        return f'generation="{labels[0]}"'
    return f'generation=~"{"|".join(labels)}"'


def _in_window(series: str, window_seconds: int) -> str:
    """Each series' growth over the window, a series born inside it counting from 0 (see the docstring)."""
    return f"clamp_min({series} - ({series} offset {window_seconds}s or {series} * 0), 0)"


@dataclass(frozen=True)
class WindowQueries:
    requests: str
    failed: str
    ttft_p90: str


def window_queries(namespace: str, name: str, generations: Sequence[str], window_seconds: int) -> WindowQueries:
    """The PromQL for one generation (or the old generations together) over the window."""
    selector = f"{router_selector(namespace, name)},{generation_matcher(generations)}"
    failed = f'outcome=~"{"|".join(FAILED_OUTCOMES)}"'
    buckets = f"{TTFT_BUCKET_METRIC}{{{selector}}}"
    return WindowQueries(
        requests=f"sum({_in_window(f'{REQUESTS_METRIC}{{{selector}}}', window_seconds)})",
        failed=f"sum({_in_window(f'{REQUESTS_METRIC}{{{selector},{failed}}}', window_seconds)})",
        ttft_p90=f"histogram_quantile(0.9, sum by (le) ({_in_window(buckets, window_seconds)}))",
    )


def router_presence_query(namespace: str, name: str) -> str:
    """Any per-generation router series of the deployment: tells "not scraped" from "no requests yet"."""
    return f"count({REQUESTS_METRIC}{{{router_selector(namespace, name)}}})"


def analysis_prometheus_url(spec: InferenceDeploymentSpec) -> str:
    analysis = spec.rollout.analysis
    if analysis is not None and analysis.prometheus_url:
        return analysis.prometheus_url
    return spec.autoscaling.prometheus_url


def analysis_interval_seconds(analysis: RolloutAnalysis) -> float:
    """How often the loop judges: at least PASSES_PER_WINDOW times a window, and at least every 30 s.

    Not the autoscaling interval: that one is about how fast pools follow load, may be unset (KEDA,
    HPA, no autoscaling) and says nothing about the window the analysis compares over."""
    return min(MAX_INTERVAL_SECONDS, analysis.window_seconds / PASSES_PER_WINDOW)


# --------------------------------------------------------------------------- verdict


@dataclass(frozen=True)
class WindowNumbers:
    """One generation's (or the old generations') numbers over the window; None: no series."""

    requests: float | None = None
    failed: float | None = None
    ttft_p90: float | None = None

    @property
    def count(self) -> int:
        return round(self.requests or 0.0)

    @property
    def error_rate(self) -> float | None:
        if not self.requests:
            return None
        return min(1.0, (self.failed or 0.0) / self.requests)


@dataclass(frozen=True)
class Verdict:
    state: VerdictState
    text: str
    # What regressed: "error rate" and/or "TTFT p90" (failed verdicts only).
    regressions: tuple[str, ...] = ()


def unknown(why: str) -> Verdict:
    """No verdict for want of data (Prometheus down, nothing scraped): never a reason to pause."""
    return Verdict("unknown", f"Unknown: {why}"[:TEXT_LIMIT])


def _percent(rate: float | None) -> str:
    return "n/a" if rate is None else f"{rate * 100:.1f}%"


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}s"


def analyse(new: WindowNumbers, old: WindowNumbers, analysis: RolloutAnalysis) -> Verdict:
    """The new generation against the old over the window.

    - Pending until the new generation has served minRequests requests in the window;
    - Unknown while the old generation served none (nothing to compare with);
    - Failed when the new error rate exceeds the old by more than maxErrorRateIncrease, or the new
      TTFT p90 exceeds the old times maxTtftP90Ratio (judged only when both have TTFT data);
    - Passed otherwise. The text carries the numbers either way.
    """
    window = analysis.window_seconds
    if new.count < analysis.min_requests:
        return Verdict("pending", f"Pending: {new.count} of {analysis.min_requests} requests in {window}s")
    new_rate, old_rate = new.error_rate, old.error_rate
    if new_rate is None or old_rate is None:
        return unknown(
            f"the old generation served no requests in {window}s to compare with "
            f"(new: error rate {_percent(new_rate)}, TTFT p90 {_seconds(new.ttft_p90)} over {new.count} requests)"
        )
    regressions: list[str] = []
    if new_rate > old_rate + analysis.max_error_rate_increase + _SLACK:
        regressions.append("error rate")
    # Without TTFT data on either side (no streamed first byte yet) only the error rate is judged.
    ttft_judged = new.ttft_p90 is not None and old.ttft_p90 is not None
    if ttft_judged and (new.ttft_p90 or 0.0) > (old.ttft_p90 or 0.0) * analysis.max_ttft_p90_ratio + _SLACK:
        regressions.append("TTFT p90")
    numbers = (
        f"error rate {_percent(new_rate)} vs {_percent(old_rate)} "
        f"(limit +{analysis.max_error_rate_increase * 100:.1f}%); "
        f"TTFT p90 {_seconds(new.ttft_p90)} vs {_seconds(old.ttft_p90)} "
        + (f"(limit x{analysis.max_ttft_p90_ratio:g})" if ttft_judged else "(not judged)")
        + f"; {new.count} vs {old.count} requests in {window}s"
    )
    if regressions:
        return Verdict("failed", f"Failed ({', '.join(regressions)}): {numbers}"[:TEXT_LIMIT], tuple(regressions))
    return Verdict("passed", f"Passed: {numbers}"[:TEXT_LIMIT])


def baseline_text(generation: str, old: WindowNumbers, window_seconds: int) -> str:
    """What an old generation's status entry says: the numbers the new one is compared with."""
    return (
        f"Baseline for {generation}: error rate {_percent(old.error_rate)}, TTFT p90 {_seconds(old.ttft_p90)} "
        f"over {old.count} requests in {window_seconds}s"
    )[:TEXT_LIMIT]
