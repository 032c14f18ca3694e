"""``splitserve sim-worker``: run one (or ``--count`` N) simulated engines until SIGTERM, then drain."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys

from splitserve.sim.config import (
    PROFILES,
    EngineLimits,
    FaultConfig,
    KVEventsConfig,
    KVLoadFailurePolicy,
    LatencyModel,
    LoRAConfig,
    Role,
    SimConfig,
)
from splitserve.sim.kv_publisher import KVEventsBindError
from splitserve.sim.lora import parse_lora_module
from splitserve.sim.server import SimWorker, run_event_loop, serve

_LATENCY_FIELDS = [f.name for f in dataclasses.fields(LatencyModel)]
_LIMIT_FIELDS = [f.name for f in dataclasses.fields(EngineLimits) if f.name != "enable_prefix_caching"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--role", choices=[r.value for r in Role], default=Role.AGGREGATED.value)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (0 = any free port)")
    parser.add_argument("--count", type=int, default=1, help="run N workers in this process on port, port+1, ...")
    parser.add_argument("--model", default="sim-model", help="served model name")
    parser.add_argument("--tokenizer", default=None, help="the model's tokenizer dir: tokenize as vLLM would")
    parser.add_argument(
        "--generation",
        default="",
        help="KV generation this engine stands for (the splitserve.io/generation label): seeds its output text; "
        "KV pulls between engines of different generations are refused",
    )
    parser.add_argument("--profile", choices=sorted(PROFILES), default="cpu-tiny")
    parser.add_argument("--time-scale", type=float, default=1.0, help="multiply all simulated durations")
    latency = parser.add_argument_group("latency model (defaults from --profile)")
    for name in _LATENCY_FIELDS:
        latency.add_argument("--" + name.replace("_", "-"), type=float, default=None, metavar="SECONDS")
    limits = parser.add_argument_group("capacity (defaults from --profile)")
    for name in _LIMIT_FIELDS:
        limits.add_argument("--" + name.replace("_", "-"), type=int, default=None, metavar="N")
    limits.add_argument("--no-prefix-caching", action="store_true")
    kv = parser.add_argument_group("KV transfer")
    kv.add_argument("--kv-hold-timeout-s", type=float, default=480.0, help="free unpulled prefill KV after this")
    kv.add_argument("--side-channel-port", type=int, default=None, help="extra port for KV pulls")
    kv.add_argument("--advertise-host", default=None, help="host put in kv_transfer_params.remote_host")
    kv.add_argument(
        "--kv-load-failure-policy",
        choices=[p.value for p in KVLoadFailurePolicy],
        default=KVLoadFailurePolicy.FAIL.value,
        help="decode side, when a KV pull fails: answer an error, or prefill locally",
    )
    kv.add_argument("--engine-id", default=None, help="remote_engine_id to advertise (default: random UUID)")
    kv.add_argument(
        "--kv-events-config",
        type=_kv_events_config,
        default=None,
        metavar="JSON",
        help="vLLM's flag: publish KV-cache events over ZMQ, e.g. "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv"}\'',
    )
    lora = parser.add_argument_group("LoRA adapters (vLLM's flags)")
    lora.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters besides the base model")
    lora.add_argument("--max-loras", type=int, default=1, help="adapters one batch may hold (default 1)")
    lora.add_argument("--max-lora-rank", type=int, default=16, help="adapters of a higher rank fail to load")
    lora.add_argument("--max-cpu-loras", type=int, default=None, help="accepted; the simulator keeps no weights")
    lora.add_argument(
        "--lora-modules",
        nargs="+",
        type=_lora_module,
        default=[],
        metavar="NAME=PATH",
        help='adapters to load at start (a folder with adapter_config.json), or \'{"name": ..., "path": ...}\'',
    )
    lora.add_argument(
        "--adapters-file",
        default=None,
        metavar="PATH",
        help="keep the loaded adapters equal to this adapters file at run time (splitserve.engine.adapters; "
        "needs --enable-lora)",
    )
    faults = parser.add_argument_group("fault injection")
    faults.add_argument("--fail-rate", type=float, default=0.0, help="fraction of requests answered with 500")
    faults.add_argument("--fail-after-tokens", type=int, default=None, help="drop the connection after N tokens")
    faults.add_argument("--fail-status", type=int, default=None, help="answer every request with this status")
    faults.add_argument("--seed", type=int, default=0)
    parser.add_argument("--drain-timeout-s", type=float, default=30.0)
    parser.add_argument("--log-level", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR"], default="WARNING")


def _kv_events_config(text: str) -> KVEventsConfig:
    try:
        return KVEventsConfig.from_json(text)
    except (ValueError, TypeError) as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def _lora_module(text: str) -> tuple[str, str]:
    try:
        return parse_lora_module(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def lora_config_from_args(args: argparse.Namespace) -> LoRAConfig | None:
    if not args.enable_lora:
        return None
    return LoRAConfig(
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        modules=tuple(args.lora_modules),
    )


def config_from_args(args: argparse.Namespace) -> SimConfig:
    profile = PROFILES[args.profile]
    latency = dataclasses.replace(
        profile.latency, **{n: getattr(args, n) for n in _LATENCY_FIELDS if getattr(args, n) is not None}
    )
    limits = dataclasses.replace(
        profile.limits, **{n: getattr(args, n) for n in _LIMIT_FIELDS if getattr(args, n) is not None}
    )
    if args.no_prefix_caching:
        limits = dataclasses.replace(limits, enable_prefix_caching=False)
    return SimConfig(
        role=Role(args.role),
        host=args.host,
        port=args.port,
        model=args.model,
        profile=args.profile,
        latency=latency,
        limits=limits,
        time_scale=args.time_scale,
        kv_hold_timeout_s=args.kv_hold_timeout_s,
        side_channel_port=args.side_channel_port,
        advertise_host=args.advertise_host,
        engine_id=args.engine_id,
        faults=FaultConfig(args.fail_rate, args.fail_after_tokens, args.fail_status),
        seed=args.seed,
        drain_timeout_s=args.drain_timeout_s,
        kv_load_failure_policy=KVLoadFailurePolicy(args.kv_load_failure_policy),
        kv_events=args.kv_events_config,
        tokenizer=args.tokenizer,
        generation=args.generation,
        lora=lora_config_from_args(args),
    )


def _announce(worker: SimWorker) -> None:
    ready = {
        "event": "ready",
        "role": worker.role.value,
        "url": worker.url,
        "engine_id": worker.engine_id,
        "generation": worker.config.generation,
    }
    print(json.dumps(ready), flush=True)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = config_from_args(args)
    problems = config.problems()
    if args.count < 1:
        problems.append("--count must be at least 1")
    if args.count > 1 and (args.engine_id or args.side_channel_port):
        problems.append("--engine-id and --side-channel-port need --count 1")
    if not args.enable_lora and (args.lora_modules or args.adapters_file):
        problems.append("--lora-modules and --adapters-file need --enable-lora")
    if problems:
        print("splitserve sim-worker: " + "; ".join(problems), file=sys.stderr)
        return 2
    # With --count N, worker i is like vLLM's data-parallel rank i: its KV events ports are offset by i.
    configs = [
        dataclasses.replace(
            config,
            port=config.port + i if config.port else 0,
            kv_events=config.kv_events.shifted(i) if config.kv_events is not None else None,
        )
        for i in range(args.count)
    ]
    try:
        drained = run_event_loop(lambda: serve(configs, announce=_announce, adapters_file=args.adapters_file))
    except ValueError as error:  # an adapter of --lora-modules cannot be loaded
        print(f"splitserve sim-worker: {error}", file=sys.stderr)
        return 1
    except KVEventsBindError as error:
        print(f"splitserve sim-worker: {error}", file=sys.stderr)
        return 1
    except OSError as error:
        print(f"splitserve sim-worker: cannot listen on {config.host}:{config.port}: {error}", file=sys.stderr)
        return 1
    return 0 if drained else 1
