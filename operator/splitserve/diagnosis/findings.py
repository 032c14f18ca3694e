"""The shapes a diagnosis is made of (input, evidence, result) and small helpers the questions share."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from splitserve.api.spec import InferenceDeploymentSpec, Mode, PoolSpec
from splitserve.api.status import Finding
from splitserve.diagnosis.buckets import Judged, Unit, bucket_text, judge
from splitserve.diagnosis.gpus import GpuChoice
from splitserve.diagnosis.model_facts import ModelFacts
from splitserve.diagnosis.telemetry import Reading, Telemetry

Status = Literal["ok", "recommend", "problem", "unknown"]
Patch = dict[str, Any]


@dataclass(frozen=True)
class Evidence:
    text: str
    source: str

    def render(self) -> str:
        return f"{self.text} [{self.source}]"


@dataclass(frozen=True)
class Alternative:
    description: str
    patch: Patch


@dataclass(frozen=True)
class QuestionResult:
    number: int
    key: str
    title: str
    status: Status
    verdict: str
    evidence: tuple[Evidence, ...] = ()
    recommendation: str = ""
    patch: Patch | None = None
    alternatives: tuple[Alternative, ...] = ()

    def to_finding(self) -> Finding:
        return Finding(
            question=f"{self.number}. {self.title}",
            verdict=self.verdict,
            evidence="; ".join(e.render() for e in self.evidence),
            recommendation=self.recommendation,
            patch=self.patch,
        )


@dataclass(frozen=True)
class Tail:
    """A latency quantile judged against its SLO: "problem" when it is certainly outside, "unknown" when a
    histogram bucket holds both the quantile and the limit (the histogram cannot tell)."""

    status: Status
    verdict: str
    evidence: tuple[Evidence, ...] = ()
    recommendation: str = ""
    patch: Patch | None = None


@dataclass(frozen=True)
class DiagnosisInput:
    spec: InferenceDeploymentSpec
    facts: ModelFacts
    gpus: Mapping[str, GpuChoice]  # pool name -> GPU it runs on
    telemetry: Telemetry | None = None
    telemetry_note: str = "no --prometheus given"
    notes: tuple[str, ...] = field(default_factory=tuple)

    def no_telemetry(self, what: str) -> str:
        return f"no telemetry: {what} ({self.telemetry_note})"


def pools_in_use(spec: InferenceDeploymentSpec) -> list[tuple[str, PoolSpec]]:
    """Aggregated mode serves from one pool with decode's settings."""
    if spec.mode is Mode.AGGREGATED:
        return [("decode", spec.decode)]
    return [("prefill", spec.prefill), ("decode", spec.decode)]


def arg_value(args: Sequence[str], name: str) -> str | None:
    """Value of `--name v` or `--name=v` in a vLLM argument list; the last one wins, as in argparse."""
    value: str | None = None
    for index, arg in enumerate(args):
        if arg == name and index + 1 < len(args):
            value = args[index + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def without_arg(args: Sequence[str], name: str) -> list[str]:
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg == name:
            skip = True
            continue
        if arg.startswith(name + "="):
            continue
        out.append(arg)
    return out


def pool_args(spec: InferenceDeploymentSpec, pool: PoolSpec) -> list[str]:
    """Engine-wide then per-pool extra args: the pool's come later on the command line and win."""
    return [*spec.engine.extra_args, *pool.extra_args]


def merge_patches(*patches: Patch | None) -> Patch | None:
    merged: Patch = {}
    for patch in patches:
        if patch:
            _merge_into(merged, patch)
    return merged or None


def _merge_into(target: Patch, patch: Patch) -> None:
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge_into(target[key], value)
        else:
            target[key] = value


QUESTIONS_ASKED: dict[int, tuple[str, str]] = {
    1: ("hardware-fit", "Hardware-model fit"),
    2: ("prompt-redundancy", "Prompt redundancy"),
    3: ("output-variance", "Output length variance"),
    4: ("kv-pressure", "KV cache fragmentation and pressure"),
    5: ("per-token-latency", "Per-token latency"),
    6: ("disaggregation", "Prefill/decode interference and scale"),
}


def answer(
    number: int,
    status: Status,
    verdict: str,
    evidence: Sequence[Evidence] = (),
    recommendation: str = "",
    patch: Patch | None = None,
    alternatives: Sequence[Alternative] = (),
) -> QuestionResult:
    key, title = QUESTIONS_ASKED[number]
    return QuestionResult(
        number, key, title, status, verdict, tuple(evidence), recommendation, patch or None, tuple(alternatives)
    )


def pct(value: float) -> str:
    return f"{value * 100:.0f}%"


def tokens_text(value: float) -> str:
    if value >= 1e6:
        return f"{value / 1e6:.2f}M"
    if value >= 1e4:
        return f"{value / 1e3:.0f}k"
    return f"{value:.0f}"


def prom_source(reading: Reading) -> str:
    return f"prometheus: {reading.query}"


def judged(reading: Reading, limit: float) -> Judged | None:
    """A quantile reading against a limit, within the resolution of its histogram's buckets; None: no data."""
    if reading.value is None or math.isnan(reading.value):
        return None
    return judge(reading.value, limit, reading.buckets)


def bucket_evidence(quantile: str, limit: str, found: Judged, unit: Unit, tel: Telemetry) -> Evidence:
    """Where the bucket that holds both a quantile and its limit was read from."""
    return Evidence(
        f"{quantile} and {limit} lie in the same histogram bucket, {bucket_text(found, unit)} "
        "(a limit on one of the histogram's bounds is judged exactly)",
        f"prometheus: {tel.histogram_buckets_query}",
    )


def fmt_value(value: float | None, fmt: str = "") -> str:
    """A number for people: 'no data' for None; 12,345 above 100, three significant digits below."""
    if value is None:
        return "no data"
    if fmt:
        return fmt.format(value)
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
