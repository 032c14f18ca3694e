"""The router's HTTP application: handlers, lifecycle and the state they share.

:class:`Router` owns everything one router instance has (config, metrics registry, pools,
discovery task, counters); :func:`routes` maps paths to its handlers and :class:`RouterServer` serves
them on the router's own HTTP server (httpserver.py), starting and stopping the router with it.
Nothing lives at module level, so tests can run many routers in one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import Coroutine, Mapping

import aiohttp
import orjson
from prometheus_client import CONTENT_TYPE_LATEST

from splitserve.kubeconfig import load_access
from splitserve.router import errors
from splitserve.router.config import DiscoveryKind, RouterConfig
from splitserve.router.discovery import Discovery, DnsDiscovery, KubernetesDiscovery, StaticDiscovery
from splitserve.router.discovery_file import FileDiscovery
from splitserve.router.discovery_pods import PodDiscovery
from splitserve.router.engine_tokens import EngineTokens
from splitserve.router.flow import Flow, Handling, Outcome, RequestContext
from splitserve.router.httpserver import ClientGone, Handler, HttpServer, Request
from splitserve.router.metrics import RouterMetrics, multiprocess_dir
from splitserve.router.policies import PrecisePrefix, PrefixAware, RoutingRequest, make_policy
from splitserve.router.pool import AdmissionBudget, Worker, WorkerPool
from splitserve.router.schema import validate_body
from splitserve.router.tokens import HuggingFaceTokenizer, PromptMeasurer, Tokenizer

log = logging.getLogger(__name__)
# One JSON line per finished request (silence with --log-level warning); `splitserve up --verbose` reads it.
request_log = logging.getLogger("splitserve.router.requests")

_FORWARDED_HEADERS = (("authorization", "Authorization"),)
# llm-d's header, set by an endpoint picker: the prefill pod (host:port) a decode-side sidecar should use.
PREFILLER_HEADER = "x-prefiller-host-port"


def _prefill_pin(headers: Mapping[str, str]) -> str | None:
    """The prefill worker URL an endpoint picker named (the first, if it listed several)."""
    value = headers.get(PREFILLER_HEADER, "").split(",", 1)[0].strip()
    return f"http://{value}" if value else None


def _request_record(
    request: Request, ctx: RequestContext | None, outcome: Outcome, handling: Handling, status: int, elapsed: float
) -> str:
    record: dict[str, object] = {
        "event": "request",
        "request_id": ctx.request_id if ctx else request.headers.get("x-request-id"),
        "path": request.path,
        "status": status,
        "outcome": outcome.value,
        "mode": handling.value,
        "duration_s": round(elapsed, 6),
    }
    if ctx is not None:
        record.update(
            prefill=ctx.prefill_url,
            decode=ctx.decode_url,
            generation=ctx.generation,
            fallback_reason=ctx.fallback_reason,
            prompt_tokens=ctx.routing.prompt_tokens,
            completion_tokens=ctx.completion_tokens,
            ttft_s=None if ctx.ttft is None else round(ctx.ttft, 6),
        )
        if ctx.prefill_generation is not None:
            record["prefill_generation"] = ctx.prefill_generation
    return orjson.dumps(record).decode()


def _cache_salt(body: dict[str, object]) -> str | None:
    # vLLM hashes a request's cache_salt into its first block, so only same-salt requests share KV.
    salt = body.get("cache_salt")
    return salt if isinstance(salt, str) and salt else None


def make_discovery(config: RouterConfig) -> Discovery:
    if config.discovery is DiscoveryKind.STATIC:
        return StaticDiscovery({"prefill": config.prefill_urls, "decode": config.decode_urls})
    if config.discovery is DiscoveryKind.FILE:
        if not config.endpoints_file:
            raise ValueError("file discovery needs an endpoints file")
        return FileDiscovery(config.endpoints_file, config.endpoints_poll_interval)
    if config.discovery is DiscoveryKind.PODS:
        if not config.deployment:
            raise ValueError("pods discovery needs a deployment name")
        return PodDiscovery(load_access(config.kubeconfig), config.namespace, config.deployment, config.worker_port)
    services = {"decode": config.decode_service or ""}
    if config.prefill_service:
        services["prefill"] = config.prefill_service
    if config.discovery is DiscoveryKind.DNS:
        hosts = {pool: name if "." in name else f"{name}.{config.namespace}.svc" for pool, name in services.items()}
        return DnsDiscovery(hosts, config.worker_port, config.dns_interval)
    access = load_access(config.kubeconfig)
    return KubernetesDiscovery(access, config.namespace, services, config.worker_port)


class Router:
    """All the state of one router instance."""

    def __init__(
        self, config: RouterConfig, discovery: Discovery | None = None, tokenizer: Tokenizer | None = None
    ) -> None:
        self.config = config
        self.metrics = RouterMetrics(shared_dir=multiprocess_dir())
        self.budget = AdmissionBudget(config.queue_limit)
        pool_options = {
            "max_inflight_per_worker": config.max_inflight_per_worker,
            "connect_timeout": config.connect_timeout,
            "eject_after_failures": config.eject_after_failures,
            "eject_min_seconds": config.eject_min_seconds,
            "health_interval": config.health_interval,
            "metrics_poll_interval": config.metrics_poll_interval,
            "kv_event_endpoints": dict(config.kv_event_endpoints),
            "lora": config.lora,
            "models_poll_interval": config.models_poll_interval,
        }
        self.prefill = WorkerPool(
            "prefill",
            make_policy(config.prefill_policy),
            self.metrics,
            self.budget,
            **pool_options,  # type: ignore[arg-type]
        )
        self.decode = WorkerPool(
            "decode",
            make_policy(config.decode_policy),
            self.metrics,
            self.budget,
            **pool_options,  # type: ignore[arg-type]
        )
        self.metrics.watch_pools([self.prefill, self.decode])
        self.discovery = discovery or make_discovery(config)
        if tokenizer is None and config.tokenizer:
            tokenizer = HuggingFaceTokenizer(config.tokenizer)
        pools = (self.prefill, self.decode)
        wants_hashes = any(isinstance(p.policy, PrefixAware) for p in pools)
        wants_ids = any(isinstance(p.policy, PrecisePrefix) for p in pools)
        self.measurer = PromptMeasurer(
            tokenizer,
            config.prefix_block_tokens,
            config.approx_bytes_per_token,
            want_hashes=wants_hashes,
            want_token_ids=wants_ids,
        )
        # precise-prefix without a local tokenizer asks the engine for the exact token ids.
        self.engine_tokens = EngineTokens(self._tokenizing_workers) if wants_ids and tokenizer is None else None
        self.flow = Flow(config, self.metrics, self.prefill, self.decode)
        self.draining = False
        self.active_requests = 0
        self._idle = asyncio.Event()
        self._background: list[asyncio.Task[None]] = []
        self._id_prefix = uuid.uuid4().hex[:16]
        self._id_counter = itertools.count()

    def _new_request_id(self) -> str:
        # A random per-process prefix and a counter: unique across processes and replicas, without
        # the urandom syscall uuid4 makes per request (4 % of the router's CPU under load).
        return f"{self._id_prefix}{next(self._id_counter):x}"

    def _tokenizing_workers(self) -> list[Worker]:
        # Least busy first: tokenizing is cheap, but a worker deep in a long prefill answers late.
        return sorted(self.decode.healthy, key=lambda w: w.inflight)

    # ---- lifecycle --------------------------------------------------------------------------

    def _on_discovery(
        self, pool: str, ready: set[str], terminating: set[str], generations: Mapping[str, str] | None = None
    ) -> None:
        target = self.prefill if pool == "prefill" else self.decode
        target.set_endpoints(ready, terminating, generations)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._idle.set()
        self._background = [
            loop.create_task(self._run_discovery()),
            loop.create_task(self.prefill.run_background()),
            loop.create_task(self.decode.run_background()),
        ]
        if self.metrics.shared_dir is not None:
            self._background.append(loop.create_task(self._publish_metrics()))

    async def _publish_metrics(self) -> None:
        while True:
            self.metrics.publish()
            await asyncio.sleep(1.0)

    async def _run_discovery(self) -> None:
        try:
            await self.discovery.run(self._on_discovery)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("discovery stopped")

    async def stop(self) -> None:
        for task in self._background:
            task.cancel()
        for task in self._background:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.prefill.close()
        await self.decode.close()

    async def drain(self, grace_seconds: float) -> bool:
        """Refuse new requests and wait for in-flight ones; True when all finished in time."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), grace_seconds)
            return True
        except TimeoutError:
            return False

    @property
    def ready(self) -> bool:
        return not self.draining and self.decode.has_healthy

    # ---- handlers ---------------------------------------------------------------------------

    async def health(self, request: Request) -> None:
        request.respond(200, b'{"status":"ok"}')

    async def readiness(self, request: Request) -> None:
        body = {
            "ready": self.ready,
            "draining": self.draining,
            "decode_workers": len(self.decode.healthy),
            "prefill_workers": len(self.prefill.healthy),
        }
        request.respond_json(body, status=200 if self.ready else 503)

    async def workers(self, request: Request) -> None:
        """GET /splitserve/workers: each pool's workers with generation, state and in-flight count.

        Departing workers (gone from discovery, still finishing requests) are listed too, so a caller
        rolling generations knows, from the router itself, when an old worker gets nothing more.
        With ``--workers N`` this is the view of the process that answers.
        """
        request.respond_json({"prefill": self.prefill.describe(), "decode": self.decode.describe()})

    async def metrics_endpoint(self, request: Request) -> None:
        request.respond(200, self.metrics.exposition(), content_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> None:
        if self.config.model:
            if not self.config.lora:
                cards = [_model_card(self.config.model)]
            else:
                # The base model, then the adapters the workers themselves list, each with its parent.
                adapters = sorted(self.decode.model_cards().items())
                cards = [_model_card(self.config.model, parent=None)] + [
                    _model_card(name, parent=adapter.parent, root=adapter.root) for name, adapter in adapters
                ]
            request.respond_json({"object": "list", "data": cards})
            return
        for worker in self.decode.workers:
            try:
                async with worker.session.get(worker.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status == 200:
                        request.respond(200, await r.read())
                        return
            except (aiohttp.ClientError, TimeoutError, OSError):
                continue
        raise errors.no_capacity("decode", 0)

    def completions(self, request: Request) -> Coroutine[None, None, None]:
        # The coroutine itself, not one awaiting it: a frame less on every resume of the request.
        return self._generate(request, chat=False)

    async def passthrough(self, request: Request) -> None:
        """/tokenize and /detokenize go to a healthy decode worker as they are (vLLM serves both; its
        ``bench serve`` asks for /tokenize). The engine's answer, errors included, comes back unchanged."""
        last_error: Exception | None = None
        for worker in self.decode.healthy:
            try:
                timeout = aiohttp.ClientTimeout(total=self.config.prefill_timeout, connect=self.config.connect_timeout)
                headers = {"Content-Type": request.headers.get("content-type", "application/json")}
                async with worker.session.post(worker.url + request.path, data=request.body, headers=headers,
                                               timeout=timeout) as r:  # fmt: skip
                    request.respond(r.status, await r.read(), content_type=r.content_type or "application/json")
                    return
            except (aiohttp.ClientError, TimeoutError, OSError) as error:
                last_error = error
                continue
        if last_error is not None:
            log.warning("%s failed on every decode worker: %s", request.path, last_error)
        raise errors.no_capacity("decode", 0)

    def chat_completions(self, request: Request) -> Coroutine[None, None, None]:
        return self._generate(request, chat=True)

    async def admit(
        self, raw: bytes, path: str, chat: bool, client_headers: Mapping[str, str], started: float
    ) -> RequestContext:
        """A generation request checked and measured for routing: the context the flow (or the
        endpoint picker) works on. RouterError (OpenAI-style 4xx) when the request is wrong.
        ``client_headers`` have lower-case names."""
        try:
            parsed = orjson.loads(raw)
        except orjson.JSONDecodeError as error:
            raise errors.bad_request(f"Request body is not valid JSON: {error}", code="invalid_json") from None
        body = validate_body(parsed, chat)
        model: str = body["model"]
        lora_name: str | None = None
        if self.config.lora:
            lora_name = self._adapter_of(model)
        elif self.config.model is not None and model != self.config.model:
            raise errors.model_not_found(model)
        shape = self.measurer.measure(body)
        token_ids = shape.token_ids
        if self.engine_tokens is not None and not token_ids:
            token_ids = await self.engine_tokens.token_ids(body)
        self.metrics.prompt_tokens.observe(shape.tokens)
        headers = {name: client_headers[key] for key, name in _FORWARDED_HEADERS if key in client_headers}
        block_hashes = shape.block_hashes
        if lora_name is not None and block_hashes:
            # prefix-aware's keys: an adapter's prompt never matches the base model's, nor another's.
            salt = hash(lora_name)
            block_hashes = tuple(h ^ salt for h in block_hashes)
        # Per-model series only for names a worker serves: a client cannot mint label values.
        label = model if lora_name is None or self.decode.serves(model) else ""
        if self.config.lora:
            self.metrics.model_prompt_tokens.labels(label).inc(shape.tokens)
        return RequestContext(
            path=path,
            body=body,
            raw_body=raw,
            stream=body.get("stream") is True,
            request_id=client_headers.get("x-request-id") or self._new_request_id(),
            routing=RoutingRequest(
                shape.tokens,
                block_hashes,
                token_ids=token_ids,
                cache_salt=_cache_salt(body),
                lora_name=lora_name,
            ),
            started=started,
            forward_headers=headers,
            prefill_pin=_prefill_pin(client_headers) if self.config.prefill_from_header else None,
            model_label=label if self.config.lora else None,
        )

    def _adapter_of(self, model: str) -> str | None:
        """--lora: None for the base model, else the adapter ``model`` names; RouterError 404 when no
        worker serves that name. A name not known while some worker has not told its models yet waits
        for them (bounded by the queue timeout) rather than being refused too early."""
        if model == self.config.model:
            return None
        if self.decode.serves(model):
            return model
        if self.config.model is None and any(
            card.id == model and card.parent is None for w in self.decode.workers for card in w.models or ()
        ):
            return None
        if self.decode.has_healthy and self.decode.models_known:
            raise errors.model_not_found(model)
        return model

    async def _generate(self, request: Request, chat: bool) -> None:
        started = time.monotonic()
        ctx: RequestContext | None = None
        self.active_requests += 1
        self._idle.clear()
        outcome, handling = Outcome.CLIENT_ERROR, Handling.NONE
        status = 500
        try:
            if self.draining:
                outcome = Outcome.REJECTED
                raise errors.draining()
            ctx = await self.admit(request.body, request.path, chat, request.headers, started)
            await self.flow.serve(ctx, request)
            outcome, handling, status = ctx.outcome, ctx.handling, request.status
        except errors.RouterError as error:
            status = error.status
            if ctx is not None:
                outcome, handling = ctx.outcome, ctx.handling
            raise
        except (asyncio.CancelledError, ClientGone):
            handling = ctx.handling if ctx is not None else Handling.NONE
            if ctx is not None and ctx.answered:
                # The client left after the stream's last event (clients and proxies may close on
                # [DONE], before the empty chunk that ends the body): it had the whole answer.
                outcome, status = Outcome.SUCCESS, 200
            else:
                outcome, status = Outcome.CANCELLED, 499
            raise
        finally:
            elapsed = time.monotonic() - started
            self.metrics.requests.labels(outcome.value, handling.value).inc()
            self.metrics.generation_requests.labels(ctx.generation if ctx else "", outcome.value).inc()
            if self.config.lora:
                self._count_model(ctx, outcome)
            self.metrics.e2e.observe(elapsed)
            self.metrics.request_finished()
            if request_log.isEnabledFor(logging.INFO):
                request_log.info(_request_record(request, ctx, outcome, handling, status, elapsed))
            self.active_requests -= 1
            if self.active_requests == 0:
                self._idle.set()

    def _count_model(self, ctx: RequestContext | None, outcome: Outcome) -> None:
        label = ctx.model_label if ctx is not None and ctx.model_label is not None else ""
        self.metrics.model_requests.labels(label, outcome.value).inc()
        hits = ctx.prefix_hit_tokens if ctx is not None else None
        if ctx is not None and hits is not None:
            # Hits and the prompt tokens they were looked up for, together: a request routed by a policy
            # that knows no prefixes (or a fallback) is no miss.
            self.metrics.model_prefix_lookup_tokens.labels(label).inc(ctx.routing.prompt_tokens)
            self.metrics.model_prefix_hit_tokens.labels(label).inc(min(hits, ctx.routing.prompt_tokens))


def _model_card(model_id: str, **extra: object) -> dict[str, object]:
    """One entry of the router's own /v1/models answer (OpenAI's model object)."""
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "splitserve", **extra}


def routes(router: Router) -> dict[str, dict[str, Handler]]:
    """Path -> method -> handler: what the router serves."""
    return {
        "/v1/completions": {"POST": router.completions},
        "/v1/chat/completions": {"POST": router.chat_completions},
        "/v1/models": {"GET": router.models},
        "/tokenize": {"POST": router.passthrough},
        "/detokenize": {"POST": router.passthrough},
        "/health": {"GET": router.health},
        "/ready": {"GET": router.readiness},
        "/metrics": {"GET": router.metrics_endpoint},
        "/splitserve/workers": {"GET": router.workers},
    }


class RouterServer:
    """A started router on a listening socket: ``start`` it, then ``shutdown`` (drain) or ``close``."""

    def __init__(self, router: Router, extra_routes: Mapping[str, Mapping[str, Handler]] | None = None) -> None:
        self.router = router
        self._routes = {**routes(router), **(extra_routes or {})}
        self.http: HttpServer | None = None
        self.port = 0

    async def start(self, host: str, port: int, reuse_port: bool = False) -> int:
        await self.router.start()
        try:
            self.http = HttpServer(self._routes, self.router.config.max_body_bytes)
            self.port = await self.http.listen(host, port, reuse_port=reuse_port)
        except BaseException:
            await self.router.stop()
            raise
        return self.port

    async def shutdown(self, grace_seconds: float) -> bool:
        """Stop accepting, let in-flight requests finish (up to ``grace_seconds``), then close.
        True when every request finished in time."""
        assert self.http is not None
        self.http.stop_accepting()
        finished = await self.router.drain(grace_seconds)
        await self.close()
        return finished

    async def close(self) -> None:
        if self.http is not None:
            await self.http.close()
        await self.router.stop()
