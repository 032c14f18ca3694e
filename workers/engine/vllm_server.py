"""The engine process `splitserve worker` starts: vLLM's OpenAI API server, with splitserve's engine waits.

    python -m splitserve.engine.vllm_server VLLM_SERVER_ARGS...

Importing this module installs the waits its environment asks for (waits.py). vLLM starts its engine
core and worker processes with multiprocessing's spawn method, and spawn imports the parent's main
module in each child before anything else: so every process of the engine, not only the first, has the
waits installed before vLLM creates its queues and its NIXL agent. (A vLLM general plugin runs too late
for that: the worker process creates its queues before it loads plugins.)
"""

from __future__ import annotations

import os
import sys

from splitserve.engine.waits import install_from_env

SETTINGS = install_from_env(os.environ)


def main() -> None:
    print(f"splitserve: engine waits: {SETTINGS.describe()}", file=sys.stderr, flush=True)
    from vllm.entrypoints.launchers.api_server.entry import main as serve

    serve()  # type: ignore[no-untyped-call]


if __name__ == "__main__":
    main()
