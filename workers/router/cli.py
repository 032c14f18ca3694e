"""``splitserve router``: parse flags into a RouterConfig and serve until SIGTERM, then drain."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from splitserve.router.config import DiscoveryKind, GenerationPairing, RouterConfig
from splitserve.router.policies import PolicyName
from splitserve.router.processes import usable_cores

if TYPE_CHECKING:
    from splitserve.router.app import Router

log = logging.getLogger("splitserve.router")


def urls(text: str) -> tuple[str, ...]:
    urls = tuple(u.strip().rstrip("/") for u in text.split(",") if u.strip())
    for url in urls:
        if not url.startswith("http://"):
            # Workers speak plain HTTP inside the cluster; the upstream client has no TLS.
            raise argparse.ArgumentTypeError(f"not an http:// URL: {url!r}")
    return urls


def worker_override(text: str) -> tuple[str, str]:
    """``WORKER_URL=VALUE``: a per-worker setting (the worker URL as discovery names it)."""
    url, sep, value = text.partition("=")
    if not sep or not url.startswith("http://") or not value:
        raise argparse.ArgumentTypeError(f"expected WORKER_URL=VALUE with an http:// worker URL, got {text!r}")
    return url.rstrip("/"), value


def _endpoint_override(text: str) -> tuple[str, str]:
    url, endpoint = worker_override(text)
    if "://" not in endpoint:
        raise argparse.ArgumentTypeError(f"expected WORKER_URL=tcp://HOST:PORT, got {text!r}")
    return url, endpoint


def configure(parser: argparse.ArgumentParser) -> None:
    policies = [p.value for p in PolicyName]
    add = parser.add_argument
    add("--host", default="0.0.0.0")
    add("--port", type=int, default=8000)
    add("--model", default=None, help="served model name clients must use (default: accept any)")
    add("--prefill", type=urls, default=(), help="static prefill worker URLs, comma-separated")
    add("--decode", type=urls, default=(), help="static decode worker URLs, comma-separated")
    add("--discovery", choices=[d.value for d in DiscoveryKind], default=None,
        help="static (default with --decode), dns, kubernetes (EndpointSlices), file (--endpoints-file), "
             "or pods (--deployment; knows each worker's KV generation)")  # fmt: skip
    add("--namespace", default="default")
    add("--endpoints-file", default=None, metavar="PATH",
        help='file discovery: JSON {"pools": {"prefill": [{"url", "generation", "state"}], "decode": [...]}}, '
             "replaced atomically by its writer")  # fmt: skip
    add("--endpoints-poll-interval", type=float, default=0.2, help="file discovery: seconds between reads")
    add("--deployment", default=None,
        help="pods discovery: the SplitServe deployment whose worker Pods (label splitserve.io/deployment) "
             "to follow")  # fmt: skip
    add("--prefill-pool", action=argparse.BooleanOptionalAction, default=True,
        help="file/pods discovery: whether the deployment has a prefill pool (--no-prefill-pool in aggregated "
             "mode: requests count as aggregated, not as fallbacks)")  # fmt: skip
    add("--generation-pairing", choices=[g.value for g in GenerationPairing], default=GenerationPairing.STRICT.value,
        help="strict: prefill and decode of a request are of one KV generation; off: ignore generations "
             "(only to demonstrate the failure strict prevents)")  # fmt: skip
    add("--lora", action="store_true",
        help="serve LoRA adapters: learn each worker's adapters from its /v1/models and route a request for an "
             "adapter only to workers that serve it")  # fmt: skip
    add("--prefill-service", default=None, help="Service of the prefill pool (dns/kubernetes discovery)")
    add("--decode-service", default=None, help="Service of the decode pool (dns/kubernetes discovery)")
    add("--worker-port", type=int, default=8000)
    add("--kubeconfig", default=None, help="kubeconfig for kubernetes discovery outside a cluster")
    add("--dns-interval", type=float, default=5.0)
    add("--policy", choices=policies, default=None, help="routing policy for both pools")
    add("--prefill-policy", choices=policies, default=None, help="default round-robin")
    add("--decode-policy", choices=policies, default=None, help="default least-loaded")
    add("--queue-limit", type=int, default=1024, help="requests that may wait for a slot before 429")
    add("--queue-timeout", type=float, default=30.0, help="longest wait for a worker slot before 503")
    add("--max-inflight-per-worker", type=int, default=256, help="0 = unlimited")
    add("--connect-timeout", type=float, default=5.0)
    add("--prefill-timeout", type=float, default=120.0)
    add("--decode-timeout", type=float, default=120.0, help="to decode's first byte and between chunks")
    add("--request-timeout", type=float, default=900.0)
    add("--disagg-threshold-tokens", type=int, default=0, help="shorter prompts go straight to decode")
    add("--max-body-bytes", type=int, default=8 * 1024 * 1024)
    add("--drain-seconds", type=float, default=30.0)
    add("--tokenizer", default=None,
        help="the model's local tokenizer dir (tokenizer.json, chat template); without it a token is ~4 bytes "
             "and precise-prefix asks a worker's /tokenize")  # fmt: skip
    add("--prefix-block-tokens", type=int, default=16)
    add(
        "--kv-events-endpoint",
        action="append",
        type=_endpoint_override,
        default=[],
        metavar="WORKER_URL=ENDPOINT",
        help="precise-prefix: where a worker publishes its KV events, e.g. "
        "http://10.0.0.5:8000=tcp://10.0.0.5:5557 (default: asked from the worker's GET /kv_event_sources)",
    )
    add(
        "--workers",
        type=int,
        default=None,
        help="router processes sharing the port (SO_REUSEPORT); default: the cores this container may use",
    )
    add("--max-retries", type=int, default=2)
    add("--eject-after-failures", type=int, default=3)
    add("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """RouterConfig from parsed flags; ValueError with a one-line message when they cannot work."""
    discovery = DiscoveryKind(args.discovery) if args.discovery else DiscoveryKind.STATIC
    if discovery is DiscoveryKind.STATIC and not args.decode:
        raise ValueError("static discovery needs --decode URL[,URL...] (or use --discovery dns|kubernetes|file|pods)")
    if discovery is DiscoveryKind.FILE and not args.endpoints_file:
        raise ValueError("--discovery file needs --endpoints-file PATH")
    if discovery is DiscoveryKind.PODS and not args.deployment:
        raise ValueError("--discovery pods needs --deployment NAME")
    if discovery in (DiscoveryKind.DNS, DiscoveryKind.KUBERNETES) and not args.decode_service:
        raise ValueError(f"--discovery {discovery.value} needs --decode-service")
    numbers = {
        "--queue-limit": args.queue_limit, "--queue-timeout": args.queue_timeout,
        "--connect-timeout": args.connect_timeout, "--prefill-timeout": args.prefill_timeout,
        "--decode-timeout": args.decode_timeout, "--request-timeout": args.request_timeout,
        "--max-body-bytes": args.max_body_bytes, "--prefix-block-tokens": args.prefix_block_tokens,
        "--endpoints-poll-interval": args.endpoints_poll_interval,
    }  # fmt: skip
    for flag, value in numbers.items():
        if value <= 0:
            raise ValueError(f"{flag} must be positive, got {value}")
    workers = usable_cores() if args.workers is None else args.workers
    if workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    for flag, value in {"--disagg-threshold-tokens": args.disagg_threshold_tokens,
                        "--max-retries": args.max_retries, "--drain-seconds": args.drain_seconds,
                        "--max-inflight-per-worker": args.max_inflight_per_worker}.items():  # fmt: skip
        if value < 0:
            raise ValueError(f"{flag} must be >= 0, got {value}")
    return RouterConfig(
        host=args.host,
        port=args.port,
        model=args.model,
        discovery=discovery,
        prefill_urls=tuple(args.prefill),
        decode_urls=tuple(args.decode),
        namespace=args.namespace,
        prefill_service=args.prefill_service,
        decode_service=args.decode_service,
        worker_port=args.worker_port,
        kubeconfig=args.kubeconfig,
        dns_interval=args.dns_interval,
        endpoints_file=args.endpoints_file,
        endpoints_poll_interval=args.endpoints_poll_interval,
        deployment=args.deployment,
        prefill_pool=args.prefill_pool,
        generation_pairing=GenerationPairing(args.generation_pairing),
        lora=args.lora,
        prefill_policy=args.prefill_policy or args.policy or "round-robin",
        decode_policy=args.decode_policy or args.policy or "least-loaded",
        queue_limit=args.queue_limit,
        queue_timeout=args.queue_timeout,
        max_inflight_per_worker=args.max_inflight_per_worker,
        connect_timeout=args.connect_timeout,
        prefill_timeout=args.prefill_timeout,
        decode_timeout=args.decode_timeout,
        request_timeout=args.request_timeout,
        disagg_threshold_tokens=args.disagg_threshold_tokens,
        max_body_bytes=args.max_body_bytes,
        drain_seconds=args.drain_seconds,
        tokenizer=args.tokenizer,
        prefix_block_tokens=args.prefix_block_tokens,
        kv_event_endpoints=tuple(args.kv_events_endpoint),
        workers=workers,
        max_retries=args.max_retries,
        eject_after_failures=args.eject_after_failures,
    )


async def serve(
    config: RouterConfig, stop: asyncio.Event | None = None, reuse_port: bool = False, router: Router | None = None
) -> None:
    """Serve until ``stop`` is set (or SIGTERM/SIGINT), then stop accepting, drain and exit."""
    from splitserve.router.app import Router, RouterServer

    server = RouterServer(router or Router(config))
    await server.start(config.host, config.port, reuse_port=reuse_port)
    # What is loaded by now lives as long as the process. Frozen, the cyclic collector stops scanning it:
    # a full collection of those ~35k objects stalled the loop ~20 ms, a p99 spike every few seconds.
    gc.freeze()
    log.info("router listening on %s:%d (prefill=%s, decode=%s)", config.host, config.port,
             config.prefill_policy, config.decode_policy)  # fmt: skip
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: no new connections, draining %d in-flight requests for up to %gs",
             server.router.active_requests, config.drain_seconds)  # fmt: skip
    # Open connections keep being served; each closes after its answer.
    if not await server.shutdown(config.drain_seconds):
        log.warning("drain period over with %d requests still in flight", server.router.active_requests)


def startup_problem(config: RouterConfig) -> str | None:
    """What in the environment stops the router from starting (service account, kubeconfig,
    tokenizer), found before serving so the user gets one line instead of a traceback."""
    from splitserve.router.app import make_discovery
    from splitserve.router.tokens import HuggingFaceTokenizer

    try:
        make_discovery(config)
    except (RuntimeError, OSError, ValueError, KeyError, TypeError) as error:
        return f"{config.discovery.value} discovery: {error}"
    if config.tokenizer:
        try:
            HuggingFaceTokenizer(config.tokenizer)
        except Exception as error:  # tokenizers raises plain Exception for a bad file
            return f"cannot load tokenizer {config.tokenizer}: {error}"
    return None


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )


def refuse(command: str, problem: object, exit_code: int) -> int:
    """One line on stderr, not a traceback: what `splitserve COMMAND` cannot work with."""
    print(f"splitserve {command}: error: {problem}", file=sys.stderr)
    return exit_code


def serve_in_loop(command: str, main: Callable[[], Coroutine[Any, Any, None]]) -> int:
    """Run ``main`` on uvloop (when installed) until it returns; a port that cannot be bound is one line."""
    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            runner.run(main())
    except OSError as error:
        return refuse(command, error, 1)
    return 0


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    try:
        config = config_from_args(args)
    except ValueError as error:
        return refuse("router", error, 2)
    problem = startup_problem(config)
    if problem:
        return refuse("router", problem, 1)
    precise = PolicyName.PRECISE_PREFIX.value
    if precise in (config.prefill_policy, config.decode_policy) and not config.tokenizer:
        log.info("precise-prefix without --tokenizer: each prompt is tokenized by a worker (POST /tokenize) "
                 "before routing, one round trip per request")  # fmt: skip
    if config.workers > 1:
        from splitserve.router.processes import run_processes

        return run_processes(config, args)
    return serve_in_loop("router", lambda: serve(config))
