"""Engine simulator: a cheap stand-in for a vLLM worker that speaks the HTTP API splitserve uses.

Stable API (other parts of splitserve and their tests build on it):

Python
    from splitserve.sim import SimConfig, SimWorker, SimFleet, Role

    config = SimConfig.from_profile("cpu-tiny", role=Role.DECODE, time_scale=0.1)   # port 0 = any
    async with SimWorker(config) as worker:
        worker.url            # "http://127.0.0.1:PORT"; OpenAI clients use worker.url + "/v1"
        worker.engine_id      # advertised as kv_transfer_params.remote_engine_id
        worker.faults.status = 500      # same as POST /admin/faults {"status": 500}
        worker.metrics_text() # the /metrics exposition
        worker.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")  # one sample
        await worker.drain()  # 503 for new requests, finish in-flight ones, stop
    async with SimFleet.replicas(config, 16) as fleet:   # or SimFleet([cfg1, cfg2, ...])
        fleet.urls / fleet.workers

    Config: ``SimConfig`` (frozen dataclass) with ``role``, ``host``, ``port``, ``model``,
    ``latency: LatencyModel``, ``limits: EngineLimits``, ``time_scale``, ``kv_hold_timeout_s``,
    ``side_channel_port``, ``advertise_host``, ``engine_id``, ``faults: FaultConfig``, ``seed``,
    ``drain_timeout_s``, ``kv_load_failure_policy`` (fail | recompute), ``kv_events:
    KVEventsConfig | None`` (vLLM's --kv-events-config, see "KV-cache events"), ``generation`` (the
    KV generation it stands for, "" unknown: see "KV generations"), ``lora: LoRAConfig | None``
    (vLLM's --enable-lora and its limits, see "LoRA adapters"). ``PROFILES`` (in
    ``config.py``) is the calibration table of profiles ``cpu-tiny`` and ``gpu-h100-8b``;
    ``SimConfig.from_profile(name, **overrides)`` starts from one.
    ``tokens.generate_text(tokenize(prompt), n, generation, lora_name)`` gives the exact text a sim answers
    for a prompt (``lora_name``: the adapter the request names, None for the base model).

CLI
    splitserve sim-worker --role prefill|decode|aggregated --port N [--host H] [--model NAME]
        [--profile cpu-tiny|gpu-h100-8b] [--time-scale X] [--count N]
        [--prefill-overhead-s S] [--prefill-per-token-s S] [--decode-base-s S] [--decode-per-seq-s S]
        [--kv-transfer-overhead-s S] [--kv-transfer-per-block-s S] [--block-size N] [--num-kv-blocks N]
        [--max-num-seqs N] [--max-num-batched-tokens N] [--max-model-len N] [--no-prefix-caching]
        [--kv-hold-timeout-s S] [--side-channel-port P] [--advertise-host H] [--engine-id ID]
        [--kv-load-failure-policy fail|recompute] [--kv-events-config JSON]
        [--fail-rate P] [--fail-after-tokens N] [--fail-status CODE] [--seed N] [--drain-timeout-s S]
        [--generation G] [--enable-lora [--max-loras N] [--max-lora-rank R] [--max-cpu-loras C]
        [--lora-modules NAME=PATH ...] [--adapters-file PATH]]
    Prints one JSON line per worker when it listens: {"event": "ready", "role", "url", "engine_id", "generation"}.
    SIGTERM/SIGINT: drain (new requests get 503, /health 503), then exit 0 (1 if the drain timed out).

HTTP endpoints
    POST /v1/completions, /v1/chat/completions   OpenAI shapes, streaming (SSE + ``data: [DONE]``,
        ``stream_options.include_usage``) or not; ``usage`` with ``prompt_tokens_details.cached_tokens``;
        top-level ``kv_transfer_params`` (null unless this worker holds KV for a remote decode).
    GET /v1/models (the base model, then each LoRA adapter with ``parent`` and ``root``: its path),
    GET /health, GET /metrics (vLLM metric names, labels model_name and engine="0";
        plus splitserve_sim_steps_total and splitserve_sim_step_lag_seconds_total, the time steps
        ended later than modelled because the process was short of CPU: check it in benchmarks),
    POST /tokenize {"prompt"| "messages"} -> {"count", "max_model_len", "tokens"}.
    GET /version -> {"version", "generation"}, GET /load -> {"server_load": requests in flight}.
    POST /admin/faults {"status": 500|null, "kv_status": 500|null, "fail_rate": p,
        "fail_after_tokens": n|null, "clear": true} changes injected faults live (kv_status: only
        requests carrying KV from a prefill, answered with a bare 500 as vLLM's failed handshake);
        GET /admin/faults shows them.
    POST /internal/kv/pull  the KV side channel (prefill side), see below.
    GET /kv_event_sources -> {"0": <the KV events config, endpoints as bound>}, {} when events are off.
    POST /reset_prefix_cache -> {"success": bool} (vLLM's dev endpoint; false while KV is in use).
    Errors: {"error": {"message", "type", "param", "code"}} with 400 (bad JSON, missing/invalid
    fields, too long), 404 (a model neither served nor a loaded adapter: vLLM's "The model `m` does not
    exist. Valid aliases: BASE." with param "model"), 500 (KV transfer failed, injected), 503 (draining).
    With --enable-lora: POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace"?} and
    POST /v1/unload_lora_adapter {"lora_name"}, answered as vLLM answers them (see lora.py).

P/D handshake (vLLM NixlConnector protocol). Prefill and decode workers have a KV connector;
aggregated workers ignore ``kv_transfer_params`` like vLLM without a connector.
    1. Prefill request: ``kv_transfer_params = {"do_remote_decode": true, "do_remote_prefill": false,
       remote_* = null}``, max_tokens=1. The prefill worker computes the prompt, keeps its KV blocks
       (they count against its capacity) and answers ``kv_transfer_params = {"do_remote_prefill": true,
       "do_remote_decode": false, "remote_engine_id", "remote_block_ids", "remote_host", "remote_port",
       "tp_size": 1, "request_id"}``. Held blocks expire after ``kv_hold_timeout_s``
       (``vllm:nixl_num_kv_expired_reqs_total`` rises).
    2. Decode request: the same prompt with those params. Once its batch has a free slot (fewer
       than ``max_num_seqs`` running: like vLLM it starts no KV load while the batch is full, so a
       saturated decode leaves the KV held on prefill), the decode worker reserves blocks, pulls
       the KV with ``POST http://remote_host:remote_port/internal/kv/pull`` {"engine_id", "generation",
       "block_ids", "request_id", "prompt_digest", "transfer_seconds"} (the prefill side waits out the transfer time,
       then frees the blocks), then decodes. Its text equals an aggregated worker's for that prompt.
       Unknown engine, unknown/expired blocks, another prompt or an unreachable peer: HTTP 500 whose
       message starts "KV transfer failed", and ``vllm:nixl_num_failed_transfers_total`` rises
       (with ``kv_load_failure_policy=recompute`` the decode worker prefills locally instead and
       answers normally; the counter still rises). Malformed params: HTTP 400. The prefill side counts
       each pull it refuses in ``splitserve_sim_kv_pulls_refused_total{reason}`` (generation,
       unknown_engine, unknown_blocks, other_request, other_adapter, other_prompt). KV computed for one
       LoRA adapter (or the base model) is refused to a decode request for another: real NIXL would
       hand it over and the decode would answer wrong text that looks fine.

KV generations. ``--generation G`` says which model revision + engine image the worker stands for.
Its output text is seeded by it (tokens.generation_seed; "" leaves the text as without it), and a
prefill worker refuses a pull from a decode worker of another generation before looking at any
block, as NIXL's handshake refuses an incompatible peer: the decode answers HTTP 500 "KV transfer
failed ... incompatible peer" (what the router treats as a failed transfer), the held KV stays
until a matching pull or its expiry.

KV-cache events (vLLM's ZmqEventPublisher, byte for byte). ``--kv-events-config '{"enable_kv_cache_events":
true, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": null, "topic": "kv"}'`` (vLLM's
keys and defaults; ``tcp://*:0`` binds a free port on the advertised host, read it from
/kv_event_sources or ``SimWorker.kv_event_sources()``; with ``--count N`` worker i's ports are offset by
i like DP ranks) binds a PUB socket sending ``[topic, seq (8 bytes big-endian, from 0), msgpack
[ts, [event...], 0]]`` once per engine step with events, and an optional ROUTER replay socket (send a
start seq, get the buffered batches then seq -1; the last ``buffer_steps`` are kept). Events, as
vLLM's block pool emits them: ``BlockStored`` when full blocks (prompt or generated) of a request
enter the prefix cache, one event per run of blocks, with ``parent_block_hash`` (None for a
sequence's first block), their ``token_ids`` (the ids the sim tokenizes and hashes; generated
tokens are the sim's output token ids), ``block_size``, ``medium`` "GPU", ``group_idx`` 0; pulled
KV is stored when the pull completes. ``BlockRemoved`` (one hash each) when a cached block is
evicted for reuse. ``AllBlocksCleared`` on /reset_prefix_cache. Block hashes are unsigned 64-bit
chains over the token ids (``tokens.block_hashes``).

LoRA adapters (``--enable-lora``, lora.py). Adapters come from ``--lora-modules`` at start, the runtime
API, or ``--adapters-file`` (the adapter sync of ``splitserve.engine.adapters`` drives that API as the
file changes). An adapter is a folder with a peft ``adapter_config.json`` (only its rank is read). A
request for an adapter answers other text than the base model's (the name seeds it, tokens.py), its
blocks hash with the adapter as vLLM's extra key ``("lora", name, path)`` (prefix hits only under the
same adapter) and its ``BlockStored`` events carry ``lora_id``, ``lora_name`` and ``extra_keys``
(``[name]`` per block). A batch holds at most ``max_loras`` adapters (others wait), and
``vllm:lora_requests_info{max_lora, waiting_lora_adapters, running_lora_adapters}`` is set to the time
after each step, as vLLM reports it (both lists name every adapter with a request in the engine).

Model of the engine: one asyncio step loop per worker does continuous batching (see scheduler.py):
each step decodes one token for every running sequence and prefills prompt chunks within
``max_num_batched_tokens``; a step lasts ``LatencyModel.step_seconds(...) * time_scale``. Requests
wait (``vllm:num_requests_waiting``) while KV blocks or batch slots are short; a block-hash LRU prefix
cache cuts prefill for shared prompt prefixes. Tokenization and output text: see tokens.py
(words and punctuation marks are tokens; output tokens are pseudo words hashed from prompt + position).
"""

from splitserve.sim.config import (
    PROFILES,
    EngineLimits,
    FaultConfig,
    KVEventsConfig,
    KVLoadFailurePolicy,
    LatencyModel,
    LoRAConfig,
    Profile,
    Role,
    SimConfig,
)
from splitserve.sim.server import FaultState, SimFleet, SimWorker, run_event_loop, serve
from splitserve.sim.tokens import chat_prompt, generate_text, tokenize

__all__ = [
    "PROFILES",
    "EngineLimits",
    "FaultConfig",
    "FaultState",
    "KVEventsConfig",
    "KVLoadFailurePolicy",
    "LatencyModel",
    "LoRAConfig",
    "Profile",
    "Role",
    "SimConfig",
    "SimFleet",
    "SimWorker",
    "chat_prompt",
    "generate_text",
    "run_event_loop",
    "serve",
    "tokenize",
]
