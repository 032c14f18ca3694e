"""The one console script, ``splitserve``.

Each subcommand lives in its own module that exposes ``configure(parser)`` and ``run(args) -> int``.
Modules are imported only for the subcommand being run, so ``splitserve crd`` does not pay for
importing kopf, aiohttp or vLLM.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Protocol, cast

# name -> (module, one-line help). Later features register here and nowhere else.
COMMANDS: dict[str, tuple[str, str]] = {
    "operator": ("splitserve.controller.cli", "run the kopf operator (reconciles InferenceDeployments)"),
    "crd": ("splitserve.commands.crd", "print the InferenceDeployment CustomResourceDefinition"),
    "validate": ("splitserve.commands.validate", "check InferenceDeployment YAML offline (schema + CEL)"),
    "render": ("splitserve.commands.render", "print every manifest the operator would apply for a CR"),
    "diff": ("splitserve.commands.diff", "say whether a spec change starts a new KV generation (offline)"),
    "worker": ("splitserve.engine.cli", "run a vLLM worker for a role (prefill, decode, aggregated)"),
    "tiny-model": ("splitserve.engine.tiny_model_cli", "build a tiny random-weight Llama model offline"),
    "sim-worker": ("splitserve.sim.cli", "run an engine simulator that speaks vLLM's HTTP API"),
    "router": ("splitserve.router.cli", "run the KV-transfer router (OpenAI-compatible endpoint)"),
    "epp": ("splitserve.gateway.epp", "run the Gateway API Inference Extension endpoint picker (Envoy ext_proc)"),
    "sidecar": ("splitserve.gateway.sidecar", "run the decode-side P/D proxy a gateway's picker steers"),
    "up": ("splitserve.local.cli", "run an InferenceDeployment locally as processes"),
    "diagnose": ("splitserve.commands.diagnose", "answer the six-question diagnosis for a deployment"),
}


class CommandModule(Protocol):
    def configure(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


def _top_level_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitserve",
        description="Disaggregated LLM serving on Kubernetes.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n" + "\n".join(f"  {name:<12} {text}" for name, (_, text) in COMMANDS.items()),
    )
    parser.add_argument("command", choices=sorted(COMMANDS), metavar="COMMAND")
    parser.add_argument("--version", action="version", version="splitserve 0.1.0")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if not args_list or args_list[0] not in COMMANDS:
        _top_level_parser().parse_args(args_list or ["--help"])
        return 2
    name, rest = args_list[0], args_list[1:]
    module_name, help_text = COMMANDS[name]
    module = cast(CommandModule, importlib.import_module(module_name))
    parser = argparse.ArgumentParser(prog=f"splitserve {name}", description=help_text)
    module.configure(parser)
    return module.run(parser.parse_args(rest))


if __name__ == "__main__":
    raise SystemExit(main())
