"""One request through the pools: vLLM's prefill/decode protocol with its fallbacks and retries.

Order of work: take a decode slot first (so a request waiting for scale-from-zero holds no
prefill KV that could expire), then run the prefill leg (``max_tokens=1``, no streaming,
``kv_transfer_params.do_remote_decode``), then send the original request to decode with the
``kv_transfer_params`` prefill returned, relaying decode's bytes as they arrive. Anything that
breaks disaggregation (no prefill worker, a failed prefill, no usable KV parameters, a decode that
cannot find the KV) turns the request into an aggregated one on decode, counted by reason; only
when decode itself cannot serve does the client get an error.

KV generations (pairing.py): the decode worker's generation fixes the request's; prefill is chosen
among healthy prefill workers of that generation only, and KV of one generation is never sent to
a decode worker of another (a retried decode stays in the generation or drops the KV).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

import orjson

from splitserve.router import errors, pairing
from splitserve.router.config import GenerationPairing, RouterConfig
from splitserve.router.httpserver import ClientGone, Request
from splitserve.router.metrics import RouterMetrics
from splitserve.router.policies import PrecisePrefix, PrefixAware, RoutingRequest
from splitserve.router.pool import Worker, WorkerPool
from splitserve.router.upstream import UpstreamResponse

log = logging.getLogger(__name__)

# What vLLM's own disaggregated proxy sends on the prefill leg.
PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# Phrases of decode errors that mean "the transferred KV is not there": retry aggregated.
KV_ERROR_MARKERS = (b"kv_transfer", b"kv transfer", b"kv cache transfer", b"remote kv", b"kv blocks", b"kv_load")
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_LAST_CHUNK = b"0\r\n\r\n"  # a chunked body's end, alone: no event, no inter-token time
# The generation of the decode worker that produced an answer (left out when unknown).
GENERATION_HEADER = "X-Splitserve-Generation"


class Handling(enum.StrEnum):
    """How the router served one request (not the deployment's serving mode, api.spec.Mode): split
    into prefill and decode legs, whole on decode, whole on decode after the split failed, or not at
    all. The `mode` label of splitserve_router_requests_total and of the request log carries it."""

    DISAGGREGATED = "disaggregated"
    AGGREGATED = "aggregated"
    FALLBACK = "fallback"
    NONE = "none"


class Outcome(enum.StrEnum):
    SUCCESS = "success"
    CLIENT_ERROR = "client_error"
    REJECTED = "rejected"
    NO_CAPACITY = "no_capacity"
    UPSTREAM_ERROR = "upstream_error"
    STREAM_ERROR = "stream_error"
    CANCELLED = "cancelled"


@dataclass
class RequestContext:
    """What one request carries through the flow; filled in as it goes, read by the metrics."""

    path: str
    body: dict[str, Any]
    raw_body: bytes
    stream: bool
    request_id: str
    routing: RoutingRequest
    started: float
    forward_headers: dict[str, str] = field(default_factory=dict)
    # The prefill worker (URL) an endpoint picker chose for this request (x-prefiller-host-port), when
    # the router is a gateway's decode-side sidecar: split on it, or recompute locally when it cannot.
    prefill_pin: str | None = None
    handling: Handling = Handling.NONE
    outcome: Outcome = Outcome.SUCCESS
    # For the per-request log record.
    prefill_url: str | None = None
    decode_url: str | None = None
    # The KV generation of the decode worker serving the request, and of the prefill worker whose
    # leg ran (None when none did).
    generation: str = ""
    prefill_generation: str | None = None
    fallback_reason: str | None = None
    ttft: float | None = None
    completion_tokens: int | None = None
    # A stream's final event (data: [DONE]) has been sent to the client.
    answered: bool = False
    # --lora: the model name the per-model series count this request under (None: not counted), and
    # how many prompt tokens the chosen decode and prefill workers held in their prefix caches (None
    # when the pool's policy does not know).
    model_label: str | None = None
    decode_match: int | None = None
    prefill_match: int | None = None

    @property
    def prefix_hit_tokens(self) -> int | None:
        """Prompt tokens found cached where the prompt was computed: prefill when split, else decode."""
        return self.prefill_match if self.handling is Handling.DISAGGREGATED else self.decode_match


class _Retriable(Exception):
    """The attempt failed before anything reached the client: another worker may succeed."""


class _KvMissing(Exception):
    """Decode could not use the transferred KV: serve the request aggregated instead."""


def is_kv_error(body: bytes) -> bool:
    lowered = body.lower()
    return any(marker in lowered for marker in KV_ERROR_MARKERS)


def usable_kv_params(answer: object) -> dict[str, Any] | None:
    """The kv_transfer_params of a prefill answer when decode can use them, else None."""
    if not isinstance(answer, dict):
        return None
    params = answer.get("kv_transfer_params")
    if not isinstance(params, dict) or not params.get("remote_engine_id"):
        return None
    return params


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    leg = dict(body)
    leg["max_tokens"] = 1
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    leg["stream"] = False
    leg.pop("stream_options", None)
    leg.pop("min_tokens", None)
    leg["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    return leg


def decode_payload(ctx: RequestContext, kv_params: dict[str, Any] | None) -> bytes:
    """The decode leg's body. Aggregated: the client's bytes untouched. With KV: the client's bytes with
    ``kv_transfer_params`` spliced in before the closing brace, instead of serialising the body again."""
    if kv_params is None:
        return ctx.raw_body
    if "kv_transfer_params" not in ctx.body:
        inner = ctx.raw_body.rstrip()
        if inner.endswith(b"}"):  # always, for a JSON object; checked so odd bytes fall back safely
            inner = inner[:-1].rstrip()
            separator = b"" if inner.endswith(b"{") else b","
            return inner + separator + b'"kv_transfer_params":' + orjson.dumps(kv_params) + b"}"
    return orjson.dumps({**ctx.body, "kv_transfer_params": kv_params})


def count_streamed_tokens(chunk: bytes) -> int:
    """Generated-token events in a chunk of vLLM's SSE: data events minus [DONE] and usage-only ones."""
    return chunk.count(b"data: ") - chunk.count(b"data: [DONE]") - chunk.count(b'"choices":[]')


class Flow:
    def __init__(self, config: RouterConfig, metrics: RouterMetrics, prefill: WorkerPool, decode: WorkerPool) -> None:
        self._config = config
        self._metrics = metrics
        self._prefill = prefill
        self._decode = decode
        self._has_prefill_pool = config.has_prefill_source
        self._strict = config.generation_pairing is GenerationPairing.STRICT
        # A sidecar splits exactly the requests its endpoint picker named a prefill worker for.
        self._split_by_pin = config.prefill_from_header

    # ---- the whole request ------------------------------------------------------------------

    def _shift(self) -> pairing.Generations:
        return pairing.decode_generations(self._prefill.healthy_generations, self._decode.healthy_generations)

    def wants_split(self, ctx: RequestContext) -> bool:
        """Whether ``ctx`` should be split into prefill and decode legs (conditional disaggregation)."""
        if self._split_by_pin:
            return ctx.prefill_pin is not None
        return self._has_prefill_pool and ctx.routing.prompt_tokens >= self._config.disagg_threshold_tokens

    async def acquire_decode(self, ctx: RequestContext, only: AbstractSet[str] | None = None) -> Worker:
        """A decode slot for ``ctx`` (among ``only`` URLs when given); its generation becomes the request's."""
        deadline = time.monotonic() + self._config.queue_timeout
        # Traffic shift: a request that will be split goes to a generation that has prefill workers
        # (asked again whenever the request waited, as the pools change under it).
        shift = self._shift if self._strict and self.wants_split(ctx) else None
        waiting_since = time.monotonic()
        try:
            decode = await self._decode.acquire(ctx.routing, deadline, generations=shift, only=only)
        except errors.RouterError as error:
            ctx.outcome = Outcome.REJECTED if error.status == 429 else Outcome.NO_CAPACITY
            raise
        self._metrics.queue_wait.labels("decode").observe(time.monotonic() - waiting_since)
        ctx.generation = decode.generation
        if ctx.model_label is not None:
            ctx.decode_match = self._last_match(self._decode)
        return decode

    async def acquire_prefill(self, ctx: RequestContext, tried: AbstractSet[str] = frozenset()) -> Worker | str:
        """A prefill slot of the request's generation (``ctx.generation``, the decode worker's), or the
        fallback reason why the request should be served aggregated instead."""
        same = pairing.prefill_generations(ctx.generation, self._config.generation_pairing)
        only: frozenset[str] | None = None
        if ctx.prefill_pin is not None:
            named = self._prefill.find(ctx.prefill_pin)
            if named is None:
                return "prefill_unknown_endpoint"
            if same is not None and named.generation not in same:
                # Its KV would be decoded as if it fitted these weights: recompute instead.
                return "prefill_other_generation"
            if named not in self._prefill.healthy:
                return "prefill_unavailable"
            only = frozenset((named.url,))
        if not self._prefill.has_healthy:
            return "prefill_unavailable"
        if not self._prefill.has_healthy_in(same):
            return "no_prefill_in_generation"
        lora = ctx.routing.lora_name
        if lora is not None and not self._prefill.serves_healthy(lora, same, only):
            # Prefill would answer 404 (or compute KV under another adapter): recompute on decode.
            return "prefill_no_adapter"
        waiting_since = time.monotonic()
        try:
            worker = await self._prefill.acquire(
                ctx.routing, waiting_since + self._config.queue_timeout, frozenset(tried), same, only
            )
        except errors.RouterError:
            gone = self._prefill.has_healthy and not self._prefill.has_healthy_in(same)
            return "no_prefill_in_generation" if gone else "prefill_unavailable"
        self._metrics.queue_wait.labels("prefill").observe(time.monotonic() - waiting_since)
        if ctx.model_label is not None:
            ctx.prefill_match = self._last_match(self._prefill)
        return worker

    def _last_match(self, pool: WorkerPool) -> int | None:
        """Prompt tokens the worker just chosen in ``pool`` holds in its prefix cache, when its policy knows."""
        policy = pool.policy
        if isinstance(policy, PrecisePrefix):
            return policy.last_matched_tokens
        if isinstance(policy, PrefixAware):
            return policy.last_matched_blocks * self._config.prefix_block_tokens
        return None

    async def serve(self, ctx: RequestContext, http_request: Request) -> None:
        """Serve ``ctx`` and answer ``http_request``; RouterError when nothing could be sent."""
        decode: Worker | None = await self.acquire_decode(ctx)
        tried: set[str] = set()
        try:
            try:
                kv_params = await self._maybe_prefill(ctx)
            except _PassThrough as answer:
                _respond_passthrough(http_request, answer.status, answer.body, ctx.request_id, ctx.generation)
                return
            retries = 0
            while True:
                assert decode is not None
                if kv_params is not None and decode.url in tried:
                    # The same worker again (no other to try) after an attempt with KV failed: what failed
                    # may be the transfer itself (vLLM answers a failed NIXL handshake with a bare 500),
                    # so this attempt recomputes the prompt instead of failing the same way.
                    kv_params = self._fallback(ctx, "decode_retry_without_kv")
                tried.add(decode.url)
                ctx.decode_url = decode.url
                ctx.generation = decode.generation
                if kv_params is not None and ctx.prefill_generation != decode.generation:
                    if self._strict:
                        # A retry landed on another generation: its KV would be read as if it fitted.
                        kv_params = self._fallback(ctx, "decode_other_generation")
                    else:
                        self._metrics.cross_generation_pairs.inc()
                try:
                    await self._decode_attempt(ctx, decode, kv_params, http_request)
                    return
                except _KvMissing:
                    # Not the worker's fault: run it aggregated on the same worker.
                    self._metrics.fallbacks.labels("decode_kv_error").inc()
                    ctx.handling = Handling.FALLBACK
                    ctx.fallback_reason = "decode_kv_error"
                    kv_params = None
                except _Retriable as failure:
                    self._decode.record_failure(decode)
                    if retries >= self._config.max_retries:
                        ctx.outcome = Outcome.UPSTREAM_ERROR
                        message = f"Decode failed after {retries + 1} attempts: {failure}"
                        raise errors.upstream_failed(message) from None
                    retries += 1
                    self._metrics.retries.labels("decode").inc()
                    self._decode.release(decode)
                    decode = None
                    # KV in hand: retry on another decode worker of its generation while there is one;
                    # otherwise anywhere, and the KV is dropped if that worker is of another generation.
                    keep: Callable[[], pairing.Generations] | None = None
                    if kv_params is not None and self._strict and ctx.prefill_generation is not None:
                        keep = self._retry_generations(ctx.prefill_generation, frozenset(tried))
                    try:
                        decode = await self._decode.acquire(
                            ctx.routing, time.monotonic() + self._config.queue_timeout, frozenset(tried), keep
                        )
                    except errors.RouterError:
                        ctx.outcome = Outcome.NO_CAPACITY
                        raise
        except ClientGone:
            ctx.outcome = Outcome.CANCELLED
            raise
        finally:
            if decode is not None:
                self._decode.release(decode)

    def _retry_generations(self, generation: str, tried: frozenset[str]) -> Callable[[], pairing.Generations]:
        same = frozenset((generation,))
        return lambda: same if self._decode.has_healthy_except(tried, same) else None

    # ---- prefill ----------------------------------------------------------------------------

    async def _maybe_prefill(self, ctx: RequestContext) -> dict[str, Any] | None:
        """kv_transfer_params for decode, or None to serve aggregated (ctx.handling says why).
        Prefill runs on a worker of the decode worker's generation (``ctx.generation``)."""
        if not self.wants_split(ctx):
            ctx.handling = Handling.AGGREGATED
            return None
        same = pairing.prefill_generations(ctx.generation, self._config.generation_pairing)
        tried: set[str] = set()
        # A prefill worker named by the endpoint picker is the only one to try.
        attempts = 1 if ctx.prefill_pin is not None else min(1 + self._config.max_retries, 2)
        for attempt in range(attempts):
            worker = await self.acquire_prefill(ctx, tried)
            if isinstance(worker, str):
                return self._fallback(ctx, worker)
            sent = time.monotonic()
            tried.add(worker.url)
            ctx.prefill_url = worker.url
            ctx.prefill_generation = worker.generation
            try:
                params = await self._prefill_attempt(ctx, worker)
            except _Retriable as failure:
                log.info("prefill on %s failed (%s) for %s", worker.url, failure, ctx.request_id)
                self._prefill.record_failure(worker)
                # Another prefill worker (of the generation) may work; the same one again would only
                # delay the fallback.
                if attempt + 1 < attempts and self._prefill.has_healthy_except(tried, same):
                    self._metrics.retries.labels("prefill").inc()
                    continue
                return self._fallback(ctx, "prefill_failed")
            finally:
                self._prefill.release(worker)
            self._prefill.record_success(worker)
            self._metrics.prefill.observe(time.monotonic() - sent)
            if params is None:
                return self._fallback(ctx, "prefill_no_kv_params")
            ctx.handling = Handling.DISAGGREGATED
            return params
        return self._fallback(ctx, "prefill_failed")

    def _fallback(self, ctx: RequestContext, reason: str) -> dict[str, Any] | None:
        self._metrics.fallbacks.labels(reason).inc()
        ctx.handling = Handling.FALLBACK
        ctx.fallback_reason = reason
        return None

    async def _prefill_attempt(self, ctx: RequestContext, worker: Worker) -> dict[str, Any] | None:
        payload = orjson.dumps(prefill_body(ctx.body))
        headers = {**ctx.forward_headers, "Content-Type": "application/json", "X-Request-Id": ctx.request_id}
        limit = self._config.prefill_timeout
        try:
            response = await worker.http.post(ctx.path, payload, headers, limit, limit, time.monotonic() + limit)
            async with response as r:
                body = await r.read()
                status = r.status
        except (TimeoutError, OSError) as error:
            raise _Retriable(f"{type(error).__name__}: {error}") from None
        if status >= 500:
            raise _Retriable(f"HTTP {status}")
        if status >= 400:
            # The request itself is wrong (decode would say the same): tell the client.
            ctx.outcome = Outcome.CLIENT_ERROR
            raise _PassThrough(status, body)
        try:
            return usable_kv_params(orjson.loads(body))
        except orjson.JSONDecodeError:
            return None

    # ---- decode -----------------------------------------------------------------------------

    async def _decode_attempt(
        self, ctx: RequestContext, worker: Worker, kv_params: dict[str, Any] | None, http_request: Request
    ) -> None:
        payload = decode_payload(ctx, kv_params)
        config = self._config
        deadline = ctx.started + config.request_timeout
        headers = {**ctx.forward_headers, "Content-Type": "application/json", "X-Request-Id": ctx.request_id}
        handoff_start = time.monotonic()
        try:
            response = await worker.http.post(
                ctx.path, payload, headers, config.decode_timeout, config.decode_timeout, deadline
            )
            async with response as r:
                if r.status >= 400:
                    body = await r.read()
                    if kv_params is not None and is_kv_error(body):
                        raise _KvMissing
                    if r.status >= 500:
                        raise _Retriable(f"HTTP {r.status}: {body[:200]!r}")
                    ctx.outcome = Outcome.CLIENT_ERROR
                    self._decode.record_success(worker)
                    _respond_passthrough(http_request, r.status, body, ctx.request_id, worker.generation)
                    return
                if not ctx.stream:
                    body = await r.read()
                    self._decode.record_success(worker)
                    self._observe_whole(ctx, body, handoff_start, kv_params is not None)
                    content_type = r.header("Content-Type", "application/json")
                    headers = {"Content-Type": content_type, "X-Request-Id": ctx.request_id}
                    if worker.generation:
                        headers[GENERATION_HEADER] = worker.generation
                    http_request.respond(r.status, body, headers)
                    return
                # A chunked stream (vLLM's) is relayed in its own framing; any other is framed here.
                first = await (r.read_framed() if r.chunked else r.readany())
                if not first:
                    raise _Retriable("decode closed the stream before its first byte")
                self._decode.record_success(worker)
                await self._relay(ctx, r, first, handoff_start, kv_params is not None, http_request, worker)
        except (TimeoutError, OSError) as error:
            # Only reached before the client saw a byte: _relay handles its own failures.
            raise _Retriable(f"{type(error).__name__}: {error}") from None

    def _observe_whole(self, ctx: RequestContext, body: bytes, handoff_start: float, disaggregated: bool) -> None:
        now = time.monotonic()
        if disaggregated:
            self._metrics.kv_handoff.observe(now - handoff_start)
        try:
            usage = orjson.loads(body).get("usage") or {}
            tokens = usage.get("completion_tokens")
            if isinstance(tokens, int):
                self._metrics.output_tokens.observe(tokens)
                ctx.completion_tokens = tokens
        except (orjson.JSONDecodeError, AttributeError):
            pass

    async def _relay(
        self,
        ctx: RequestContext,
        upstream: UpstreamResponse,
        first: bytes,
        handoff_start: float,
        disaggregated: bool,
        http_request: Request,
        worker: Worker,
    ) -> None:
        metrics = self._metrics
        now = time.monotonic()
        ctx.ttft = now - ctx.started
        metrics.ttft.observe(ctx.ttft)
        metrics.generation_ttft.labels(worker.generation).observe(ctx.ttft)
        if ctx.model_label is not None:
            metrics.model_ttft.labels(ctx.model_label).observe(ctx.ttft)
        if disaggregated:
            metrics.kv_handoff.observe(now - handoff_start)
        headers = {**_SSE_HEADERS, "X-Request-Id": ctx.request_id}
        if worker.generation:
            headers[GENERATION_HEADER] = worker.generation
        # vLLM streams chunked: its chunks go to the client as they are. Anything else is framed here.
        framed = upstream.chunked
        read = upstream.read_framed if framed else upstream.readany
        itl = metrics.itl
        chunk, last, tokens = first, now, count_streamed_tokens(first)
        ended = upstream.at_eof()  # the whole answer came at once (short answers): one write
        http_request.start_stream(upstream.status, headers, chunk, framed, end=ended)
        ctx.answered = b"data: [DONE]" in chunk
        while not ended:
            try:
                chunk = await read()
            except (TimeoutError, OSError) as error:
                # Headers are gone: the only honest answer left is an error event and a clean end.
                self._decode.record_failure(worker)
                ctx.outcome = Outcome.STREAM_ERROR
                log.warning("decode stream from %s broke for %s: %r", worker.url, ctx.request_id, error)
                code = "decode_timeout" if isinstance(error, TimeoutError) else "decode_stream_interrupted"
                message = f"The decode worker stopped mid-stream ({type(error).__name__})."
                await http_request.finish(errors.upstream_failed(message, code).sse_event() + b"data: [DONE]\n\n")
                break
            if not chunk:
                await http_request.finish()
                break
            tokens += count_streamed_tokens(chunk)
            if chunk != _LAST_CHUNK:
                now = time.monotonic()
                itl.observe(now - last)
                last = now
            if upstream.at_eof():
                # The upstream already ended: the last bytes and the end of the answer go in one write.
                await http_request.finish(chunk, framed)
                break
            await http_request.write(chunk, framed)
            if b"data: [DONE]" in chunk:
                ctx.answered = True
        ctx.completion_tokens = max(0, tokens)
        metrics.output_tokens.observe(ctx.completion_tokens)


class _PassThrough(Exception):
    """An upstream 4xx to hand to the client as it is."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(status)
        self.status = status
        self.body = body


def _respond_passthrough(request: Request, status: int, body: bytes, request_id: str, generation: str) -> None:
    headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
    if generation:
        headers[GENERATION_HEADER] = generation
    request.respond(status, body, headers)
