"""The simulated engine core: one asyncio task runs the continuous-batching step loop.

Each loop iteration asks the scheduler for a plan, sleeps for the plan's modelled duration (times
``time_scale``), applies it, and hands every emitted token to its request's event queue. KV pulls
for remote-prefilled requests run as separate tasks through an injected ``KVPuller`` (HTTP in the
server), and KV-cache events go to an injected ``KVEventSink`` (the ZMQ publisher in the server), so
this module has no network code. The prefill side's held KV lives here too.

KV events: as vLLM's scheduler does in ``update_from_output``, the pool's events are drained after
every step and handed over as one ``KVEventBatch`` when there are any.

Queue gauges: vLLM's running and waiting counts are the scheduler's stats made after each step
(``make_stats`` in ``update_from_output``), and a request that arrives during a step sits in the
engine core's input queue, not in ``waiting``, until the next schedule. So a waiting request in
vLLM's gauge is one the scheduler could not admit, never one that merely arrived mid-step. The
simulator publishes the same per-step snapshot: a live count would show every mid-step arrival as
queued, and a machine whose event loop lags would look saturated with free batch slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from splitserve.sim.config import KVLoadFailurePolicy, SimConfig
from splitserve.sim.kv_events import KVEventBatch
from splitserve.sim.metrics import LiveState, SimMetrics
from splitserve.sim.scheduler import Phase, Scheduler, Sequence, StepPlan

log = logging.getLogger(__name__)

MAX_CATCH_UP_S = 0.05
"""How far the step loop may run behind its modelled schedule before it stops catching up."""


class KVTransferError(Exception):
    """A KV pull failed: other generation, unknown engine, unknown or expired blocks, another adapter,
    prompt mismatch, unreachable peer. ``reason`` labels the prefill side's refusal counter."""

    def __init__(self, message: str, reason: str = "other") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class RemotePrefill:
    """The ``kv_transfer_params`` a decode request carries (as returned by a prefill engine)."""

    engine_id: str
    block_ids: list[int]
    host: str
    port: int
    request_id: str | None = None

    @classmethod
    def parse(cls, params: dict[str, object]) -> RemotePrefill:
        engine_id, blocks = params.get("remote_engine_id"), params.get("remote_block_ids")
        host, port = params.get("remote_host"), params.get("remote_port")
        if not isinstance(engine_id, str) or not engine_id:
            raise ValueError("kv_transfer_params.remote_engine_id must be a non-empty string")
        if not isinstance(blocks, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in blocks):
            raise ValueError("kv_transfer_params.remote_block_ids must be a list of integers")
        if not isinstance(host, str) or not host:
            raise ValueError("kv_transfer_params.remote_host must be a non-empty string")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise ValueError("kv_transfer_params.remote_port must be a port number")
        request_id = params.get("request_id", params.get("remote_request_id"))
        return cls(engine_id, list(blocks), host, port, request_id if isinstance(request_id, str) else None)


@dataclass(frozen=True)
class PullRequest:
    """What a decode engine sends to the prefill engine's side channel (``POST /internal/kv/pull``)."""

    engine_id: str
    block_ids: list[int]
    request_id: str | None
    prompt_digest: str
    transfer_seconds: float
    generation: str = ""
    """The pulling (decode) engine's KV generation."""
    lora_name: str | None = None
    """The LoRA adapter the decode request is for (None: the base model)."""

    def to_json(self) -> dict[str, object]:
        return {
            "engine_id": self.engine_id,
            "generation": self.generation,
            "lora_name": self.lora_name,
            "block_ids": self.block_ids,
            "request_id": self.request_id,
            "prompt_digest": self.prompt_digest,
            "transfer_seconds": self.transfer_seconds,
        }


def _model_of(lora_name: str | None) -> str:
    return "the base model" if lora_name is None else f"LoRA adapter {lora_name!r}"


KVPuller = Callable[[RemotePrefill, PullRequest], Awaitable[None]]
KVEventSink = Callable[[KVEventBatch], None]
"""Takes one step's KV events; must not block (the publisher only enqueues)."""


@dataclass(frozen=True)
class TokenEvent:
    token_id: int


@dataclass(frozen=True)
class DoneEvent:
    kv_transfer_params: dict[str, object] | None


@dataclass(frozen=True)
class ErrorEvent:
    status: int
    message: str


Event = TokenEvent | DoneEvent | ErrorEvent


@dataclass(eq=False)
class EngineRequest:
    """A request inside the engine, with its timestamps and the queue its tokens go to."""

    seq: Sequence
    remote_prefill: RemotePrefill | None = None
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.monotonic)
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    prompt_counted: bool = False


@dataclass
class _HeldKV:
    request_id: str
    block_ids: list[int]
    prompt_digest: str
    lora_name: str | None = None
    expiry: asyncio.TimerHandle | None = None


@dataclass(frozen=True)
class QueueCounts:
    """The scheduler's queues as vLLM's SchedulerStats report them: running after the step, waiting
    (for capacity, and deferred on a KV pull) as left by the step's schedule."""

    running: int = 0
    waiting_for_capacity: int = 0
    deferred: int = 0


class SimEngine:
    def __init__(
        self, config: SimConfig, engine_id: str, puller: KVPuller, kv_events: KVEventSink | None = None
    ) -> None:
        self.config = config
        self.engine_id = engine_id
        self._puller = puller
        self._kv_events = kv_events
        max_loras = config.lora.max_loras if config.lora is not None else None
        self.scheduler = Scheduler(
            config.limits, enable_kv_cache_events=kv_events is not None, max_loras=max_loras or 1
        )
        self.metrics = SimMetrics(
            config.model,
            config.limits,
            LiveState(
                running=lambda: float(self._counts.running),
                waiting_for_capacity=lambda: float(self._counts.waiting_for_capacity),
                deferred=lambda: float(self._counts.deferred),
                kv_usage=lambda: self.scheduler.pool.usage,
            ),
            max_loras=max_loras,
        )
        self._counts = QueueCounts()  # as of the last step (or the last idle check)
        self._requests: dict[Sequence, EngineRequest] = {}
        self._held: dict[tuple[int, ...], _HeldKV] = {}
        self._pull_tasks: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self.steps = 0
        self.side_channel_port = 0
        """Advertised as ``remote_port``; the server sets it once its listening port is known."""

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self._run(), name=f"sim-engine-{self.engine_id}")
        self._loop_task.add_done_callback(self._loop_ended)

    def _loop_ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        # A bug in the simulator must not leave clients hanging: fail everything that is pending.
        log.error("simulated engine loop crashed", exc_info=task.exception())
        self._fail_pending(500, f"The simulated engine crashed: {task.exception()!r}")

    def _fail_pending(self, status: int, message: str) -> None:
        for request in self._requests.values():
            request.events.put_nowait(ErrorEvent(status, message))
        self._requests.clear()

    async def stop(self) -> None:
        """Stop the loop; requests still in the engine get a 503 error event so their handlers end."""
        self._fail_pending(503, "The engine stopped before the request finished.")
        tasks = [t for t in (self._loop_task, *self._pull_tasks) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for held in self._held.values():
            if held.expiry is not None:
                held.expiry.cancel()
        self._held.clear()

    # --- requests ----------------------------------------------------------------------------

    def submit(self, request: EngineRequest) -> None:
        if self._loop_task is None or self._loop_task.done():
            request.events.put_nowait(ErrorEvent(503, "The simulated engine is not running."))
            return
        self._requests[request.seq] = request
        self.scheduler.add(request.seq)
        self._wake.set()

    def abort(self, request: EngineRequest) -> None:
        """Forget ``request`` (its client went away); frees its KV unless it is held for a puller."""
        if self._requests.pop(request.seq, None) is not None:
            self.scheduler.abort(request.seq)
            self._wake.set()
            if request.seq.lora is not None:
                self._report_loras()  # no step may follow to say the adapter left

    @property
    def num_held(self) -> int:
        return len(self._held)

    # --- prefill side: KV held for remote decode ---------------------------------------------

    async def serve_pull(self, pull: PullRequest) -> int:
        """Hand held KV to a decode engine: wait out the transfer, then free it. Returns prompt tokens.

        Refusals raise KVTransferError and leave the KV held (a matching pull may still come, or it
        expires); each is counted in splitserve_sim_kv_pulls_refused_total by reason.
        """
        try:
            held = self._check_pull(pull)
        except KVTransferError as error:
            self.metrics.kv_pulls_refused(error.reason).inc()
            raise
        del self._held[tuple(pull.block_ids)]
        if held.expiry is not None:
            held.expiry.cancel()
        try:
            await asyncio.sleep(max(0.0, pull.transfer_seconds))
        finally:
            self.scheduler.pool.free(held.block_ids)
            self._wake.set()
        return len(held.block_ids)

    def _check_pull(self, pull: PullRequest) -> _HeldKV:
        # The generation first, as NIXL's handshake compares the peers' metadata before any block:
        # KV of other weights must never be handed over, whatever the block ids say.
        if pull.generation != self.config.generation:
            raise KVTransferError(
                f"incompatible peer: KV generation {pull.generation!r} cannot read KV of generation "
                f"{self.config.generation!r} (engine {self.engine_id})",
                "generation",
            )
        if pull.engine_id != self.engine_id:
            raise KVTransferError(
                f"unknown engine id {pull.engine_id!r} (this engine is {self.engine_id!r})", "unknown_engine"
            )
        held = self._held.get(tuple(pull.block_ids))
        if held is None:
            raise KVTransferError(
                f"unknown or expired block ids {pull.block_ids[:8]} on engine {self.engine_id}", "unknown_blocks"
            )
        if pull.request_id is not None and pull.request_id != held.request_id:
            raise KVTransferError(
                f"block ids belong to request {held.request_id}, not {pull.request_id}", "other_request"
            )
        if pull.lora_name != held.lora_name:
            # Real NIXL would hand the blocks over and the decode would answer wrong text that looks fine.
            raise KVTransferError(
                f"KV blocks were computed for {_model_of(held.lora_name)}, the decode request is for "
                f"{_model_of(pull.lora_name)}",
                "other_adapter",
            )
        if pull.prompt_digest != held.prompt_digest:
            raise KVTransferError("KV blocks were computed for a different prompt", "other_prompt")
        return held

    def _hold(self, request: EngineRequest) -> dict[str, object]:
        seq = request.seq
        prompt_blocks = seq.block_ids[: self.scheduler.pool.blocks_for(seq.num_prompt_tokens)]
        key = tuple(prompt_blocks)
        extra = seq.block_ids[len(prompt_blocks) :]
        if extra:
            self.scheduler.pool.free(extra)
        held = _HeldKV(seq.request_id, prompt_blocks, seq.digest().hex(), seq.lora_name)
        held.expiry = asyncio.get_running_loop().call_later(self.config.kv_hold_timeout_s, self._expire, key)
        self._held[key] = held
        seq.block_ids = []
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_block_ids": prompt_blocks,
            "remote_host": self.config.advertised_host,
            "remote_port": self.side_channel_port,
            "tp_size": 1,
            "request_id": seq.request_id,
        }

    def _expire(self, key: tuple[int, ...]) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            log.info("KV for request %s expired before a decode engine pulled it", held.request_id)
            self.scheduler.pool.free(held.block_ids)
            self.metrics.nixl_expired_requests.inc()
            self._wake.set()

    # --- decode side: pulling remote KV -------------------------------------------------------

    def _start_pull(self, request: EngineRequest) -> None:
        task = asyncio.get_running_loop().create_task(self._pull(request))
        self._pull_tasks.add(task)
        task.add_done_callback(self._pull_tasks.discard)

    async def _pull(self, request: EngineRequest) -> None:
        remote = request.remote_prefill
        assert remote is not None
        pull = PullRequest(
            engine_id=remote.engine_id,
            block_ids=remote.block_ids,
            request_id=remote.request_id,
            prompt_digest=request.seq.digest().hex(),
            transfer_seconds=self.config.latency.transfer_seconds(len(remote.block_ids)) * self.config.time_scale,
            generation=self.config.generation,
            lora_name=request.seq.lora_name,
        )
        try:
            await self._puller(remote, pull)
        except KVTransferError as error:
            self.metrics.nixl_failed_transfers.inc()
            if self.config.kv_load_failure_policy is KVLoadFailurePolicy.RECOMPUTE:
                log.warning("KV pull for %s failed (%s); recomputing the prefill", request.seq.request_id, error)
                self.scheduler.pull_failed_recompute(request.seq)
                self._wake.set()
                return
            self.scheduler.abort(request.seq)
            self._requests.pop(request.seq, None)
            request.events.put_nowait(
                ErrorEvent(500, f"KV transfer failed for request {request.seq.request_id}: {error}")
            )
        else:
            self.scheduler.pull_done(request.seq)
        self._wake.set()

    # --- the step loop --------------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        # Steps end on a running deadline rather than after a plain sleep each: timer overshoot
        # (about a millisecond per sleep on a busy machine) is paid back by the next steps instead
        # of adding up, so simulated throughput matches the latency model.
        deadline = loop.time()
        while True:
            plan = self.scheduler.schedule()
            self._after_schedule(plan)
            # Requests the scheduler could not admit: the queue vLLM's stats of this step report.
            unadmitted = (self.scheduler.num_waiting_for_capacity, self.scheduler.num_deferred)
            if not plan.has_work:
                # Idle (or stuck: nothing admissible): what is queued now stays queued until a wake.
                self._counts = QueueCounts(len(self.scheduler.running), *unadmitted)
                self._wake.clear()
                await self._wake.wait()
                deadline = loop.time()
                continue
            seconds = plan.seconds(self.config.latency)
            deadline = max(deadline, loop.time() - MAX_CATCH_UP_S) + seconds * self.config.time_scale
            await asyncio.sleep(max(0.0, deadline - loop.time()))
            self.steps += 1
            self.metrics.sim_steps.inc()
            self.metrics.sim_step_lag.inc(max(0.0, loop.time() - deadline))
            self._after_step(plan)
            self._counts = QueueCounts(len(self.scheduler.running), *unadmitted)

    def _after_schedule(self, plan: StepPlan) -> None:
        now = time.monotonic()
        for seq in plan.admitted:
            request = self._requests.get(seq)
            if request is not None and request.scheduled is None:
                request.scheduled = now
                self.metrics.request_queue_time.observe(now - request.arrival)
        for seq in plan.new_pulls:
            request = self._requests.get(seq)
            if request is not None:
                self._start_pull(request)
        if plan.preempted:
            self.metrics.num_preemptions.inc(len(plan.preempted))

    def _after_step(self, plan: StepPlan) -> None:
        result = self.scheduler.complete(plan)
        self.publish_kv_events()
        now = time.monotonic()
        for seq in result.prefill_done:
            request = self._requests.get(seq)
            if request is not None and not request.prompt_counted:
                request.prompt_counted = True
                self._count_prompt(seq)
        for seq, token in result.tokens:
            request = self._requests.get(seq)
            if request is None:
                continue
            if request.first_token is None:
                request.first_token = now
                self.metrics.time_to_first_token.observe(now - request.arrival)
            elif request.last_token is not None:
                self.metrics.inter_token_latency.observe(now - request.last_token)
            request.last_token = now
            self.metrics.generation_tokens.inc()
            request.events.put_nowait(TokenEvent(token))
        for seq in result.finished:
            request = self._requests.pop(seq, None)
            if request is None:
                continue
            self._observe_finished(request, now)
            params = self._hold(request) if seq.remote_decode else None
            request.events.put_nowait(DoneEvent(params))
        if self.config.lora is not None:
            self._report_loras()

    def _report_loras(self) -> None:
        """vLLM's vllm:lora_requests_info after each step: the adapters of the requests in the engine.
        vLLM (0.32, LoRARequestStates) keys both label lists by every adapter with a waiting or a
        running request, so both name the same adapters; the simulator does the same."""
        names = dict.fromkeys(seq.lora_name for seq in self._requests if seq.lora is not None)
        self.metrics.report_loras([name for name in names if name])

    def set_kv_event_sink(self, sink: KVEventSink) -> None:
        self._kv_events = sink

    def publish_kv_events(self) -> None:
        """Hand the KV events recorded since the last call to the sink, as one batch."""
        if self._kv_events is None:
            return
        events = self.scheduler.pool.take_events()
        if events:
            self._kv_events(KVEventBatch(ts=time.time(), events=events))

    def reset_prefix_cache(self) -> bool:
        """vLLM's reset_prefix_cache: forget all cached blocks; False while any block is in use.

        The ``AllBlocksCleared`` event goes out at once: an idle engine runs no step to carry it.
        """
        reset = self.scheduler.pool.reset_prefix_cache()
        self.publish_kv_events()
        return reset

    def _count_prompt(self, seq: Sequence) -> None:
        prompt = seq.num_prompt_tokens
        self.metrics.prompt_tokens.inc(prompt)
        if seq.kv_pulled:
            self.metrics.prompt_tokens_by_source["external_kv_transfer"].inc(prompt)
            return
        self.metrics.prefix_cache_queries.inc(prompt)
        self.metrics.prefix_cache_hits.inc(seq.num_cached_tokens)
        self.metrics.prompt_tokens_by_source["local_cache_hit"].inc(seq.num_cached_tokens)
        self.metrics.prompt_tokens_by_source["local_compute"].inc(prompt - seq.num_cached_tokens)

    def _observe_finished(self, request: EngineRequest, now: float) -> None:
        self.metrics.request_success_length.inc()
        self.metrics.e2e_request_latency.observe(now - request.arrival)
        first_token = request.first_token or now
        self.metrics.request_prefill_time.observe(first_token - (request.scheduled or request.arrival))
        self.metrics.request_decode_time.observe(now - first_token)
        generated = len(request.seq.output)
        self.metrics.request_time_per_output_token.observe(
            (now - first_token) / (generated - 1) if generated > 1 else 0.0
        )
        self.metrics.request_inference_time.observe(now - (request.scheduled or request.arrival))
        self.metrics.request_prompt_tokens.observe(request.seq.num_prompt_tokens)
        self.metrics.request_generation_tokens.observe(len(request.seq.output))

    def phase_of(self, request: EngineRequest) -> Phase:
        return request.seq.phase
