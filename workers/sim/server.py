"""The HTTP face of a simulated engine (aiohttp) and helpers to run one or many in an event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import signal
import time
import uuid
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import TypeVar

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from splitserve.router.tokens import HuggingFaceTokenizer
from splitserve.sim.config import FaultConfig, Role, SimConfig
from splitserve.sim.engine import (
    EngineRequest,
    ErrorEvent,
    KVTransferError,
    PullRequest,
    RemotePrefill,
    SimEngine,
    TokenEvent,
)
from splitserve.sim.kv_publisher import ZmqEventPublisher
from splitserve.sim.lora import LoRARegistry
from splitserve.sim.protocol import (
    SSE_DONE,
    GenerationRequest,
    RequestError,
    ResponseShape,
    error_body,
    model_not_found,
    parse_generation,
    parse_json_object,
    prompt_tokens_of,
    sse,
    usage,
)
from splitserve.sim.scheduler import Sequence
from splitserve.sim.tokens import output_text

log = logging.getLogger(__name__)
T = TypeVar("T")
SIM_VERSION = "0.1.0+splitserve-sim"


@dataclass
class FaultState:
    """Faults in force now; starts from the config and changes through POST /admin/faults."""

    fail_rate: float = 0.0
    fail_after_tokens: int | None = None
    status: int | None = None
    # Decode requests carrying KV from a prefill are answered with this status and vLLM's bare
    # "Internal server error" (what vLLM answers when a NIXL handshake times out); others are served.
    kv_status: int | None = None

    @classmethod
    def from_config(cls, config: FaultConfig) -> FaultState:
        return cls(config.fail_rate, config.fail_after_tokens, config.status)

    def update(self, body: dict[str, object]) -> None:
        """Apply the keys present in ``body``; ``{"clear": true}`` resets everything first."""
        if body.get("clear"):
            self.fail_rate, self.fail_after_tokens, self.status, self.kv_status = 0.0, None, None, None
        for key in ("status", "kv_status"):
            if key in body:
                status = body[key]
                if status is not None and (not isinstance(status, int) or not 100 <= status <= 599):
                    raise RequestError(400, f"'{key}' must be an HTTP status code or null")
                setattr(self, key, status)
        if "fail_rate" in body:
            rate = body["fail_rate"]
            if not isinstance(rate, int | float) or not 0 <= rate <= 1:
                raise RequestError(400, "'fail_rate' must be a number between 0 and 1")
            self.fail_rate = float(rate)
        if "fail_after_tokens" in body:
            after = body["fail_after_tokens"]
            if after is not None and (not isinstance(after, int) or after < 0):
                raise RequestError(400, "'fail_after_tokens' must be a non-negative integer or null")
            self.fail_after_tokens = after


def json_error(status: int, message: str, err_type: str | None = None, param: str | None = None) -> web.Response:
    return web.json_response(error_body(status, message, err_type, param), status=status)


def request_error(error: RequestError) -> web.Response:
    return json_error(error.status, error.message, error.err_type, error.param)


def _as_bind(endpoint: str | None) -> str | None:
    if endpoint is None or not endpoint.startswith("tcp://") or "*" in endpoint:
        return endpoint
    return "tcp://*:" + endpoint.rsplit(":", 1)[1]


class SimWorker:
    """One simulated vLLM engine serving HTTP. Use as ``async with SimWorker(config) as worker``."""

    def __init__(self, config: SimConfig | None = None) -> None:
        self.config = config or SimConfig()
        problems = self.config.problems()
        if problems:
            raise ValueError("invalid simulator config: " + "; ".join(problems))
        self.engine_id = self.config.engine_id or str(uuid.uuid4())
        self.faults = FaultState.from_config(self.config.faults)
        # The model's real tokenizer, when given: prompts then become the token ids vLLM would compute.
        self.tokenizer = HuggingFaceTokenizer(self.config.tokenizer) if self.config.tokenizer else None
        # --enable-lora: the adapters served besides the base model; --lora-modules are loaded now, and a
        # failure stops the start, as in vLLM.
        self.loras: LoRARegistry | None = None
        if self.config.lora is not None:
            self.loras = LoRARegistry(self.config.model, self.config.lora.max_lora_rank)
            for name, path in self.config.lora.modules:
                try:
                    self.loras.load(name, path)
                except RequestError as error:
                    raise ValueError(f"--lora-modules {name}={path}: {error.message}") from error
        self.draining = False
        self.port = self.config.port
        self.engine: SimEngine | None = None
        self._random = random.Random(self.config.seed)
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self.kv_events: ZmqEventPublisher | None = None
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    # --- lifecycle ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:8100`` (append ``/v1`` for OpenAI clients)."""
        return f"http://{self.config.advertised_host}:{self.port}"

    @property
    def role(self) -> Role:
        return self.config.role

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.stop()  # nothing half-started stays behind (sockets, the publisher thread)
            raise

    async def _start(self) -> None:
        kv_events = self.config.kv_events
        if kv_events is not None and kv_events.publishes:
            # Bound before the HTTP port, as vLLM's engine core binds it before the API server listens.
            self.kv_events = ZmqEventPublisher(kv_events, host=self.config.advertised_host)
        sink = self.kv_events.publish if self.kv_events is not None else None
        self.engine = SimEngine(self.config, self.engine_id, self._pull_remote_kv, sink)
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.add_routes(
            [
                web.post("/v1/completions", self._completions),
                web.post("/v1/chat/completions", self._chat_completions),
                web.get("/v1/models", self._models),
                web.get("/health", self._health),
                web.get("/version", self._version),
                web.get("/load", self._load),
                web.get("/metrics", self._metrics),
                web.post("/tokenize", self._tokenize),
                web.post("/detokenize", self._detokenize),
                web.get("/kv_event_sources", self._kv_event_sources),
                web.post("/reset_prefix_cache", self._reset_prefix_cache),
                web.post("/internal/kv/pull", self._kv_pull),
                web.get("/admin/faults", self._get_faults),
                web.post("/admin/faults", self._set_faults),
            ]
        )
        if self.loras is not None:
            # vLLM serves these with VLLM_ALLOW_RUNTIME_LORA_UPDATING; the simulator whenever LoRA is on.
            app.add_routes(
                [
                    web.post("/v1/load_lora_adapter", self._load_lora_adapter),
                    web.post("/v1/unload_lora_adapter", self._unload_lora_adapter),
                ]
            )
        # handler_cancellation: a client that disconnects aborts its request, as in vLLM.
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=2.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port, reuse_address=True)
        await site.start()
        self.port = _bound_port(site)
        side_port = self.port
        if self.config.side_channel_port is not None:
            side_site = web.TCPSite(self._runner, self.config.host, self.config.side_channel_port)
            await side_site.start()
            side_port = _bound_port(side_site)
        self.engine.side_channel_port = side_port
        self.engine.start()

    async def stop(self) -> None:
        """Stop at once: in-flight requests are cut off."""
        if self.engine is not None:
            await self.engine.stop()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self.kv_events is not None:
            # After the engine stopped, so nothing publishes into a closed publisher.
            await asyncio.to_thread(self.kv_events.shutdown)
            self.kv_events = None

    # --- fault injection: the KV-event publisher alone goes away and comes back ------------------

    async def close_kv_events(self) -> None:
        """Close the publisher's port while the engine keeps serving (its events are dropped meanwhile)."""
        if self.kv_events is not None and self.engine is not None:
            self.engine.set_kv_event_sink(lambda batch: None)
            await asyncio.to_thread(self.kv_events.shutdown)

    def reopen_kv_events(self) -> None:
        """Bind a new publisher on the same endpoint; like a restarted engine's, its sequence starts at 0."""
        if self.kv_events is not None and self.engine is not None:
            # The same ports again: a tcp://*:0 publisher reports the address it bound, which must be bound anew.
            config = self.kv_events.config
            endpoint = _as_bind(config.endpoint) or config.endpoint
            again = dataclasses.replace(config, endpoint=endpoint, replay_endpoint=_as_bind(config.replay_endpoint))
            self.kv_events = ZmqEventPublisher(again, host=self.config.advertised_host)
            self.engine.set_kv_event_sink(self.kv_events.publish)

    async def _drained(self) -> None:
        """No request in flight and, on a prefill worker, no KV still held for a decode pull."""
        while True:
            await self._idle.wait()
            if self.engine is None or self.engine.num_held == 0:
                return
            await asyncio.sleep(0.02)

    async def drain(self, grace_s: float | None = None) -> bool:
        """Refuse new work (503), wait for in-flight requests, then stop. False if the wait timed out."""
        self.draining = True
        try:
            await asyncio.wait_for(self._drained(), grace_s if grace_s is not None else self.config.drain_timeout_s)
            finished = True
        except TimeoutError:
            finished = False
        await self.stop()
        return finished

    async def __aenter__(self) -> SimWorker:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    def metrics_text(self) -> str:
        return self._engine().metrics.exposition().decode()

    def metric(self, name: str, **labels: str) -> float:
        """Current value of one sample, e.g. ``metric("vllm:num_requests_waiting")`` or
        ``metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")``."""
        all_labels = {"model_name": self.config.model, "engine": "0", **labels}
        value = self._engine().metrics.registry.get_sample_value(name, all_labels)
        if value is None:
            raise KeyError(f"no sample {name}{labels}")
        return value

    def kv_event_sources(self) -> dict[str, dict[str, object]]:
        """What GET /kv_event_sources answers: as vLLM, the running publisher's config (endpoints as
        bound) keyed by data-parallel rank, always "0" here; ``{}`` when no events are published."""
        return {} if self.kv_events is None else {"0": self.kv_events.config.to_dict()}

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def _engine(self) -> SimEngine:
        if self.engine is None:
            raise RuntimeError("the worker is not started")
        return self.engine

    # --- generation ----------------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        if self.draining:
            return json_error(503, "The server is shutting down and does not accept new requests.")
        if self.faults.status is not None:
            return json_error(self.faults.status, f"injected fault: status {self.faults.status}")
        if self.faults.fail_rate and self._random.random() < self.faults.fail_rate:
            return json_error(500, "injected fault: random failure")
        try:
            parsed = parse_generation(
                parse_json_object(await request.read()),
                chat,
                self.config.model,
                self.config.limits,
                self.tokenizer,
                adapters=self.loras if self.loras is not None else (),
            )
            engine_request = self._engine_request(request, parsed)
        except RequestError as error:
            return request_error(error)
        remote = parsed.kv_transfer_params or {}
        if self.faults.kv_status is not None and remote.get("remote_engine_id"):
            return json_error(self.faults.kv_status, "Internal server error")
        self._in_flight += 1
        self._idle.clear()
        engine = self._engine()
        engine.submit(engine_request)
        try:
            if parsed.stream:
                return await self._stream(request, parsed, engine_request)
            return await self._complete(request, parsed, engine_request)
        finally:
            engine.abort(engine_request)
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()

    def _engine_request(self, request: web.Request, parsed: GenerationRequest) -> EngineRequest:
        request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        params = parsed.kv_transfer_params or {}
        has_connector = self.config.role is not Role.AGGREGATED  # aggregated engines ignore kv_transfer_params
        remote_prefill = None
        if has_connector and params.get("do_remote_prefill"):
            try:
                remote_prefill = RemotePrefill.parse(params)
            except ValueError as error:
                raise RequestError(400, f"invalid kv_transfer_params: {error}") from error
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=parsed.prompt_token_ids,
            max_tokens=parsed.max_tokens,
            remote_prefill=remote_prefill is not None,
            remote_decode=has_connector and bool(params.get("do_remote_decode")),
            generation=self.config.generation,
            lora=self.loras.get(parsed.model) if self.loras is not None else None,
        )
        return EngineRequest(seq=seq, remote_prefill=remote_prefill)

    def _drop_connection(self, request: web.Request) -> None:
        if request.transport is not None:
            request.transport.close()

    async def _complete(
        self, request: web.Request, parsed: GenerationRequest, engine_request: EngineRequest
    ) -> web.StreamResponse:
        pieces: list[str] = []
        while True:
            event = await engine_request.events.get()
            if isinstance(event, ErrorEvent):
                return json_error(event.status, event.message)
            if isinstance(event, TokenEvent):
                pieces.append(output_text(event.token_id))
                if self.faults.fail_after_tokens is not None and len(pieces) >= self.faults.fail_after_tokens:
                    self._drop_connection(request)
                    return web.Response(status=500)
                continue
            shape = ResponseShape.for_request(parsed.chat, engine_request.seq.request_id, parsed.model)
            seq = engine_request.seq
            body = shape.full(
                "".join(pieces),
                usage(seq.num_prompt_tokens, len(pieces), seq.num_cached_tokens),
                event.kv_transfer_params,
            )
            return web.json_response(body)

    async def _stream(
        self, request: web.Request, parsed: GenerationRequest, engine_request: EngineRequest
    ) -> web.StreamResponse:
        # Wait for the first event before sending headers, so early failures (a failed KV pull)
        # still reach the client as a proper HTTP error status.
        event = await engine_request.events.get()
        if isinstance(event, ErrorEvent):
            return json_error(event.status, event.message)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        shape = ResponseShape.for_request(parsed.chat, engine_request.seq.request_id, parsed.model)
        seq = engine_request.seq
        if parsed.chat:
            await response.write(sse(shape.chunk("", None, parsed.include_usage, role=True)))
        sent = 0
        pending: str | None = None  # held back one token so the last one carries finish_reason
        finished = False
        while not finished:
            # Everything already queued goes out in one write: under load a handler can fall
            # several tokens behind the engine, and one write per token would fall further behind.
            out: list[bytes] = []
            while True:
                if isinstance(event, ErrorEvent):
                    # Headers are gone; vLLM reports mid-stream errors as an error event in the stream.
                    out.append(sse(error_body(event.status, event.message)))
                    finished = True
                elif isinstance(event, TokenEvent):
                    if pending is not None:
                        out.append(sse(shape.chunk(pending, None, parsed.include_usage)))
                    pending = output_text(event.token_id)
                    sent += 1
                    if self.faults.fail_after_tokens is not None and sent > self.faults.fail_after_tokens:
                        await response.write(b"".join(out))
                        self._drop_connection(request)
                        return response
                else:
                    params = event.kv_transfer_params
                    out.append(sse(shape.chunk(pending or "", "length", parsed.include_usage, kv_params=params)))
                    if parsed.include_usage:
                        out.append(sse(shape.usage_chunk(usage(seq.num_prompt_tokens, sent, seq.num_cached_tokens))))
                    finished = True
                if finished or engine_request.events.empty():
                    break
                event = engine_request.events.get_nowait()
            if out:
                await response.write(b"".join(out))
            if not finished:
                event = await engine_request.events.get()
        await response.write(SSE_DONE)
        await response.write_eof()
        return response

    # --- KV side channel --------------------------------------------------------------------------

    async def _pull_remote_kv(self, remote: RemotePrefill, pull: PullRequest) -> None:
        """Decode side: fetch KV blocks from the prefill engine named in kv_transfer_params."""
        if self._session is None:
            self._session = aiohttp.ClientSession()
        url = f"http://{remote.host}:{remote.port}/internal/kv/pull"
        try:
            timeout = aiohttp.ClientTimeout(total=pull.transfer_seconds + 30.0)
            async with self._session.post(url, json=pull.to_json(), timeout=timeout) as reply:
                if reply.status == 200:
                    return
                try:
                    body = await reply.json(content_type=None)
                    message = str(body["error"]["message"])
                except (ValueError, KeyError, TypeError, aiohttp.ClientError):
                    message = f"HTTP {reply.status}"
                raise KVTransferError(message)
        except (aiohttp.ClientError, TimeoutError) as error:
            raise KVTransferError(f"cannot reach KV side channel {remote.host}:{remote.port}: {error!r}") from error

    async def _kv_pull(self, request: web.Request) -> web.Response:
        """Prefill side: serve a decode engine's pull of held KV blocks."""
        try:
            body = parse_json_object(await request.read())
            pull = PullRequest(
                engine_id=str(body["engine_id"]),
                block_ids=[int(b) for b in body["block_ids"]],  # type: ignore[attr-defined]
                request_id=None if body.get("request_id") is None else str(body["request_id"]),
                prompt_digest=str(body["prompt_digest"]),
                transfer_seconds=float(body.get("transfer_seconds", 0.0)),  # type: ignore[arg-type]
                generation=str(body.get("generation") or ""),
                lora_name=None if body.get("lora_name") is None else str(body["lora_name"]),
            )
        except RequestError as error:
            return request_error(error)
        except (KeyError, TypeError, ValueError) as error:
            return json_error(400, f"malformed KV pull request: {error!r}")
        try:
            num_blocks = await self._engine().serve_pull(pull)
        except KVTransferError as error:
            return json_error(404, str(error))
        return web.json_response({"engine_id": self.engine_id, "num_blocks": num_blocks})

    # --- other endpoints ------------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        model = {
            "id": self.config.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "vllm",
            "root": self.config.model,
            "parent": None,
            "max_model_len": self.config.limits.max_model_len,
            "permission": [],
        }
        # vLLM's adapter cards: root is the path it was loaded from, parent the base model.
        adapters = [
            {
                "id": lora.name,
                "object": "model",
                "created": model["created"],
                "owned_by": "vllm",
                "root": lora.path,
                "parent": self.config.model,
                "max_model_len": None,
                "permission": [],
            }
            for lora in (self.loras.adapters if self.loras is not None else [])
        ]
        return web.json_response({"object": "list", "data": [model, *adapters]})

    async def _load_lora_adapter(self, request: web.Request) -> web.Response:
        assert self.loras is not None
        try:
            body = parse_json_object(await request.read())
            message = self.loras.load(body.get("lora_name"), body.get("lora_path"), bool(body.get("load_inplace")))
        except RequestError as error:
            return request_error(error)
        log.info("Loaded new LoRA adapter: name %r, path %r", body.get("lora_name"), body.get("lora_path"))
        return web.Response(text=message)

    async def _unload_lora_adapter(self, request: web.Request) -> web.Response:
        assert self.loras is not None
        try:
            message = self.loras.unload(parse_json_object(await request.read()).get("lora_name"))
        except RequestError as error:
            return request_error(error)
        return web.Response(text=message)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.draining else 200)

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": SIM_VERSION, "generation": self.config.generation})

    async def _load(self, request: web.Request) -> web.Response:
        # vLLM's --enable-server-load-tracking endpoint: requests the HTTP server is working on.
        return web.json_response({"server_load": self._in_flight})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self._engine().metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _tokenize(self, request: web.Request) -> web.Response:
        try:
            body = parse_json_object(await request.read())
            model = body.get("model") or self.config.model
            if model != self.config.model and (self.loras is None or model not in self.loras):
                raise model_not_found(model, self.config.model)
            tokens = prompt_tokens_of(body, chat="messages" in body, tokenizer=self.tokenizer)
        except RequestError as error:
            return request_error(error)
        return web.json_response(
            {"count": len(tokens), "max_model_len": self.config.limits.max_model_len, "tokens": tokens}
        )

    async def _detokenize(self, request: web.Request) -> web.Response:
        try:
            body = parse_json_object(await request.read())
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                raise RequestError(400, "'tokens' must be a list of token ids")
            if self.tokenizer is None:
                raise RequestError(400, "this simulator has no --tokenizer: its stand-in tokens cannot be decoded")
        except RequestError as error:
            return request_error(error)
        return web.json_response({"prompt": self.tokenizer.decode(tokens)})

    async def _kv_event_sources(self, request: web.Request) -> web.Response:
        return web.json_response(self.kv_event_sources())

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        # vLLM's dev-mode endpoint; fails (success false) while any request holds KV blocks.
        return web.json_response({"success": self._engine().reset_prefix_cache()})

    async def _get_faults(self, request: web.Request) -> web.Response:
        return web.json_response(dataclasses.asdict(self.faults))

    async def _set_faults(self, request: web.Request) -> web.Response:
        try:
            self.faults.update(parse_json_object(await request.read()))
        except RequestError as error:
            return request_error(error)
        return web.json_response(dataclasses.asdict(self.faults))


def _bound_port(site: web.TCPSite) -> int:
    server = site._server  # aiohttp exposes no public accessor for the bound socket
    sockets = getattr(server, "sockets", None)
    if not sockets:
        raise RuntimeError("the HTTP site has no listening socket")
    return int(sockets[0].getsockname()[1])


class SimFleet:
    """Many simulated workers in one event loop (cheap: one engine task + one HTTP site each)."""

    def __init__(self, configs: Iterable[SimConfig]) -> None:
        self.workers = [SimWorker(config) for config in configs]

    @classmethod
    def replicas(cls, config: SimConfig, count: int) -> SimFleet:
        """``count`` copies of ``config``; with fixed ports, replica ``i`` listens on port + i."""

        def shifted(port: int | None, i: int) -> int | None:
            return port + i if port else port

        return cls(
            dataclasses.replace(
                config,
                port=shifted(config.port, i) or 0,
                side_channel_port=shifted(config.side_channel_port, i),
                kv_events=config.kv_events.shifted(i) if config.kv_events is not None else None,
                engine_id=None,
            )
            for i in range(count)
        )

    @property
    def urls(self) -> list[str]:
        return [worker.url for worker in self.workers]

    async def start(self) -> None:
        try:
            for worker in self.workers:
                await worker.start()
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        await asyncio.gather(*(worker.stop() for worker in self.workers))

    async def drain(self, grace_s: float | None = None) -> bool:
        results = await asyncio.gather(*(worker.drain(grace_s) for worker in self.workers))
        return all(results)

    async def __aenter__(self) -> SimFleet:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()


async def serve(
    configs: Iterable[SimConfig],
    announce: Callable[[SimWorker], None] | None = None,
    adapters_file: str | None = None,
) -> bool:
    """Run workers until SIGTERM or SIGINT, then drain them. Returns whether the drain finished in time.

    With ``adapters_file``, each worker runs the adapter sync beside it (``splitserve.engine.adapters``,
    as `splitserve worker` runs it beside vLLM): its LoRA adapters follow the file at run time.
    """
    fleet = SimFleet(configs)
    await fleet.start()
    for worker in fleet.workers:
        if announce is not None:
            announce(worker)
    stop = asyncio.Event()
    syncs: list[asyncio.Task[None]] = []
    if adapters_file is not None:
        from splitserve.engine.adapters import run_adapter_sync  # httpx and the sync: only when asked

        syncs = [
            asyncio.create_task(run_adapter_sync(worker.url, adapters_file, stop_event=stop), name=f"adapters-{i}")
            for i, worker in enumerate(fleet.workers)
        ]
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        for result in await asyncio.gather(*syncs, return_exceptions=True):
            if isinstance(result, BaseException):
                log.error("the adapter sync failed", exc_info=result)
    return await fleet.drain()


def run_event_loop(main: Callable[[], Coroutine[object, object, T]]) -> T:
    """Run ``main`` on uvloop when it is installed (cheaper per connection), else on asyncio."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    return uvloop.run(main())
