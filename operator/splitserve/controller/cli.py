"""`splitserve operator`: run the kopf operator."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import random
import sys

from splitserve.api.base import API_GROUP


def configure(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[], help="namespace to watch (repeatable)")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace (default)")
    peering = parser.add_mutually_exclusive_group()
    peering.add_argument("--peering", default=None, help="kopf peering name: replicas elect one active operator")
    peering.add_argument("--standalone", action="store_true", help="no peering (a single replica)")
    parser.add_argument(
        "--priority", type=int, default=None, help="peering priority (default: random, so exactly one replica wins)"
    )
    parser.add_argument("--liveness", default=None, help="liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    parser.add_argument("--metrics-port", type=int, default=None, help="serve the operator's /metrics on this port")
    parser.add_argument("--verbose", action="store_true")


def run(args: argparse.Namespace) -> int:
    import kopf  # imported here: `splitserve crd` and friends should not pay for it

    from splitserve.controller.loops.autopilot import AutopilotSettings

    try:  # the handlers read these at import; a typo must be one clear line, not a traceback
        AutopilotSettings.from_environment()
    except (ValueError, TypeError) as error:
        print(f"splitserve operator: bad SPLITSERVE_AUTOPILOT_* setting: {error}", file=sys.stderr)
        return 1
    import splitserve.controller.handlers  # noqa: F401  (registers the handlers)
    from splitserve.controller.metrics import OperatorMetrics

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per API call drowns the operator's own log
    metrics = OperatorMetrics()
    if args.metrics_port is not None:
        from prometheus_client import start_http_server

        try:
            start_http_server(args.metrics_port, registry=metrics.registry)
        except OSError as error:
            print(
                f"splitserve operator: cannot serve metrics on port {args.metrics_port}: {error.strerror}",
                file=sys.stderr,
            )
            return 1
    # Replicas with the same priority would all pause (kopf treats them as conflicting).
    priority = args.priority if args.priority is not None else random.randint(1, 1_000_000)
    with contextlib.suppress(KeyboardInterrupt, asyncio.CancelledError):
        kopf.run(
            standalone=args.standalone or args.peering is None,
            peering_name=args.peering,
            priority=priority,
            clusterwide=not args.namespace,
            namespaces=args.namespace,
            liveness_endpoint=args.liveness,
            memo=kopf.Memo(metrics=metrics),
        )
    logging.getLogger(API_GROUP).info("operator stopped")
    return 0
