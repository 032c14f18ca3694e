"""A stand-in worker for supervisor tests: an HTTP server with knobs for the ways real workers misbehave.

Run as a script: python stand_in.py --port N [--ready-after S] [--exit-at-start CODE]
[--ignore-sigterm] [--spawn-child].
"""

from __future__ import annotations

import argparse
import http.server
import signal
import subprocess
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ready-after", type=float, default=0.0)
    parser.add_argument("--exit-at-start", type=int, default=None)
    parser.add_argument("--ignore-sigterm", action="store_true")
    parser.add_argument("--spawn-child", action="store_true", help="leave a grandchild in the process group")
    parser.add_argument(
        "--spawn-child-own-group",
        action="store_true",
        help="a grandchild in a process group of its own, which SIGTERM to ours does not reach",
    )
    args = parser.parse_args()
    print(f"stand-in starting on {args.port}", flush=True)
    if args.exit_at_start is not None:
        print("stand-in: simulated start-up failure: out of cheese", flush=True)
        return int(args.exit_at_start)
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.spawn_child:
        # Like vLLM's engine core: a child of the worker, in the worker's process group.
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(f"stand-in child pid {child.pid}", flush=True)
    if args.spawn_child_own_group:
        # Like `splitserve worker` running vLLM with process_group=0 (minus its signal forwarding).
        loner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], process_group=0)
        print(f"stand-in own-group child pid {loner.pid}", flush=True)
    ready_at = time.monotonic() + args.ready_after

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status = 200 if time.monotonic() >= ready_at else 503
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *values: object) -> None:
            pass  # quiet, so the log's last line is the start-up message

    server = http.server.HTTPServer(("127.0.0.1", args.port), Handler)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
