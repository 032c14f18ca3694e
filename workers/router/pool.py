"""A pool of workers of one role: membership, health, ejection, slots and the wait for a slot.

Requests take a *slot* on a worker (``acquire``) for as long as they use it and give it back
(``release``). A worker is routable when it is healthy and below the per-worker cap. When no worker
is routable a request waits in the pool's FIFO, bounded by the shared :class:`AdmissionBudget`
(429 beyond it) and by a deadline (503 after it): this is both backpressure and scale-to-zero
buffering, and the waiting count is the queue depth the autoscaler reads.

Each worker has a KV *generation* (from discovery; "" when unknown). ``acquire`` can be limited to
some generations, so the flow pairs prefill and decode of one generation while the routing policy
still only sees candidates (pairing.py says which generations).
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Set as AbstractSet

import aiohttp

from splitserve.router import errors
from splitserve.router.adapters import ModelCard, adapter_names, parse_active_adapters, parse_models
from splitserve.router.kv_feed import KvEventFeed
from splitserve.router.kv_index import KvBlockIndex
from splitserve.router.metrics import RouterMetrics
from splitserve.router.pairing import Generations
from splitserve.router.policies import (
    KvAware,
    PrecisePrefix,
    PrefixAware,
    RoutingRequest,
    WorkerChooser,
    prefer_active_adapter,
)
from splitserve.router.upstream import HttpPool

log = logging.getLogger(__name__)


def _accepts(generations: Generations, generation: str) -> bool:
    return generations is None or generation in generations


def _overlap(a: Generations, b: Generations) -> bool:
    return a is None or b is None or not a.isdisjoint(b)


class WorkerState(enum.StrEnum):
    HEALTHY = "healthy"
    EJECTED = "ejected"
    TERMINATING = "terminating"


class AdmissionBudget:
    """How many requests may wait for a slot, across all pools, before the router says 429."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.waiting = 0

    def enter(self) -> None:
        if self.waiting >= self.limit:
            raise errors.queue_full(retry_after_seconds=1)
        self.waiting += 1

    def leave(self) -> None:
        self.waiting -= 1


class Worker:
    """One upstream worker: its connection pool and what the router knows about it."""

    def __init__(
        self, url: str, pool: str, session: aiohttp.ClientSession, http: HttpPool, generation: str = ""
    ) -> None:
        self.url = url.rstrip("/")
        self.pool = pool
        # The KV generation (model revision + engine image) it serves; "" when discovery cannot tell.
        self.generation = generation
        self.session = session  # probes and polls
        self.http = http  # the request path
        self.state = WorkerState.HEALTHY
        self.inflight = 0
        self.consecutive_failures = 0
        self.ejections = 0
        self.ejected_at = 0.0
        self.removed = False
        self.kv_usage: float | None = None
        self.waiting: float | None = None
        # LoRA (router --lora): the models the worker's own /v1/models lists, the adapters among them,
        # and those active in its engine. ``models`` is None until the worker first answered.
        self.models: tuple[ModelCard, ...] | None = None
        self.adapters: frozenset[str] = frozenset()
        self.active_adapters: frozenset[str] = frozenset()

    @property
    def key(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"Worker({self.url!r}, {self.state}, generation={self.generation!r}, inflight={self.inflight})"

    def describe(self, state: str | None = None) -> dict[str, object]:
        """The worker as GET /splitserve/workers lists it."""
        described: dict[str, object] = {"url": self.url, "generation": self.generation,
                                         "state": state or str(self.state), "inflight": self.inflight}  # fmt: skip
        if self.models is not None:
            described["adapters"] = sorted(self.adapters)
            described["active_adapters"] = sorted(self.active_adapters)
        return described


def parse_engine_load(text: str) -> tuple[float | None, float | None]:
    """(kv usage in [0, 1], waiting requests) summed over the lines of vLLM's /metrics text."""
    kv: float | None = None
    waiting: float | None = None
    for line in text.splitlines():
        if line.startswith("vllm:kv_cache_usage_perc") or line.startswith("vllm:num_requests_waiting"):
            name, _, value = line.rpartition(" ")
            if "num_requests_waiting_by_reason" in name:
                continue
            try:
                number = float(value)
            except ValueError:
                continue
            if name.startswith("vllm:kv_cache_usage_perc"):
                kv = max(kv or 0.0, number)
            else:
                waiting = (waiting or 0.0) + number
    return kv, waiting


class WorkerPool:
    def __init__(
        self,
        name: str,
        policy: WorkerChooser,
        metrics: RouterMetrics,
        budget: AdmissionBudget,
        *,
        max_inflight_per_worker: int,
        connect_timeout: float,
        eject_after_failures: int,
        eject_min_seconds: float,
        health_interval: float,
        metrics_poll_interval: float,
        kv_event_endpoints: dict[str, str] | None = None,
        lora: bool = False,
        models_poll_interval: float = 2.0,
    ) -> None:
        self.name = name
        self.policy = policy
        self._metrics = metrics
        self._budget = budget
        self._cap = max_inflight_per_worker
        self._connect_timeout = connect_timeout
        self._eject_after = eject_after_failures
        self._eject_min = eject_min_seconds
        self._health_interval = health_interval
        self._poll_interval = metrics_poll_interval
        self.lora = lora
        self._models_interval = models_poll_interval
        self._workers: dict[str, Worker] = {}
        self._routable: list[Worker] = []
        self._healthy_generations: frozenset[str] = frozenset()
        # Requests waiting for a slot, in order, each with the generations it may take.
        self._waiters: collections.deque[tuple[asyncio.Future[None], Generations]] = collections.deque()
        self._tasks: list[asyncio.Task[None]] = []
        self._polls: set[asyncio.Task[None]] = set()
        self.inflight = 0
        # Removed from discovery but still serving requests: reported until their last one ends.
        self.departing: set[Worker] = set()
        # precise-prefix reads what each worker's engine publishes about its own prefix cache.
        self.kv_feed: KvEventFeed | None = None
        if isinstance(policy, PrecisePrefix) and isinstance(policy.cache, KvBlockIndex):
            self.kv_feed = KvEventFeed(policy.cache, overrides=kv_event_endpoints)

    # ---- membership -------------------------------------------------------------------------

    @property
    def workers(self) -> list[Worker]:
        return sorted(self._workers.values(), key=lambda w: w.url)

    @property
    def healthy(self) -> list[Worker]:
        """The healthy workers, by URL: kept by _changed() on every state change."""
        return list(self._routable)

    @property
    def has_healthy(self) -> bool:
        return bool(self._routable)

    def has_healthy_except(self, tried: AbstractSet[str], generations: Generations = None) -> bool:
        return any(
            w.state is WorkerState.HEALTHY and w.url not in tried and _accepts(generations, w.generation)
            for w in self._workers.values()
        )

    @property
    def healthy_generations(self) -> frozenset[str]:
        """The generations with at least one healthy worker (kept by _changed())."""
        return self._healthy_generations

    def has_healthy_in(self, generations: Generations) -> bool:
        if generations is None:
            return bool(self._routable)
        return not self._healthy_generations.isdisjoint(generations)

    def describe(self) -> list[dict[str, object]]:
        """Every worker, departing ones (removed from discovery, still serving) with state "departing"."""
        departing = sorted(self.departing, key=lambda w: w.url)
        return [w.describe() for w in self.workers] + [w.describe("departing") for w in departing]

    @property
    def queue_depth(self) -> int:
        return len(self._waiters)

    def kv_index_state(self) -> dict[str, tuple[int, int]]:
        """precise-prefix: per worker, (blocks its KV events say it holds, newest event seq applied or -1)."""
        feed = self.kv_feed
        if feed is None:
            return {}
        return {w.url: (feed.index.blocks_held(w.url), feed.last_seq.get(w.url, -1)) for w in self._workers.values()}

    def set_endpoints(
        self, ready: Iterable[str], terminating: Iterable[str] = (), generations: Mapping[str, str] | None = None
    ) -> None:
        """Apply a discovery snapshot: new URLs join, terminating ones get no new requests, missing
        ones leave (their connection pool closes once their last request finishes). ``generations``
        maps URLs to KV generations; a URL it leaves out is of generation "" (unknown)."""
        known = {u.rstrip("/"): g for u, g in (generations or {}).items()}
        ready_set = {u.rstrip("/") for u in ready}
        terminating_set = {u.rstrip("/") for u in terminating} - ready_set
        for url in ready_set | terminating_set:
            generation = known.get(url, "")
            worker = self._workers.get(url)
            if worker is not None and worker.generation != generation:
                # Another worker on the same address (a Pod IP reused): the old one departs.
                self._remove(url)
                worker = None
            if worker is None:
                worker = Worker(url, self.name, self._new_session(), HttpPool(url, self._connect_timeout), generation)
                self._workers[url] = worker
                log.info("%s worker added: %s (generation %r)", self.name, url, generation)
                if self.kv_feed is not None:
                    self.kv_feed.watch(url)
                if self.lora:
                    self._spawn_poll(worker)  # its adapters at once, not at the next poll
            if url in terminating_set:
                worker.state = WorkerState.TERMINATING
            elif worker.state is WorkerState.TERMINATING:
                worker.state = WorkerState.HEALTHY
        for url in [u for u in self._workers if u not in ready_set | terminating_set]:
            self._remove(url)
        self._changed()

    def _remove(self, url: str) -> None:
        worker = self._workers.pop(url)
        worker.removed = True
        log.info("%s worker removed: %s", self.name, url)
        if isinstance(self.policy, PrefixAware):
            self.policy.forget_worker(url)
        if self.kv_feed is not None:
            self.kv_feed.unwatch(url)
        if worker.inflight == 0:
            self._close_later(worker)
        else:
            self.departing.add(worker)

    def _new_session(self) -> aiohttp.ClientSession:
        # Idle connections are dropped after 4 s, before uvicorn (vLLM) closes them at its default 5 s:
        # a request sent on a connection the server is closing would fail for nothing.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0, enable_cleanup_closed=False)
        return aiohttp.ClientSession(
            connector=connector,
            cookie_jar=aiohttp.DummyCookieJar(),  # workers set no cookies; skip the jar's per-request work
            timeout=aiohttp.ClientTimeout(total=None, connect=self._connect_timeout),
            skip_auto_headers=("User-Agent",),
            auto_decompress=False,
        )

    def _close_later(self, worker: Worker) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(_close_worker(worker))
        self._tasks.append(task)
        task.add_done_callback(self._tasks.remove)

    def _spawn_poll(self, worker: Worker) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(self._poll_models(worker))
        self._polls.add(task)
        task.add_done_callback(self._polls.discard)

    def _changed(self) -> None:
        self._routable = [
            w for w in sorted(self._workers.values(), key=lambda w: w.url) if w.state is WorkerState.HEALTHY
        ]
        self._healthy_generations = frozenset(w.generation for w in self._routable)
        self._wake_all()

    # ---- slots ------------------------------------------------------------------------------

    def _try_acquire(
        self,
        request: RoutingRequest,
        exclude: frozenset[str],
        generations: Generations = None,
        only: AbstractSet[str] | None = None,
    ) -> Worker | None:
        cap = self._cap
        candidates = [
            w
            for w in self._routable
            if (cap <= 0 or w.inflight < cap)
            and _accepts(generations, w.generation)
            and (only is None or w.url in only)
        ]
        lora = request.lora_name
        if lora is not None:
            candidates = [w for w in candidates if lora in w.adapters]
        if not candidates:
            return None
        if lora is not None:
            candidates = list(prefer_active_adapter(candidates, lambda w: lora in w.active_adapters))
        if exclude:
            # Prefer a worker not tried yet; with no other choice, the same one beats failing.
            preferred = [w for w in candidates if w.url not in exclude]
            candidates = preferred or candidates
        worker = self.policy.choose(candidates, request)
        # Gauges are read from these counters at scrape time (metrics.PoolCollector): no per-request cost.
        worker.inflight += 1
        self.inflight += 1
        return worker

    async def acquire(
        self,
        request: RoutingRequest,
        deadline: float,
        exclude: frozenset[str] = frozenset(),
        generations: Generations | Callable[[], Generations] = None,
        only: AbstractSet[str] | None = None,
    ) -> Worker:
        """A slot on a worker chosen by the policy among those of ``generations`` (None: any), waiting
        until ``deadline`` (monotonic time). ``only`` limits the choice to those URLs (a gateway's subset
        hint, a prefill pod named by the endpoint picker).

        ``generations`` may be a function, asked again after every wake-up: which generations fit can
        change while a request waits (a rollout moves on). A request limited to generations of which
        no worker is healthy any more, while workers of others are, stops waiting at once (503
        no_capacity): nothing it may take is coming back soon, and the caller can do better.
        """
        wanted = generations() if callable(generations) else generations
        # Waiters that could take the same workers go first; those limited to other generations do not
        # hold this request back.
        if not any(_overlap(g, wanted) for _, g in self._waiters):
            worker = self._try_acquire(request, exclude, wanted, only)
            if worker is not None:
                return worker
        self._give_up_if_gone(wanted, deadline)
        self._budget.enter()
        loop = asyncio.get_running_loop()
        try:
            first = True
            while True:
                future: asyncio.Future[None] = loop.create_future()
                entry = (future, wanted)
                if first:
                    self._waiters.append(entry)
                else:
                    self._waiters.appendleft(entry)  # keep its place after losing a race
                first = False
                remaining = deadline - time.monotonic()
                try:
                    if remaining <= 0:
                        raise TimeoutError
                    await asyncio.wait_for(future, remaining)
                except TimeoutError:
                    raise errors.no_capacity(self.name, max(0.0, remaining)) from None
                finally:
                    if not future.done():
                        future.cancel()
                    if entry in self._waiters:
                        self._waiters.remove(entry)
                wanted = generations() if callable(generations) else generations
                worker = self._try_acquire(request, exclude, wanted, only)
                if worker is not None:
                    return worker
                self._give_up_if_gone(wanted, deadline)
        finally:
            self._budget.leave()

    def _give_up_if_gone(self, wanted: Generations, deadline: float) -> None:
        if wanted is not None and self._routable and self._healthy_generations.isdisjoint(wanted):
            raise errors.no_capacity(self.name, max(0.0, deadline - time.monotonic()))

    def find(self, url: str) -> Worker | None:
        """The worker at ``url`` (current members only)."""
        return self._workers.get(url)

    def claim(self, worker: Worker) -> None:
        """Count a request on ``worker`` that was placed there without ``acquire`` (a gateway that
        served it on a fallback endpoint); ``release`` gives it back as usual."""
        worker.inflight += 1
        self.inflight += 1

    def release(self, worker: Worker) -> None:
        worker.inflight -= 1
        self.inflight -= 1
        if worker.removed and worker.inflight == 0:
            self.departing.discard(worker)
            self._close_later(worker)
        self._wake_one(worker.generation)

    def _wake_all(self) -> None:
        while self._waiters:
            future, _ = self._waiters.popleft()
            if not future.done():
                future.set_result(None)

    def _wake_one(self, generation: str) -> None:
        """Wake the first waiter that may take a slot freed on a worker of ``generation``."""
        for entry in self._waiters:
            future, generations = entry
            if future.done():
                continue
            if _accepts(generations, generation):
                self._waiters.remove(entry)
                future.set_result(None)
                return

    # ---- health -----------------------------------------------------------------------------

    def record_success(self, worker: Worker) -> None:
        worker.consecutive_failures = 0

    def record_failure(self, worker: Worker) -> None:
        worker.consecutive_failures += 1
        if worker.state is WorkerState.HEALTHY and worker.consecutive_failures >= self._eject_after:
            worker.state = WorkerState.EJECTED
            worker.ejected_at = time.monotonic()
            worker.ejections += 1
            self._metrics.ejections.labels(self.name).inc()
            log.warning("%s worker ejected after %d failures: %s", self.name, worker.consecutive_failures, worker.url)
            self._changed()

    def eject_backoff(self, worker: Worker) -> float:
        return float(min(30.0, self._eject_min * 2.0 ** max(0, worker.ejections - 1)))

    async def _probe(self, worker: Worker) -> bool:
        try:
            timeout = aiohttp.ClientTimeout(total=max(1.0, self._connect_timeout))
            async with worker.session.get(worker.url + "/health", timeout=timeout) as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    async def check_ejected(self) -> None:
        """Re-admit ejected workers whose backoff passed and whose /health answers 200."""
        now = time.monotonic()
        due = [
            w
            for w in list(self._workers.values())
            if w.state is WorkerState.EJECTED and now - w.ejected_at >= self.eject_backoff(w)
        ]
        results = await asyncio.gather(*(self._probe(w) for w in due))
        readmitted = False
        for worker, healthy in zip(due, results, strict=True):
            if healthy and worker.state is WorkerState.EJECTED and not worker.removed:
                worker.state = WorkerState.HEALTHY
                worker.consecutive_failures = 0
                readmitted = True
                log.info("%s worker re-admitted: %s", self.name, worker.url)
            elif not healthy:
                worker.ejected_at = time.monotonic()  # next probe after the same backoff
        if readmitted:
            self._changed()

    async def poll_load(self) -> None:
        """Refresh KV usage and waiting queue from each healthy worker's /metrics."""

        async def one(worker: Worker) -> None:
            try:
                timeout = aiohttp.ClientTimeout(total=max(1.0, self._poll_interval))
                async with worker.session.get(worker.url + "/metrics", timeout=timeout) as response:
                    if response.status != 200:
                        return
                    worker.kv_usage, worker.waiting = parse_engine_load(await response.text())
            except (aiohttp.ClientError, TimeoutError, OSError):
                worker.kv_usage = worker.waiting = None

        await asyncio.gather(*(one(w) for w in self._routable))

    # ---- LoRA adapters ----------------------------------------------------------------------

    def serves(self, model: str) -> bool:
        """Whether any current worker (healthy or not) lists ``model`` as an adapter."""
        return any(model in w.adapters for w in self._workers.values())

    def serves_healthy(self, model: str, generations: Generations = None, only: AbstractSet[str] | None = None) -> bool:
        """Whether a healthy worker (of ``generations``, among ``only`` URLs) lists adapter ``model``."""
        return any(
            model in w.adapters and _accepts(generations, w.generation) and (only is None or w.url in only)
            for w in self._routable
        )

    @property
    def models_known(self) -> bool:
        """Whether every healthy worker has told its models (so a name none lists is served nowhere)."""
        return all(w.models is not None for w in self._routable)

    def model_cards(self) -> dict[str, ModelCard]:
        """Every adapter some worker lists, by name (the first worker's card, by URL)."""
        cards: dict[str, ModelCard] = {}
        for worker in self.workers:
            for card in worker.models or ():
                if card.parent is not None:
                    cards.setdefault(card.id, card)
        return cards

    async def _poll_models(self, worker: Worker) -> None:
        """Refresh one worker's adapters (/v1/models) and active adapters (vllm:lora_requests_info)."""
        timeout = aiohttp.ClientTimeout(total=max(1.0, self._models_interval))
        try:
            async with worker.session.get(worker.url + "/v1/models", timeout=timeout) as response:
                # A worker without /v1/models (an old engine) serves its base model only.
                cards = parse_models(await response.read()) if response.status == 200 else ()
            async with worker.session.get(worker.url + "/metrics", timeout=timeout) as response:
                active = parse_active_adapters(await response.text()) if response.status == 200 else frozenset()
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as error:
            log.debug("%s worker %s: models not read: %s", self.name, worker.url, error)
            return  # keep what was known: a worker that does not answer is ejected by the health path
        adapters = adapter_names(cards)
        changed = worker.models is None or adapters != worker.adapters
        if adapters != worker.adapters:
            log.info("%s worker %s serves adapters: %s", self.name, worker.url, ", ".join(sorted(adapters)) or "-")
        worker.models, worker.adapters, worker.active_adapters = cards, adapters, active
        if changed:
            self._changed()  # waiters for an adapter that just arrived may go now

    async def poll_models(self) -> None:
        await asyncio.gather(*(self._poll_models(w) for w in list(self._workers.values())))

    async def run_background(self) -> None:
        """Health probes (and load polls for kv-aware routing, model polls for LoRA) until cancelled."""
        poll = isinstance(self.policy, KvAware)
        next_poll = 0.0
        next_models = time.monotonic() + self._models_interval
        while True:
            try:
                await self.check_ejected()
                if poll and time.monotonic() >= next_poll:
                    next_poll = time.monotonic() + self._poll_interval
                    await self.poll_load()
                if self.lora and time.monotonic() >= next_models:
                    next_models = time.monotonic() + self._models_interval
                    await self.poll_models()
            except Exception:  # a background loop must survive anything one probe does
                log.exception("%s pool background check failed", self.name)
            intervals = [self._health_interval]
            if poll:
                intervals.append(self._poll_interval)
            if self.lora:
                intervals.append(self._models_interval)
            await asyncio.sleep(min(intervals))

    async def close(self) -> None:
        for poll in list(self._polls):
            poll.cancel()
        if self.kv_feed is not None:
            await self.kv_feed.close()
        for worker in [*self._workers.values(), *self.departing]:
            await _close_worker(worker)
        self._workers.clear()
        for task in list(self._tasks):
            await task


async def _close_worker(worker: Worker) -> None:
    await worker.http.close()
    await worker.session.close()
