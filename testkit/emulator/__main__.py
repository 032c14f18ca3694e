"""`python -m testkit.emulator --port N [--kubeconfig PATH] [--state FILE]`: serve the emulator until killed."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path

from testkit.emulator.kubeconfig import write_kubeconfig
from testkit.emulator.server import running_emulator


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m testkit.emulator", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (printed on start)")
    parser.add_argument("--kubeconfig", type=Path, help="write a kubeconfig pointing at the emulator here")
    parser.add_argument("--state", type=Path, help="persist objects to this JSON file and reload them on start")
    parser.add_argument(
        "--no-fake-controllers", action="store_true", help="do not fill in Deployment/StatefulSet status"
    )
    parser.add_argument(
        "--omit",
        action="append",
        default=[],
        metavar="GROUP[/PLURAL]",
        help="do not serve this built-in API group or resource (e.g. monitoring.coreos.com); repeatable",
    )
    return parser


async def _serve(args: argparse.Namespace) -> None:
    async with running_emulator(
        host=args.host,
        port=args.port,
        state_file=args.state,
        fake_controllers=not args.no_fake_controllers,
        omitted_resources=args.omit,
    ) as emulator:
        if args.kubeconfig is not None:
            write_kubeconfig(args.kubeconfig, emulator.url)
        print(f"emulator serving on {emulator.url}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await stop.wait()
        # Open watches would keep a graceful shutdown waiting; an emulator has nothing to flush.
        os._exit(0)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        asyncio.run(_serve(args))
    except OSError as e:
        print(f"error: cannot serve on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
