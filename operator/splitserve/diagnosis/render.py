"""Present a diagnosis: an aligned text table, a stable JSON document, and a one-line summary.

The JSON layout is a contract (docs/diagnosis.md): keys are camelCase, always present, in a fixed
order; `patch` is a JSON merge patch on the InferenceDeployment or null.
"""

from __future__ import annotations

import json
import math
import shutil
import textwrap
from collections.abc import Iterator, Sequence
from typing import Any

from splitserve.api.status import Finding
from splitserve.diagnosis.findings import DiagnosisInput, QuestionResult, pools_in_use

JSON_SCHEMA_VERSION = "splitserve.io/v1alpha1"
FIT_WORDS = ("fits", "tight", "does not fit", "fit unknown")


def _leaves(patch: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in patch.items():
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict) and value:
            yield from _leaves(value, path)
        else:
            yield path, value


def tag_for_patch(patch: dict[str, Any] | None) -> str:
    """A short name for what a patch changes ('fp8+tp2', 'prefix-aware', 'spec-decode')."""
    if not patch:
        return ""
    tags: list[str] = []
    replica_pools: set[str] = set()
    for path, value in _leaves(patch):
        pool, _, leaf = path.partition(".")
        tag = ""
        if path == "model.quantization":
            tag = str(value)
        elif leaf == "tensorParallelSize":
            tag = f"tp{value}"
        elif path.startswith("router.routingPolicy."):
            tag = str(value)
        elif path == "engine.prefixCaching":
            tag = "prefix-caching"
        elif path == "engine.speculativeDecoding.method":
            tag = "spec-decode-off" if value == "off" else "spec-decode"
        elif path.endswith("maxNumSeqs") or path.endswith("extraArgs"):
            tag = "batching"
        elif path == "engine.gpuMemoryUtilization":
            tag = "gpu-memory"
        elif path == "engine.blockSize":
            tag = "block-size"
        elif path == "mode":
            tag = str(value)
        elif leaf in ("replicas", "maxReplicas") and pool in ("prefill", "decode"):
            replica_pools.add(pool)
        elif path.startswith("autoscaling.prefillDecodeRatio"):
            tag = "pd-ratio"
        elif path == "autoscaling.decode.runningPerReplica":
            tag = "decode-batch"
        elif path == "model.maxModelLen":
            tag = "max-model-len"
        if tag and tag not in tags:
            tags.append(tag)
    if replica_pools == {"prefill", "decode"}:
        tags.append("pd-ratio")
    elif replica_pools:
        tags.append(f"{replica_pools.pop()}-replicas")
    return "+".join(dict.fromkeys(tags))


def summarise(findings: Sequence[QuestionResult | Finding]) -> str:
    """One short line for a kubectl column, e.g. 'fits; 2 recommendations: prefix-aware, spec-decode'."""
    fit = "fit unknown"
    tags: list[str] = []
    telemetry_missing = False
    for finding in findings:
        if isinstance(finding, QuestionResult):
            number, verdict, patch = finding.number, finding.verdict, finding.patch
            acts = finding.status in ("recommend", "problem")
            fallback = finding.key
        else:
            number_text = finding.question.split(".", 1)[0]
            number = int(number_text) if number_text.isdigit() else 0
            verdict, patch = finding.verdict, finding.patch
            acts = bool(finding.recommendation or finding.patch)
            fallback = finding.question.split(". ", 1)[-1].lower().replace(" ", "-")
        telemetry_missing = telemetry_missing or "no telemetry" in verdict
        if number == 1:
            fit = next((word for word in FIT_WORDS if verdict.startswith(word)), fit)
        if acts:
            tags.append(tag_for_patch(patch) or fallback)
    count = len(tags)
    if not count:
        line = f"{fit}; no recommendations"
    else:
        noun = "recommendation" if count == 1 else "recommendations"
        line = f"{fit}; {count} {noun}: {', '.join(tags)}"
    return line + (" (no telemetry)" if telemetry_missing else "")


def to_json_document(
    name: str, namespace: str | None, inp: DiagnosisInput, results: Sequence[QuestionResult], prometheus: str | None
) -> dict[str, Any]:
    facts = inp.facts
    return {
        "apiVersion": JSON_SCHEMA_VERSION,
        "kind": "Diagnosis",
        "deployment": {"name": name, "namespace": namespace, "mode": inp.spec.mode.value},
        "summary": summarise(results),
        "telemetry": {
            "prometheus": prometheus,
            "available": inp.telemetry is not None,
            "note": inp.telemetry_note,
            # Each histogram read as a quantile: its finite bucket bounds (`le`; +Inf is implied), so a reader
            # can see how finely a quantile against an SLO is known.
            "histogramBuckets": {
                name: [bound for bound in bounds if math.isfinite(bound)]
                for name, bounds in (inp.telemetry.histogram_buckets if inp.telemetry is not None else ())
            },
        },
        "gpus": {
            pool: {
                "type": choice.gpu.name,
                "memoryGiB": choice.gpu.memory_gib,
                "source": choice.source,
                "assumed": choice.assumed,
            }
            for pool, choice in inp.gpus.items()
        },
        "model": {
            "parameterCount": None if facts.parameter_count is None else round(facts.parameter_count),
            "parameterSource": facts.parameter_source,
            "kvSource": facts.kv_source,
            "configNote": facts.config_note,
        },
        "findings": [
            {
                "number": result.number,
                "key": result.key,
                "question": result.title,
                "status": result.status,
                "verdict": result.verdict,
                "evidence": [{"text": e.text, "source": e.source} for e in result.evidence],
                "recommendation": result.recommendation,
                "patch": result.patch,
                "alternatives": [{"description": a.description, "patch": a.patch} for a in result.alternatives],
            }
            for result in results
        ],
    }


def render_json(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=2, ensure_ascii=False) + "\n"


def render_text(
    name: str, namespace: str | None, inp: DiagnosisInput, results: Sequence[QuestionResult], width: int | None = None
) -> str:
    width = width or max(80, min(140, shutil.get_terminal_size((120, 24)).columns))
    where = f" (namespace {namespace})" if namespace else ""
    lines = [f"Diagnosis of InferenceDeployment {name}{where}, mode {inp.spec.mode.value}"]
    for pool, spec_pool in pools_in_use(inp.spec):
        if spec_pool.resources.gpus == 0:
            lines.append(f"  {pool}: CPU only (resources.gpus 0)")
            continue
        choice = inp.gpus[pool]
        lines.append(f"  {pool} GPU: {choice.gpu.name} {choice.gpu.memory_gib:g} GiB ({choice.source})")
    if inp.facts.parameter_count is not None:
        lines.append(f"  model: {inp.facts.parameter_count / 1e9:.2f}B parameters ({inp.facts.parameter_source})")
    else:
        lines.append("  model: parameter count unknown")
    lines.append(f"  telemetry: {'yes' if inp.telemetry is not None else 'none'} ({inp.telemetry_note})")
    lines.append("")

    title_width = max(len(r.title) for r in results) if results else 8
    status_width = max(len("STATUS"), *(len(r.status) for r in results)) if results else 6
    prefix_width = 3 + title_width + 2 + status_width + 2
    verdict_width = max(20, width - prefix_width)
    lines.append(f"{'#':<3}{'QUESTION':<{title_width}}  {'STATUS':<{status_width}}  VERDICT")
    for result in results:
        wrapped = textwrap.wrap(result.verdict, verdict_width) or [""]
        lines.append(f"{result.number:<3}{result.title:<{title_width}}  {result.status:<{status_width}}  {wrapped[0]}")
        lines.extend(" " * prefix_width + more for more in wrapped[1:])
    lines.append("")
    detail_indent = "     "
    for result in results:
        lines.extend(
            textwrap.wrap(f"{result.number}. {result.title}: {result.verdict}", width, subsequent_indent="   ")
        )
        for evidence in result.evidence:
            lines.extend(
                textwrap.wrap(evidence.render(), width, initial_indent="   - ", subsequent_indent=detail_indent)
            )
        if result.recommendation:
            lines.extend(
                textwrap.wrap(
                    "recommend: " + result.recommendation,
                    width,
                    initial_indent="   > ",
                    subsequent_indent=detail_indent,
                )
            )
        if result.patch:
            lines.append("   patch: " + json.dumps(result.patch, separators=(", ", ": ")))
        lines.append("")
    lines.append("summary: " + summarise(results))
    return "\n".join(lines) + "\n"
