"""`splitserve worker`: the worker containers' entrypoint; runs one vLLM engine for a role.

    splitserve worker --role prefill -f deployment.yaml [--port N] [--model PATH] [--cpu]
    splitserve worker --role decode -- --model /models/llama --port 8000 ...
    splitserve worker ... --adapters-file /etc/splitserve/adapters/adapters.json

With --adapters-file the worker also keeps vLLM's LoRA adapters equal to that file at run time
(adapters.py), and sets VLLM_ALLOW_RUNTIME_LORA_UPDATING for it.

With -f the vLLM arguments are built from an InferenceDeployment file (the same builder the operator
uses); after `--` they are the arguments the operator rendered into the pod. Settings that would make
vLLM fail are reported as one line before it starts.

Exit status: vLLM's own; 1 for a setting refused before start; 75 when the engine's NIXL side-channel
listener died (its port taken during start-up, or it stopped listening later), after one line saying
so, so that Kubernetes restarts the pod at once instead of after the startup probe's 30 minutes.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from splitserve.api.base import KIND
from splitserve.api.spec import InferenceDeploymentSpec, Role
from splitserve.builders.vllm_args import (
    CPU_DEFAULT_KV_CACHE_BYTES,
    RUNTIME_LORA_ENV,
    build_engine_launch,
    cpu_engine_args,
    with_option,
)
from splitserve.engine.launcher import (
    LaunchError,
    LaunchPlan,
    engine_environment,
    preflight,
    run_engine,
)
from splitserve.engine.listener import EXIT_LISTENER_DEAD

PROG = "splitserve worker"


def adapters_warning(plan: LaunchPlan, adapters_file: str | None) -> str | None:
    """A line to print when an adapters file is given to an engine that cannot load adapters."""
    if adapters_file is None or "--enable-lora" in plan.vllm_args:
        return None
    return f"warning: --adapters-file {adapters_file} without --enable-lora: vLLM will refuse every adapter"


def _log_adapters() -> None:
    """The adapter sync's lines on stderr, among vLLM's, as the worker's own lines are."""
    logger = logging.getLogger("splitserve.engine")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"{PROG}: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def configure(parser: argparse.ArgumentParser) -> None:
    parser.usage = "%(prog)s --role ROLE (-f SPEC.yaml | -- VLLM_ARGS...) [options]"
    parser.epilog = (
        f"exit status: vLLM's own; 1: a setting refused before start; {EXIT_LISTENER_DEAD}: vLLM stopped"
        " because its NIXL side-channel listener died (its port was taken, or it stopped listening)"
    )
    parser.add_argument("--role", required=True, choices=[role.value for role in Role], help="what this engine does")
    parser.add_argument("-f", "--file", help="InferenceDeployment YAML to build the vLLM arguments from")
    parser.add_argument("--port", type=int, help="HTTP port (default: the spec's engine.port, or vLLM's)")
    parser.add_argument("--model", help="load the model from here instead of the spec's model.source")
    parser.add_argument("--cpu", action="store_true", help="run on vLLM-CPU (eager, float32, 1 OpenMP thread)")
    parser.add_argument(
        "--kv-cache-bytes",
        help=f"KV cache size, e.g. 256M or 1G (--kv-cache-memory-bytes; --cpu default {CPU_DEFAULT_KV_CACHE_BYTES})",
    )
    parser.add_argument(
        "--kv-events-port",
        type=int,
        help="with -f: port of the KV-event publisher when the role's pool is routed precise-prefix "
        "(default: the spec's engine.kvEventsPort; `splitserve up` gives each local worker its own)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="on SIGTERM, wait up to this long for running requests to finish and held KV to be pulled",
    )
    parser.add_argument(
        "--adapters-file",
        metavar="PATH",
        help='keep the engine\'s LoRA adapters equal to this JSON file, at run time ({"adapters": [{"name", '
        '"path" | "huggingFace": {"repo", "revision"}}]}; read every 2 s; needs --enable-lora)',
    )
    parser.add_argument("--dry-run", action="store_true", help="print the command and environment, start nothing")
    parser.add_argument("vllm_args", nargs="*", metavar="VLLM_ARGS", help="vLLM server arguments after --")


class SpecFileError(Exception):
    pass


def _first_error(error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    return f"{where}: {first['msg']}" if where else first["msg"]


def load_spec(path: str) -> InferenceDeploymentSpec:
    """The spec of the InferenceDeployment in a YAML file (a whole object, or just its spec)."""
    try:
        documents = [doc for doc in yaml.safe_load_all(Path(path).read_text(encoding="utf-8")) if doc is not None]
    except OSError as error:
        raise SpecFileError(f"{path}: cannot read: {error.strerror}") from error
    except yaml.YAMLError as error:
        raise SpecFileError(f"{path}: not valid YAML: {str(error).splitlines()[0]}") from error
    candidates: list[Any] = [doc for doc in documents if isinstance(doc, dict) and doc.get("kind") == KIND]
    if not candidates:
        candidates = [doc for doc in documents if isinstance(doc, dict) and "model" in doc]  # a bare spec
    if not candidates:
        raise SpecFileError(f"{path}: no {KIND} in the file")
    document = candidates[0]
    wire = document.get("spec", {}) if document.get("kind") == KIND else document
    try:
        return InferenceDeploymentSpec.model_validate(wire)
    except ValidationError as error:
        raise SpecFileError(f"{path}: invalid {KIND}: {_first_error(error)}") from error


def build_plan(args: argparse.Namespace, environ: dict[str, str]) -> LaunchPlan:
    role = Role(args.role)
    if args.file and args.vllm_args:
        raise LaunchError("give either -f SPEC.yaml or vLLM arguments after --, not both")
    if args.file:
        spec = load_spec(args.file)
        try:
            launch = build_engine_launch(
                spec,
                role,
                port=args.port,
                model=args.model,
                cpu=args.cpu,
                kv_cache_memory_bytes=args.kv_cache_bytes,
                kv_events_port=args.kv_events_port,
            )
        except ValueError as error:
            raise LaunchError(f"{args.file}: {error}") from error
        vllm_args, launch_env = launch.args, launch.env
    elif args.vllm_args:
        if args.kv_events_port is not None:
            # After `--` the KV-event endpoint is whatever --kv-events-config says; nothing to splice into.
            raise LaunchError("--kv-events-port needs -f SPEC.yaml; after -- set the port in --kv-events-config")
        vllm_args = list(args.vllm_args)
        if args.port is not None:
            vllm_args = with_option(vllm_args, "--port", str(args.port))
        if args.model is not None:
            vllm_args = with_option(vllm_args, "--model", args.model)
        if args.cpu:
            vllm_args = cpu_engine_args(vllm_args, args.kv_cache_bytes)
        elif args.kv_cache_bytes is not None:
            vllm_args = with_option(vllm_args, "--kv-cache-memory-bytes", args.kv_cache_bytes)
        launch_env = {}
    else:
        raise LaunchError("nothing to run: give -f SPEC.yaml or vLLM arguments after --")
    if args.adapters_file:
        # The adapter sync loads and unloads through vLLM's runtime LoRA API, which this turns on.
        launch_env = {RUNTIME_LORA_ENV: "True", **launch_env}
    return LaunchPlan(role=role, vllm_args=vllm_args, env=engine_environment(environ, launch_env, cpu=args.cpu))


def _changed_env(plan: LaunchPlan, environ: dict[str, str]) -> dict[str, str]:
    return {name: value for name, value in plan.env.items() if environ.get(name) != value}


def run(args: argparse.Namespace) -> int:
    environ = dict(os.environ)
    try:
        plan = build_plan(args, environ)
        if args.dry_run:
            for name, value in sorted(_changed_env(plan, environ).items()):
                print(f"{name}={shlex.quote(value)}")
            print(shlex.join(plan.argv))
            return 0
        preflight(plan)
    except (LaunchError, SpecFileError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 1
    print(f"{PROG}: starting vLLM ({plan.role}) on port {plan.port}: {shlex.join(plan.argv)}", file=sys.stderr)
    if args.adapters_file:
        _log_adapters()
        warning = adapters_warning(plan, args.adapters_file)
        if warning is not None:
            print(f"{PROG}: {warning}", file=sys.stderr)
    return run_engine(plan, drain_timeout_s=args.drain_timeout, adapters_file=args.adapters_file)
