"""`splitserve worker --adapters-file`: the sync runs beside the engine (a stand-in serving vLLM's
runtime LoRA API) and stops with it, and the flag turns that API on in the engine's environment."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from splitserve.engine import cli
from splitserve.local.ports import free_port

STAND_IN = textwrap.dedent(
    """
    import json, os, signal, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    loras = {}
    class Engine(BaseHTTPRequestHandler):
        def answer(self, body):
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        def do_GET(self):
            cards = [{"id": "base", "parent": None}]
            self.answer({"data": cards + [{"id": n, "root": p, "parent": "base"} for n, p in loras.items()]})
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            loras[body["lora_name"]] = body["lora_path"]
            self.answer("Success")
        def log_message(self, *args):
            pass
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # no interpreter shutdown under serving threads
    port = int(sys.argv[sys.argv.index("--port") + 1])
    ThreadingHTTPServer(("127.0.0.1", port), Engine).serve_forever()
    """
)
RUNNER = textwrap.dedent(
    """
    import sys
    from splitserve.api.spec import Role
    from splitserve.engine.launcher import LaunchPlan, run_engine
    from splitserve.engine.cli import _log_adapters
    _log_adapters()
    plan = LaunchPlan(Role.DECODE, ["--port", sys.argv[2]], {"PYTHONPATH": sys.argv[1]}, server_module="stand_in")
    sys.exit(run_engine(plan, adapters_file=sys.argv[3]))
    """
)


def test_the_worker_runs_the_sync_beside_its_engine(tmp_path: Path) -> None:
    (tmp_path / "stand_in.py").write_text(STAND_IN)
    adapters = tmp_path / "adapters.json"
    adapters.write_text(json.dumps({"adapters": [{"name": "a", "path": "/adapters/a"}]}))
    argv = [sys.executable, "-c", RUNNER, str(tmp_path), str(free_port()), str(adapters)]
    with subprocess.Popen(argv, stderr=subprocess.PIPE, text=True) as worker:
        try:
            assert worker.stderr is not None
            lines = iter(worker.stderr.readline, "")
            assert "splitserve worker: adapter a: loaded from /adapters/a\n" in lines  # read up to it
            assert next(lines) == "splitserve worker: adapters: loaded a\n"
            worker.send_signal(signal.SIGTERM)
            status, rest = worker.wait(timeout=20), worker.stderr.read()
            assert status == 0, rest
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()


def test_the_worker_flag_turns_on_vllms_runtime_lora_api(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    cli.configure(parser)
    argv = ["--role", "decode", "--adapters-file", str(tmp_path / "a.json"), "--", "--model", "/m"]
    plan = cli.build_plan(parser.parse_args(argv), {})
    assert plan.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert "without --enable-lora" in (cli.adapters_warning(plan, "a.json") or "")
    with_lora = cli.build_plan(parser.parse_args([*argv, "--enable-lora"]), {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    assert with_lora.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"  # what the pod sets wins
    assert cli.adapters_warning(with_lora, "a.json") is None
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in cli.build_plan(parser.parse_args(argv[:2] + argv[4:]), {}).env
