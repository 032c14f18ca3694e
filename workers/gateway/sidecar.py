"""``splitserve sidecar``: the decode pod's P/D proxy, steered by the gateway's endpoint picker.

The gateway sends a request to a decode pod's sidecar. With ``x-prefiller-host-port`` (set by
splitserve's picker, or by llm-d's: the same header), the sidecar runs the router's own two legs:
prefill on that pod with KV kept for remote decode, then decode on its local vLLM with the returned
``kv_transfer_params``, streamed back; one request id throughout. Without the header it serves the
request on its local vLLM as it is.

It is a :class:`~splitserve.router.app.Router` whose decode pool is the local worker alone and whose
prefill pool comes from the router's discovery (Pods, a file, or static URLs), which is how it knows
every prefill pod's KV generation. So it keeps the router's guarantees: a prefill pod of another
generation (or one it does not know, or one that is not ready) is never used, the prompt is
recomputed locally instead and counted by reason; KV failures fall back the router's way; bad input
gets OpenAI-style 4xx; SIGTERM drains.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Mapping

from splitserve.router import cli as router_cli
from splitserve.router.app import Router, make_discovery
from splitserve.router.config import RouterConfig
from splitserve.router.discovery import Discovery, UpdateCallback

log = logging.getLogger("splitserve.sidecar")

DEFAULT_PORT = 8200


class LocalDecodeDiscovery:
    """The decode pool is the local worker (of the sidecar's generation); prefill pools come from
    ``inner`` discovery as they would for the router."""

    def __init__(self, inner: Discovery, local_url: str, generation: str) -> None:
        self._inner = inner
        self._local = local_url
        self._generation = generation

    async def run(self, on_update: UpdateCallback) -> None:
        on_update("decode", {self._local}, set(), {self._local: self._generation})

        def prefill_only(
            pool: str, ready: set[str], terminating: set[str], generations: Mapping[str, str] | None = None
        ) -> None:
            if pool == "prefill":
                on_update(pool, ready, terminating, generations)

        await self._inner.run(prefill_only)


def configure(parser: argparse.ArgumentParser) -> None:
    router_cli.configure(parser)
    parser.set_defaults(port=DEFAULT_PORT, workers=1)
    add = parser.add_argument
    add("--local", required=True, type=router_cli.urls, metavar="URL",
        help="this pod's vLLM, e.g. http://127.0.0.1:8000")  # fmt: skip
    add("--generation", default="",
        help="the local worker's KV generation (splitserve.io/generation); KV of others is refused")  # fmt: skip


def sidecar_config(config: RouterConfig) -> RouterConfig:
    """The router's configuration as a sidecar runs it: the picker decides what is split (the header); the
    sidecar only checks that it can be."""
    return dataclasses.replace(config, prefill_from_header=True, disagg_threshold_tokens=0)


def config_from_args(args: argparse.Namespace) -> tuple[RouterConfig, str, str]:
    if len(args.local) != 1:
        raise ValueError("--local takes exactly one URL: the sidecar's own worker")
    local = args.local[0]
    args.decode = (local,)
    return sidecar_config(router_cli.config_from_args(args)), local, args.generation


def make_router(config: RouterConfig, local: str, generation: str, prefill: Discovery | None = None) -> Router:
    """The sidecar's router; its prefill pods from ``prefill`` (default: the discovery ``config`` names)."""
    return Router(config, discovery=LocalDecodeDiscovery(prefill or make_discovery(config), local, generation))


def run(args: argparse.Namespace) -> int:
    router_cli.setup_logging(args.log_level)
    try:
        config, local, generation = config_from_args(args)
    except ValueError as error:
        return router_cli.refuse("sidecar", error, 2)
    problem = router_cli.startup_problem(config)
    if problem:
        return router_cli.refuse("sidecar", problem, 1)
    return router_cli.serve_in_loop(
        "sidecar", lambda: router_cli.serve(config, router=make_router(config, local, generation))
    )
