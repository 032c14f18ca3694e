"""`splitserve diagnose -f FILE`: the six-question diagnosis for one InferenceDeployment."""

from __future__ import annotations

import argparse
import asyncio
import math
import re
import sys
from datetime import datetime
from typing import Any

import yaml
from pydantic import ValidationError

from splitserve.api.base import KIND
from splitserve.api.spec import InferenceDeploymentSpec
from splitserve.commands.common import UserError, read_input
from splitserve.diagnosis.gpus import UnknownGpu, known_gpu_names
from splitserve.io.telemetry import run_diagnosis


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Answer the six diagnostic questions (hardware fit, prompt redundancy, output variance, KV pressure, "
        "per-token latency, disaggregation) for the first InferenceDeployment in FILE. Without --prometheus "
        "the telemetry questions say so and answer from the spec alone."
    )
    parser.add_argument("-f", "--filename", required=True, help="YAML file ('-' for stdin)")
    parser.add_argument("--prometheus", metavar="URL", help="Prometheus HTTP API, e.g. http://localhost:9090")
    parser.add_argument("--gpu", metavar="TYPE", help=f"GPU type; one of {', '.join(known_gpu_names())}")
    parser.add_argument("-o", "--output", choices=("text", "json"), default="text")
    parser.add_argument("--model-dir", metavar="DIR", help="local directory (or config.json) of the model")
    parser.add_argument("--window", default="5m", help="PromQL rate window (default 5m)")
    parser.add_argument(
        "--at",
        metavar="TIME",
        help="read the window that ended at TIME instead of now (an incident after the fact): RFC 3339 "
        "(2026-12-06T14:05:00Z) or Unix seconds",
    )
    parser.add_argument("--namespace", help="namespace for telemetry label matching (default: metadata.namespace)")
    parser.add_argument(
        "--engine-selector", help='PromQL label matchers for vLLM series (default: namespace="NS",deployment="NAME")'
    )
    parser.add_argument("--router-selector", help="PromQL label matchers for router series (same default)")


def first_deployment(text: str, filename: str) -> dict[str, Any]:
    try:
        documents = [doc for doc in yaml.safe_load_all(text) if doc is not None]
    except yaml.YAMLError as error:
        raise UserError(f"{filename}: not valid YAML: {str(error).splitlines()[0]}") from error
    for document in documents:
        if isinstance(document, dict) and document.get("kind") == KIND:
            return document
    raise UserError(f"{filename}: no {KIND} document found")


def parse_spec(document: dict[str, Any], filename: str) -> InferenceDeploymentSpec:
    try:
        return InferenceDeploymentSpec.model_validate(document.get("spec") or {})
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        more = f" (and {error.error_count() - 1} more; run splitserve validate)" if error.error_count() > 1 else ""
        raise UserError(f"{filename}: invalid spec at spec.{where}: {first['msg']}{more}") from error


def check_window(window: str) -> str:
    if not re.fullmatch(r"(\d+(ms|[smhdwy]))+", window):
        raise UserError(f"--window {window!r} is not a PromQL duration (e.g. 5m, 90s, 1h30m)")
    return window


def parse_at(text: str | None) -> float | None:
    """--at as Unix seconds: RFC 3339 with a zone (a time without one would depend on this machine's zone)."""
    if text is None:
        return None
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        if not math.isfinite(seconds) or seconds < 0:
            raise UserError(f"--at {text!r} is not a time")
        return seconds
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise UserError(f"--at {text!r} is neither RFC 3339 (2026-12-06T14:05:00Z) nor Unix seconds") from None
    if moment.tzinfo is None:
        raise UserError(f"--at {text!r} has no time zone: add Z for UTC or an offset such as +01:00")
    return moment.timestamp()


def run(args: argparse.Namespace) -> int:
    try:
        check_window(args.window)
        at = parse_at(args.at)
        if at is not None and not args.prometheus:
            raise UserError("--at reads telemetry from the past: it needs --prometheus URL")
        document = first_deployment(read_input(args.filename), args.filename)
        spec = parse_spec(document, args.filename)
        metadata = document.get("metadata") or {}
        name = str(metadata.get("name", "unnamed"))
        namespace = args.namespace or metadata.get("namespace")
        report = asyncio.run(
            run_diagnosis(
                spec,
                name=name,
                namespace=namespace,
                prometheus_url=args.prometheus,
                gpu=args.gpu,
                model_dir=args.model_dir,
                window=args.window,
                engine_selector=args.engine_selector,
                router_selector=args.router_selector,
                at=at,
            )
        )
    except (UserError, UnknownGpu) as error:
        print(f"splitserve diagnose: {error}", file=sys.stderr)
        return 1
    sys.stdout.write(report.json() if args.output == "json" else report.text())
    return 0
