"""The endpoint picker's decision: the router's own pick, answered as addresses instead of proxied.

A :class:`Placement` is what the router would do with a request, stopped before the first byte
goes out: the same admission (``Router.admit``: JSON, schema, model, prompt measured and tokenized
for the policy), the same decode slot (``Flow.acquire_decode``: policy, generation shift, queue,
429/503), the same split decision and prefill choice (``Flow.wants_split``, ``Flow.acquire_prefill``:
threshold, same-generation prefill, fallbacks by reason). The gateway then carries the request; the
picker holds the slots until the proxy says the request ended, so the pools' in-flight counts, the
queue and the policies see gateway traffic exactly as they see the router's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import orjson

from splitserve.router import errors
from splitserve.router.app import PREFILLER_HEADER, Router
from splitserve.router.flow import Handling, Outcome, RequestContext
from splitserve.router.pool import Worker

log = logging.getLogger(__name__)
request_log = logging.getLogger("splitserve.epp.requests")

# Paths whose body is a generation request the router knows how to measure and split.
GENERATION_PATHS = {"/v1/completions": False, "/v1/chat/completions": True}
# Endpoints listed after the destination, tried in order by the proxy when one cannot be reached.
DEFAULT_FALLBACKS = 2


def netloc(url: str) -> str:
    """``host:port`` of a worker URL."""
    return urlsplit(url).netloc


@dataclass
class Placement:
    """Where one request goes, and the slots it holds until the proxy reports its end."""

    path: str
    started: float
    endpoints: list[str]  # the destination first, then the fallbacks
    decode: Worker | None = None  # holds a decode slot when set
    prefill: Worker | None = None  # holds a prefill slot when set
    ctx: RequestContext | None = None
    served: str | None = None
    status: int | None = None
    first_response_at: float | None = None
    headers: dict[str, str] = field(default_factory=dict)  # to set on the request
    remove_headers: tuple[str, ...] = ()

    @property
    def destination(self) -> str:
        return ",".join(self.endpoints)


class EndpointPicker:
    """Picks pods for a gateway with a :class:`Router`'s pools, discovery, policies and metrics."""

    def __init__(
        self,
        router: Router,
        *,
        target_port: int | None = None,
        target_endpoints: Mapping[str, str] | None = None,
        fallbacks: int = DEFAULT_FALLBACKS,
    ) -> None:
        self.router = router
        self._target_port = target_port
        self._targets = {url.rstrip("/"): endpoint for url, endpoint in (target_endpoints or {}).items()}
        self._fallbacks = fallbacks
        self.active = 0

    # ---- addresses --------------------------------------------------------------------------

    def endpoint_of(self, worker: Worker) -> str:
        """The address the gateway sends ``worker``'s requests to: its sidecar, or the worker itself."""
        mapped = self._targets.get(worker.url)
        if mapped is not None:
            return mapped
        parts = urlsplit(worker.url)
        if self._target_port is not None:
            return f"{parts.hostname}:{self._target_port}"
        return parts.netloc

    def _subset_urls(self, subset: AbstractSet[str]) -> frozenset[str]:
        return frozenset(w.url for w in self.router.decode.workers if self.endpoint_of(w) in subset)

    def _fallback_endpoints(self, chosen: Worker, only: AbstractSet[str] | None) -> list[str]:
        # Same generation first (a split request's KV pairs only with it), then the least busy.
        others = [w for w in self.router.decode.healthy if w is not chosen and (only is None or w.url in only)]
        others.sort(key=lambda w: (w.generation != chosen.generation, w.inflight, w.url))
        return [self.endpoint_of(w) for w in others[: self._fallbacks]]

    # ---- the pick ---------------------------------------------------------------------------

    async def place(
        self, path: str, headers: Mapping[str, str], body: bytes | None, subset: AbstractSet[str] | None
    ) -> Placement:
        """Choose where the request goes; RouterError (an OpenAI-style error to answer) when it cannot go."""
        router = self.router
        started = time.monotonic()
        if router.draining:
            raise errors.draining()
        only = None
        if subset is not None:
            only = self._subset_urls(subset)
            if not any(w.url in only for w in router.decode.healthy):
                raise errors.RouterError(
                    503,
                    f"None of the {len(subset)} endpoints the gateway allowed is a ready worker of this pool.",
                    "no_endpoint_in_subset",
                    error_type="service_unavailable_error",
                    headers={"Retry-After": "1"},
                )
        chat = GENERATION_PATHS.get(path)
        if chat is None or not body:
            return self._place_other(path, started, only)
        ctx = await router.admit(body, path, chat, headers, started)
        placement = Placement(path, started, [], ctx=ctx)
        placement.decode = await router.flow.acquire_decode(ctx, only)
        try:
            await self._split(placement, ctx, only)
        except BaseException:
            # Cancelled while choosing prefill (the proxy gave up): no slot may leak.
            self._release(placement)
            raise
        self.active += 1
        return placement

    async def _split(self, placement: Placement, ctx: RequestContext, only: AbstractSet[str] | None) -> None:
        router = self.router
        assert placement.decode is not None
        ctx.decode_url = placement.decode.url
        placement.endpoints = [self.endpoint_of(placement.decode), *self._fallback_endpoints(placement.decode, only)]
        placement.headers["x-request-id"] = ctx.request_id
        if not router.flow.wants_split(ctx):
            ctx.handling = Handling.AGGREGATED
        else:
            prefill = await router.flow.acquire_prefill(ctx)
            if isinstance(prefill, str):
                router.metrics.fallbacks.labels(prefill).inc()
                ctx.handling, ctx.fallback_reason = Handling.FALLBACK, prefill
            else:
                placement.prefill = prefill
                ctx.handling = Handling.DISAGGREGATED
                ctx.prefill_url, ctx.prefill_generation = prefill.url, prefill.generation
                placement.headers[PREFILLER_HEADER] = netloc(prefill.url)
        if PREFILLER_HEADER not in placement.headers:
            # A client's own header must not steer the sidecar.
            placement.remove_headers = (PREFILLER_HEADER,)

    def _place_other(self, path: str, started: float, only: AbstractSet[str] | None) -> Placement:
        # /v1/models, /tokenize and the like: any ready worker, least busy first; no slot is held.
        candidates = [w for w in self.router.decode.healthy if only is None or w.url in only]
        if not candidates:
            raise errors.no_capacity("decode", 0)
        chosen = min(candidates, key=lambda w: (w.inflight, w.url))
        placement = Placement(path, started, [self.endpoint_of(chosen), *self._fallback_endpoints(chosen, only)])
        placement.remove_headers = (PREFILLER_HEADER,)
        return placement

    # ---- what the proxy reports back --------------------------------------------------------

    def response_started(self, placement: Placement, status: int | None, served: str | None) -> None:
        """The upstream answered (headers): prefill is over, and ``served`` is who answered."""
        placement.first_response_at = time.monotonic()
        placement.status = status
        placement.served = served
        if placement.prefill is not None:
            self.router.prefill.release(placement.prefill)
            placement.prefill = None
        decode = placement.decode
        if decode is None or not served or served == self.endpoint_of(decode):
            return
        # The proxy fell back: the first choice could not be reached, and the slot moves to who served.
        self.router.decode.record_failure(decode)
        self.router.decode.release(decode)
        placement.decode = None
        for worker in self.router.decode.workers:
            if self.endpoint_of(worker) == served:
                self.router.decode.claim(worker)
                placement.decode = worker
                if placement.ctx is not None:
                    placement.ctx.decode_url, placement.ctx.generation = worker.url, worker.generation
                break

    def _release(self, placement: Placement) -> None:
        router = self.router
        if placement.prefill is not None:
            router.prefill.release(placement.prefill)
            placement.prefill = None
        if placement.decode is not None:
            if placement.status is not None:
                # A 5xx from the pod (its sidecar could not get an answer from its engine) counts
                # toward ejection, as the router's own failed legs do.
                if placement.status >= 500:
                    router.decode.record_failure(placement.decode)
                else:
                    router.decode.record_success(placement.decode)
            router.decode.release(placement.decode)
            placement.decode = None

    def finished(self, placement: Placement) -> None:
        """The proxy closed the request's stream: give the slots back and count the request."""
        router = self.router
        self._release(placement)
        ctx = placement.ctx
        if ctx is None:
            return
        self.active -= 1
        now = time.monotonic()
        elapsed = now - placement.started
        status = placement.status
        if status is None:
            outcome = Outcome.CANCELLED
        elif status < 400:
            outcome = Outcome.SUCCESS
        elif status < 500:
            outcome = Outcome.CLIENT_ERROR
        else:
            outcome = Outcome.UPSTREAM_ERROR
        metrics = router.metrics
        metrics.requests.labels(outcome.value, ctx.handling.value).inc()
        metrics.generation_requests.labels(ctx.generation, outcome.value).inc()
        metrics.e2e.observe(elapsed)
        if ctx.stream and placement.first_response_at is not None and outcome is Outcome.SUCCESS:
            # A streamed answer's headers leave with its first token: the gateway's view of TTFT.
            ttft = placement.first_response_at - placement.started
            metrics.ttft.observe(ttft)
            metrics.generation_ttft.labels(ctx.generation).observe(ttft)
        metrics.request_finished()
        if request_log.isEnabledFor(logging.INFO):
            record = {
                "event": "pick",
                "request_id": ctx.request_id,
                "path": placement.path,
                "status": status,
                "outcome": outcome.value,
                "mode": ctx.handling.value,
                "destination": placement.destination,
                "served": placement.served,
                "prefill": ctx.prefill_url,
                "generation": ctx.generation,
                "fallback_reason": ctx.fallback_reason,
                "prompt_tokens": ctx.routing.prompt_tokens,
                "duration_s": round(elapsed, 6),
            }
            request_log.info(orjson.dumps(record).decode())

    def rejected(self, error: errors.RouterError) -> None:
        """A request answered by the picker itself (4xx/503): counted like the router counts it."""
        if error.status == 429:
            outcome = Outcome.REJECTED
        elif error.status >= 500:
            outcome = Outcome.NO_CAPACITY
        else:
            outcome = Outcome.CLIENT_ERROR
        self.router.metrics.requests.labels(outcome.value, Handling.NONE.value).inc()
        self.router.metrics.request_finished()
