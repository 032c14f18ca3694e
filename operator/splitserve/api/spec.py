"""InferenceDeployment spec: the single source of truth for the CRD, the builders and the CLI.

Every default is explicit here and is written into the CRD schema, so `kubectl get -o yaml`
shows the whole intent. Cross-field rules are CEL (`x-kubernetes-validations`) so that a real
API server rejects bad objects at admission; `splitserve validate` evaluates the same rules.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import Field, WithJsonSchema

from splitserve.api.base import ApiModel, cel, cel_rules, immutable

DEFAULT_WORKER_IMAGE = "ghcr.io/splitserve/worker:0.1.0"
DEFAULT_ROUTER_IMAGE = "ghcr.io/splitserve/splitserve:0.1.0"

# Kubernetes resource quantities are "int or string" (cpu: 4 and cpu: "500m" are both valid).
QUANTITY_PATTERN = r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
Quantity = Annotated[
    int | str,
    WithJsonSchema(
        {
            "x-kubernetes-int-or-string": True,
            "anyOf": [{"type": "integer"}, {"type": "string", "pattern": QUANTITY_PATTERN}],
        }
    ),
]
# Opaque Kubernetes objects passed through to pod specs (tolerations, affinity, valueFrom):
# the API server validates them where they land, in the Deployment.
Opaque = Annotated[dict[str, Any], WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True})]
MAX_POOL_REPLICAS = 1000  # a pool's replica fields' upper bound (the schema's `maximum`)
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# What clients may put in the OpenAI `model` field: the served model's name and each adapter's.
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/:-]*$"
MODEL_NAME_MAX_LENGTH = 128
# spec.adapters' bound: keeps the CEL rules over the list (uniqueness) within the API server's cost budget.
MAX_ADAPTERS = 64


class Mode(StrEnum):
    DISAGGREGATED = "disaggregated"
    AGGREGATED = "aggregated"


class Role(StrEnum):
    """What a worker process does. `aggregated` does prefill and decode in one engine."""

    PREFILL = "prefill"
    DECODE = "decode"
    AGGREGATED = "aggregated"


class Connector(StrEnum):
    NIXL = "NixlConnector"
    LMCACHE = "LMCacheConnectorV1"
    MOONCAKE = "MooncakeConnector"
    EXAMPLE = "ExampleConnector"
    NONE = "None"


class RoutingPolicy(StrEnum):
    """How the router picks a worker of a pool (ROUTING_POLICY_HELP says each in words)."""

    ROUND_ROBIN = "round-robin"
    LEAST_LOADED = "least-loaded"
    PREFIX_AWARE = "prefix-aware"
    KV_AWARE = "kv-aware"
    PRECISE_PREFIX = "precise-prefix"


# One sentence per policy, written into the CRD (kubectl explain) where a policy is chosen.
ROUTING_POLICY_HELP = (
    "round-robin: each worker in turn; least-loaded: fewest in-flight requests (power of two choices); "
    "prefix-aware: where the prompt's longest prefix was sent before, unless that worker is overloaded; "
    "kv-aware: lowest KV-cache usage and queue from the workers' metrics; precise-prefix: the worker whose "
    "prefix cache really holds the prompt's longest prefix, learnt from the engines' own KV-cache events "
    "(the operator turns the events on in that pool's workers, on engine.kvEventsPort; it needs "
    "engine.prefixCaching, and a model.source.pvc for the router to tokenize exactly as the engine)."
)


# --------------------------------------------------------------------------- model


class SecretKeyRef(ApiModel):
    # Bounded, as Kubernetes bounds them: CEL rules compare these (spec.adapters' one HF token).
    name: str = Field(
        description="Name of a Secret in the InferenceDeployment's namespace.", min_length=1, max_length=253
    )
    key: str = Field("token", description="Key inside the Secret.", min_length=1, max_length=253)


class HuggingFaceSource(ApiModel):
    repo: str = Field(description="Hugging Face repository, e.g. meta-llama/Llama-3.1-8B-Instruct.", min_length=1)
    revision: str = Field("main", description="Branch, tag or commit of the repository.")
    token_secret_ref: SecretKeyRef | None = Field(None, description="Secret holding an HF token (HF_TOKEN).")


class PvcSource(ApiModel):
    claim_name: str = Field(
        description="PersistentVolumeClaim holding the files (the model's, or an adapter's).", pattern=DNS_LABEL
    )
    path: str = Field("/", description="Directory of the model (or adapter) inside the volume.")


class ModelSource(ApiModel):
    model_config = cel_rules(
        cel(
            "[has(self.huggingFace), has(self.pvc), has(self.uri)].filter(x, x).size() == 1",
            "model.source needs exactly one of huggingFace, pvc or uri",
        )
    )

    hugging_face: HuggingFaceSource | None = Field(None, description="Download from the Hugging Face Hub.")
    pvc: PvcSource | None = Field(None, description="Mount a PersistentVolumeClaim that holds the model.")
    uri: str | None = Field(
        None, description="Any location vLLM accepts as --model (s3://, gs://, a path in the image)."
    )


class ModelSpec(ApiModel):
    name: str = Field(
        description="Served model name: what clients put in the OpenAI `model` field.",
        min_length=1,
        max_length=MODEL_NAME_MAX_LENGTH,
        pattern=MODEL_NAME_PATTERN,
        json_schema_extra=immutable(
            "model.name is immutable: clients and dashboards key on it; create a new InferenceDeployment"
        ),
    )
    source: ModelSource
    dtype: Literal["auto", "float16", "bfloat16", "float32"] = Field("auto", description="Weight/activation dtype.")
    quantization: Literal["none", "fp8", "int8", "awq", "gptq"] = Field(
        "none", description="Weight quantization; fp8/int8 halve weight memory compared with 16-bit."
    )
    max_model_len: int | None = Field(None, ge=16, le=10_000_000, description="Max context length (tokens).")
    parameter_count: int | None = Field(
        None,
        ge=1,
        description="Declared parameter count (e.g. 70000000000) for when the model's config cannot be read.",
    )


# --------------------------------------------------------------------------- engine


class EnvVar(ApiModel):
    name: str = Field(min_length=1, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
    value: str | None = None
    value_from: Opaque | None = Field(None, description="As in a container's env[].valueFrom.")


class SpeculativeDecoding(ApiModel):
    model_config = cel_rules(
        cel(
            "self.method != 'draft' || (has(self.draftModel) && size(self.draftModel) > 0)",
            "speculativeDecoding.method 'draft' needs speculativeDecoding.draftModel",
        )
    )

    method: Literal["off", "ngram", "draft"] = Field("off", description="off, ngram prompt lookup, or a draft model.")
    num_speculative_tokens: int = Field(3, ge=1, le=16, description="Tokens proposed per step (k).")
    draft_model: str | None = Field(None, description="Draft model (HF repo or path) when method is draft.")
    ngram_prompt_lookup_max: int = Field(4, ge=1, le=16, description="Longest n-gram matched for ngram.")


class EngineWaits(ApiModel):
    mode: Literal["Auto", "Spin", "Events"] = Field(
        "Auto",
        description="How an engine's threads wait for work. Spin: vLLM's own waits (NIXL's progress thread "
        "polls without pause, the engine core and its worker spin for 1 s after each message): the least "
        "latency when every engine thread has a core to itself, as on GPU nodes, and a core each while idle. "
        "Events: they sleep until woken (NIXL polls UCX's event descriptors with a pause; the queues wake on "
        "a hint splitserve makes reliable), so an idle engine uses no CPU and engines sharing cores do not "
        "starve each other. Auto: Events for pools without GPUs, Spin for the others.",
    )
    spin_microseconds: int = Field(
        0,
        ge=0,
        le=100_000,
        description="Events: how long the engine core and its worker spin for a message before they sleep "
        "(0: at once). Spinning buys a little latency with a core; worth it only with cores to spare.",
    )
    nixl_poll_microseconds: int = Field(
        1000,
        ge=1000,
        le=1_000_000,
        description="Events: the longest NIXL's progress thread sleeps when no UCX event wakes it "
        "(NIXL rounds it up to whole milliseconds); a safety net, since UCX events wake it at once.",
    )


class LoraSpec(ApiModel):
    """vLLM's LoRA limits for every engine; used only when spec.adapters declares an adapter."""

    model_config = cel_rules(
        cel(
            "self.maxCpuLoras >= self.maxLoras",
            "engine.lora.maxCpuLoras must be at least engine.lora.maxLoras (vLLM refuses to start otherwise)",
            field_path=".maxCpuLoras",
        )
    )

    max_loras: int = Field(
        4,
        ge=1,
        le=256,
        description="Adapters one batch may mix (vLLM --max-loras); each takes a slot of accelerator memory "
        "sized by maxRank. Requests for more adapters at once wait for a slot.",
    )
    max_rank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] = Field(
        16, description="Highest adapter rank the engines accept (vLLM --max-lora-rank): a higher one fails to load."
    )
    max_cpu_loras: int = Field(
        8,
        ge=1,
        le=1024,
        description="Adapters an engine keeps in CPU memory (vLLM --max-cpu-loras), a least-recently-used "
        "cache: declared adapters beyond it stay loaded by name and are read again from their path when used.",
    )


class EngineSpec(ApiModel):
    image: str | None = Field(
        None,
        min_length=1,
        description=f"Worker image (vLLM plus splitserve). Unset: the operator's default (chart value "
        f"images.worker; {DEFAULT_WORKER_IMAGE} unless configured).",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    port: int = Field(8000, ge=1024, le=65535, description="HTTP port of every worker.")
    extra_args: list[str] = Field(default_factory=list, description="Extra vLLM arguments for every role.")
    env: list[EnvVar] = Field(default_factory=list, description="Extra environment for every worker.")
    prefix_caching: bool = Field(True, description="vLLM automatic prefix caching.")
    chunked_prefill: bool = Field(True, description="vLLM chunked prefill.")
    speculative_decoding: SpeculativeDecoding = Field(default_factory=SpeculativeDecoding)
    gpu_memory_utilization: float = Field(
        0.9, ge=0.05, le=0.99, description="Fraction of GPU memory vLLM may use (weights + KV cache)."
    )
    block_size: Literal[8, 16, 32, 64, 128] | None = Field(None, description="PagedAttention KV block size.")
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = Field(
        "auto", description="KV-cache storage dtype (vLLM --kv-cache-dtype); auto follows the model dtype."
    )
    max_num_seqs: int | None = Field(None, ge=1, le=4096, description="Max sequences in a running batch.")
    waits: EngineWaits = Field(
        default_factory=EngineWaits, description="How engine threads wait for work: spin or sleep until woken."
    )
    kv_events_port: int = Field(
        5557,
        ge=1024,
        le=65535,
        description="Port of vLLM's KV-cache event publisher (ZMQ) in the workers of a pool routed "
        "precise-prefix; only the router pods may reach it. Unused by other policies.",
    )
    lora: LoraSpec = Field(
        default_factory=LoraSpec,
        description="LoRA limits of every engine. LoRA is on exactly when spec.adapters is non-empty.",
    )


# --------------------------------------------------------------------------- KV transfer


class KvTransferSpec(ApiModel):
    connector: Connector = Field(
        Connector.NIXL,
        description="vLLM KV connector moving a prompt's KV cache from prefill to decode. Changing it starts a "
        "new KV generation: new pools come up beside the old ones, and the router never pairs across the two.",
    )
    buffer_device: Literal["cuda", "cpu"] = Field("cuda", description="Where the connector stages KV blocks.")
    side_channel_port: int = Field(5600, ge=1024, le=65535, description="NIXL handshake (side-channel) port.")
    shared_storage_path: str = Field(
        "/var/lib/splitserve/kv", description="ExampleConnector only: directory shared by both pools."
    )


# --------------------------------------------------------------------------- pools


class PoolResources(ApiModel):
    gpus: int = Field(1, ge=0, le=64, description="GPUs per replica (0 for CPU-only pools).")
    gpu_resource_name: str = Field("nvidia.com/gpu", min_length=1, description="Extended resource name of a GPU.")
    cpu: Quantity = Field("4", description="CPU request per replica.")
    memory: Quantity = Field("32Gi", description="Memory request per replica (also its limit).")
    shared_memory: Quantity = Field("8Gi", description="Size of /dev/shm (tensor parallel uses it).")


class PoolSpec(ApiModel):
    model_config = cel_rules(
        cel(
            "self.minReplicas <= self.maxReplicas",
            "minReplicas must be less than or equal to maxReplicas",
            field_path=".minReplicas",
        ),
        cel(
            "self.replicas >= self.minReplicas && self.replicas <= self.maxReplicas",
            "replicas must lie between minReplicas and maxReplicas",
            field_path=".replicas",
        ),
        cel(
            "self.resources.gpus % self.tensorParallelSize == 0",
            "resources.gpus must be a multiple of tensorParallelSize (each engine shard needs one GPU)",
            field_path=".resources.gpus",
        ),
    )

    replicas: int = Field(
        1, ge=0, le=MAX_POOL_REPLICAS, description="Replicas when autoscaling is off; the start size when on."
    )
    min_replicas: int = Field(
        1, ge=0, le=MAX_POOL_REPLICAS, description="Lower bound for autoscaling (0 allows scale to zero)."
    )
    max_replicas: int = Field(4, ge=0, le=MAX_POOL_REPLICAS, description="Upper bound for autoscaling.")
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="GPUs one engine instance spans.")
    resources: PoolResources = Field(default_factory=PoolResources)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Opaque] = Field(default_factory=list)
    affinity: Opaque | None = None
    extra_args: list[str] = Field(default_factory=list, description="Extra vLLM arguments for this role only.")
    termination_grace_period_seconds: int = Field(
        180, ge=0, le=3600, description="Time a worker has to drain in-flight requests when it is removed."
    )


# --------------------------------------------------------------------------- router


class RouterPolicies(ApiModel):
    prefill: RoutingPolicy = Field(RoutingPolicy.PREFIX_AWARE, description="Policy choosing a prefill worker.")
    decode: RoutingPolicy = Field(RoutingPolicy.LEAST_LOADED, description="Policy choosing a decode worker.")


class RouterTimeouts(ApiModel):
    connect_seconds: float = Field(5, gt=0, le=300)
    prefill_seconds: float = Field(120, gt=0, le=3600, description="Whole prefill leg.")
    first_token_seconds: float = Field(120, gt=0, le=3600, description="Decode leg until its first byte.")
    request_seconds: float = Field(900, gt=0, le=86400, description="Whole request.")
    queue_seconds: float = Field(60, gt=0, le=3600, description="Longest wait in the admission queue.")


class RouterSpec(ApiModel):
    replicas: int = Field(2, ge=0, le=100)
    image: str | None = Field(
        None,
        min_length=1,
        description=f"Router image. Unset: the operator's default (chart value images.router; "
        f"{DEFAULT_ROUTER_IMAGE} unless configured).",
    )
    routing_policy: RouterPolicies = Field(
        default_factory=RouterPolicies,
        description="Routing policy per pool (aggregated mode uses decode's). " + ROUTING_POLICY_HELP,
    )
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    port: int = Field(8000, ge=1, le=65535, description="Port of the router Service (OpenAI endpoint).")
    admission_queue_limit: int = Field(1024, ge=1, le=1_000_000, description="Requests held before 429.")
    timeouts: RouterTimeouts = Field(default_factory=RouterTimeouts)
    disaggregation_threshold_tokens: int = Field(
        256, ge=0, le=1_000_000, description="Prompts shorter than this skip the prefill pool."
    )
    cpu: Quantity = "1"
    memory: Quantity = "1Gi"


# --------------------------------------------------------------------------- autoscaling


class PrefillTargets(ApiModel):
    waiting_per_replica: float = Field(4, gt=0, description="Queued prompts per prefill replica.")
    ttft_slo_seconds: float = Field(1.0, gt=0, description="p90 time to first token to hold.")


class DecodeTargets(ApiModel):
    running_per_replica: float = Field(32, gt=0, description="Running sequences per decode replica.")
    waiting_per_replica: float = Field(2, gt=0, description="Queued requests per decode replica.")
    kv_cache_usage: float = Field(0.8, gt=0, le=1, description="KV cache usage to stay under.")
    itl_slo_seconds: float = Field(0.05, gt=0, description="p90 inter-token latency to hold.")


class RatioBounds(ApiModel):
    model_config = cel_rules(cel("self.min <= self.max", "prefillDecodeRatio.min must be <= max"))

    min: float = Field(0.0, ge=0, description="Lowest prefill:decode replica ratio.")
    max: float = Field(100.0, gt=0, description="Highest prefill:decode replica ratio.")


class AutoscalingSpec(ApiModel):
    enabled: bool = False
    backend: Literal["builtin", "keda", "hpa"] = Field("builtin", description="Built-in loop, KEDA or HPA v2.")
    prometheus_url: str = Field(
        "http://prometheus-operated.monitoring.svc:9090",
        pattern=r"^https?://",
        description="Prometheus HTTP API.",
    )
    interval_seconds: int = Field(15, ge=1, le=3600)
    scale_up_stabilization_seconds: int = Field(0, ge=0, le=3600)
    scale_down_stabilization_seconds: int = Field(300, ge=0, le=86400)
    max_step: int = Field(4, ge=1, le=100, description="Most replicas added or removed per decision.")
    tolerance: float = Field(0.1, ge=0, le=1, description="Relative band around the target that changes nothing.")
    prefill: PrefillTargets = Field(default_factory=PrefillTargets)
    decode: DecodeTargets = Field(default_factory=DecodeTargets)
    prefill_decode_ratio: RatioBounds | None = None
    queries: dict[str, str] = Field(default_factory=dict, description="PromQL overrides by signal name.")


# --------------------------------------------------------------------------- monitoring & optimization


class MonitoringSpec(ApiModel):
    enabled: bool = Field(False, description="Create a ServiceMonitor (router) and a PodMonitor (workers).")
    interval_seconds: int = Field(15, ge=1, le=600)
    labels: dict[str, str] = Field(default_factory=dict, description="Labels your Prometheus selects monitors by.")


class OptimizationSpec(ApiModel):
    dynamic: bool = Field(False, description="Let the operator apply diagnosis recommendations by itself.")
    veto: list[Literal["mode", "speculativeDecoding", "ratio"]] = Field(
        default_factory=list, description="Changes dynamic optimization must never make."
    )


# --------------------------------------------------------------------------- gateway

# The decode pods' P/D proxy (a native sidecar, `splitserve sidecar`) listens here when spec.gateway
# is set in disaggregated mode: the InferencePool's target port, so a Gateway's requests reach it.
PD_SIDECAR_PORT = 8200
# Gateway API's own limits and patterns (HTTPRoute spec.parentRefs, spec.hostnames).
GATEWAY_HOSTNAME = r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
Hostname = Annotated[str, Field(min_length=1, max_length=253, pattern=GATEWAY_HOSTNAME)]


class EndpointPickerSpec(ApiModel):
    model_config = cel_rules(
        cel(
            "self.port != self.metricsPort",
            "gateway.endpointPicker.metricsPort must differ from gateway.endpointPicker.port (gRPC): "
            "the picker listens on both",
            field_path=".metricsPort",
        )
    )

    replicas: int = Field(
        1,
        ge=0,
        le=10,
        description="Endpoint picker (EPP) replicas. Each picks from its own view of the pods, as the "
        "router's replicas do; 0 leaves the Gateway without a picker (only with failureMode FailOpen).",
    )
    port: int = Field(
        9002, ge=1, le=65535, description="gRPC port of the picker's ext_proc service (endpointPickerRef's port)."
    )
    metrics_port: int = Field(9090, ge=1, le=65535, description="HTTP port of the picker's /metrics.")
    cpu: Quantity = Field("1", description="CPU request of each picker pod.")
    memory: Quantity = Field("1Gi", description="Memory request (also its limit) of each picker pod.")


class PdSidecarSpec(ApiModel):
    cpu: Quantity = Field("1", description="CPU request of the pd-sidecar container on each decode pod.")
    memory: Quantity = Field("512Mi", description="Memory request (also its limit) of the pd-sidecar container.")


class GatewayParentRef(ApiModel):
    name: str = Field(min_length=1, max_length=253, description="Name of the Gateway the route attaches to.")
    namespace: str | None = Field(
        None, max_length=63, pattern=DNS_LABEL, description="The Gateway's namespace; unset: the route's own."
    )
    section_name: str | None = Field(
        None, max_length=253, pattern=DNS_SUBDOMAIN, description="A listener of the Gateway, by name."
    )
    port: int | None = Field(None, ge=1, le=65535, description="A listener of the Gateway, by port.")


class HttpRouteSpec(ApiModel):
    model_config = cel_rules(
        cel(
            "size(self.parentRefs) > 0",
            "gateway.httpRoute needs at least one entry in parentRefs: the Gateway (and listener) it attaches to",
            field_path=".parentRefs",
        ),
        cel(
            "self.parentRefs.all(p, self.parentRefs.exists_one(q, p.name == q.name && "
            "(has(p.namespace) ? p.namespace : '') == (has(q.namespace) ? q.namespace : '') && "
            "(has(p.sectionName) ? p.sectionName : '') == (has(q.sectionName) ? q.sectionName : '') && "
            "(has(p.port) ? p.port : 0) == (has(q.port) ? q.port : 0)))",
            "gateway.httpRoute.parentRefs lists the same Gateway listener twice",
            field_path=".parentRefs",
        ),
        cel(
            "self.hostnames.all(h, self.hostnames.exists_one(g, g == h))",
            "gateway.httpRoute.hostnames lists a hostname twice",
            field_path=".hostnames",
        ),
    )

    parent_refs: list[GatewayParentRef] = Field(
        default_factory=list, max_length=32, description="Gateways (listeners) the HTTPRoute attaches to."
    )
    hostnames: list[Hostname] = Field(
        default_factory=list,
        max_length=16,
        description="Host headers the route matches (a leading `*.` is a wildcard); empty: every host.",
    )


class GatewaySpec(ApiModel):
    """The deployment behind a cluster's Gateway (Gateway API Inference Extension)."""

    model_config = cel_rules(
        cel(
            "self.failureMode == 'FailOpen' || self.endpointPicker.replicas > 0",
            "gateway.endpointPicker.replicas 0 with failureMode FailClose fails every request through the "
            "Gateway: run a picker or set failureMode FailOpen",
            field_path=".endpointPicker.replicas",
        )
    )

    failure_mode: Literal["FailClose", "FailOpen"] = Field(
        "FailClose",
        description="What the Gateway does when the endpoint picker does not answer (the InferencePool's "
        "endpointPickerRef.failureMode). FailClose: the request fails. FailOpen: the Gateway picks a pool "
        "pod itself; in disaggregated mode that decode pod serves the request whole, without prefill.",
    )
    endpoint_picker: EndpointPickerSpec = Field(
        default_factory=EndpointPickerSpec,
        description="The endpoint picker (`splitserve epp`): the router's policies and pools behind the "
        "Gateway's ext_proc protocol.",
    )
    sidecar: PdSidecarSpec = Field(
        default_factory=PdSidecarSpec,
        description=f"Disaggregated mode: the P/D proxy on each decode pod (port {PD_SIDECAR_PORT}), which runs "
        "the prefill leg on the prefill pod the picker names, then decodes locally.",
    )
    http_route: HttpRouteSpec | None = Field(
        None, description="Render an HTTPRoute from these Gateways to the InferencePool (path prefix /)."
    )
    allowed_from: list[Opaque] = Field(
        default_factory=list,
        max_length=16,
        description="NetworkPolicy peers (as in an ingress rule's `from`) of the Gateway's proxy pods, which "
        "connect straight to the pool's pods and to the picker. Empty: pods of every namespace.",
    )


# --------------------------------------------------------------------------- rollout


class PoolRollout(ApiModel):
    max_surge: int = Field(
        1,
        ge=1,
        le=1000,
        description="New-generation workers of this pool started at once beyond the pool's size (the extra "
        "GPUs a rollout may hold: maxSurge x resources.gpus).",
    )


class RolloutAnalysis(ApiModel):
    """Compares the new generation with the old over a window of the router's per-generation metrics."""

    window_seconds: int = Field(300, ge=30, le=86400, description="Window the two generations are compared over.")
    min_requests: int = Field(
        20, ge=1, le=1_000_000, description="New-generation requests in the window before a verdict is given."
    )
    max_error_rate_increase: float = Field(
        0.02, ge=0, le=1, description="Pause when the new error rate exceeds the old by more than this (absolute)."
    )
    max_ttft_p90_ratio: float = Field(
        1.5, ge=1, le=100, description="Pause when the new TTFT p90 exceeds the old one times this."
    )
    prometheus_url: str | None = Field(
        None, pattern=r"^https?://", description="Prometheus HTTP API; unset: autoscaling.prometheusUrl."
    )


class RolloutSpec(ApiModel):
    prefill: PoolRollout = Field(default_factory=PoolRollout)
    decode: PoolRollout = Field(default_factory=PoolRollout, description="Also used by an aggregated pool.")
    analysis: RolloutAnalysis | None = Field(
        None, description="Compare the new generation with the old while both serve; a regression pauses the rollout."
    )


# --------------------------------------------------------------------------- LoRA adapters


class AdapterSource(ApiModel):
    """Where an adapter's files are: like model.source, read by each worker when it loads the adapter."""

    model_config = cel_rules(
        cel(
            "[has(self.huggingFace), has(self.pvc), has(self.uri)].filter(x, x).size() == 1",
            "an adapter's source needs exactly one of huggingFace, pvc or uri",
        )
    )

    hugging_face: HuggingFaceSource | None = Field(
        None, description="Download from the Hugging Face Hub (each worker, when it loads the adapter)."
    )
    pvc: PvcSource | None = Field(
        None,
        description="A PersistentVolumeClaim holding the adapter (adapter_config.json and its weights) at `path`, "
        "mounted read-only in every worker.",
    )
    uri: str | None = Field(
        None, min_length=1, description="A path vLLM loads the adapter from as is (e.g. a directory in the image)."
    )


class AdapterSpec(ApiModel):
    model_config = cel_rules(
        cel(
            f"self.name.matches('{MODEL_NAME_PATTERN}')",
            "an adapter's name must be a valid model name, as model.name: a letter or digit, then letters, digits "
            "and . _ / : -",
            field_path=".name",
            message_expression="'adapter name \"' + self.name + '\" is not a valid model name, as model.name: "
            "a letter or digit, then letters, digits and . _ / : -'",
        )
    )

    name: str = Field(
        min_length=1,
        max_length=MODEL_NAME_MAX_LENGTH,
        description="What clients put in the OpenAI `model` field to use this adapter (on the base model.name).",
    )
    source: AdapterSource


# --------------------------------------------------------------------------- root

# Whether `{}` (the model, an adapter) downloads with an HF token, for CEL.
_HF_TOKEN = "has({0}.source.huggingFace) && has({0}.source.huggingFace.tokenSecretRef)"


class InferenceDeploymentSpec(ApiModel):
    model_config = cel_rules(
        cel(
            "self.mode == 'aggregated' || self.kvTransfer.connector != 'None'",
            "disaggregated mode needs a KV connector: set kvTransfer.connector or mode: aggregated",
            field_path=".kvTransfer.connector",
        ),
        cel(
            "!(self.router.routingPolicy.prefill == 'precise-prefix' || self.router.routingPolicy.decode == "
            "'precise-prefix') || (self.engine.kvEventsPort != self.engine.port && "
            "self.engine.kvEventsPort != self.kvTransfer.sideChannelPort)",
            "engine.kvEventsPort must differ from engine.port and kvTransfer.sideChannelPort: with precise-prefix "
            "routing a worker listens on all three",
            field_path=".engine.kvEventsPort",
        ),
        cel(
            f"!has(self.gateway) || self.mode == 'aggregated' || (self.engine.port != {PD_SIDECAR_PORT} && "
            f"self.kvTransfer.sideChannelPort != {PD_SIDECAR_PORT} && (self.router.routingPolicy.decode != "
            f"'precise-prefix' || self.engine.kvEventsPort != {PD_SIDECAR_PORT}))",
            f"with spec.gateway in disaggregated mode the decode pods' pd-sidecar listens on port {PD_SIDECAR_PORT}: "
            "engine.port, kvTransfer.sideChannelPort and engine.kvEventsPort must differ from it",
            field_path=".gateway",
        ),
        cel(
            "!has(self.adapters) || self.adapters.all(a, self.adapters.exists_one(b, b.name == a.name))",
            "adapters[].name must be unique: clients pick an adapter by its name",
            field_path=".adapters",
            message_expression="'adapter \"' + self.adapters.filter(a, self.adapters.filter(b, b.name == a.name)"
            ".size() > 1)[0].name + '\" is declared twice: adapters[].name must be unique (clients pick an "
            "adapter by its name)'",
        ),
        cel(
            "!has(self.adapters) || self.adapters.all(a, a.name != self.model.name)",
            "an adapter's name must differ from model.name: clients choose the base model or an adapter by name",
            field_path=".adapters",
            message_expression="'adapter \"' + self.model.name + '\" has the name of the base model (model.name): "
            "clients choose the base model or an adapter by name'",
        ),
        cel(
            f"!has(self.adapters) || self.adapters.all(a, !({_HF_TOKEN.format('a')}) || "
            f"((!({_HF_TOKEN.format('self.model')}) || self.model.source.huggingFace.tokenSecretRef == "
            f"a.source.huggingFace.tokenSecretRef) && self.adapters.all(b, !({_HF_TOKEN.format('b')}) || "
            "b.source.huggingFace.tokenSecretRef == a.source.huggingFace.tokenSecretRef)))",
            "every huggingFace.tokenSecretRef (model.source and adapters[].source) must name the same Secret and "
            "key: a worker downloads with one HF_TOKEN",
            field_path=".adapters",
        ),
    )

    model: ModelSpec
    engine: EngineSpec = Field(default_factory=EngineSpec)
    kv_transfer: KvTransferSpec = Field(default_factory=KvTransferSpec)
    mode: Mode = Field(
        Mode.DISAGGREGATED,
        description="disaggregated: separate prefill and decode pools; aggregated: one pool (decode's settings).",
    )
    prefill: PoolSpec = Field(default_factory=PoolSpec)
    decode: PoolSpec = Field(default_factory=PoolSpec)
    router: RouterSpec = Field(default_factory=RouterSpec)
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec)
    monitoring: MonitoringSpec = Field(default_factory=MonitoringSpec)
    optimization: OptimizationSpec = Field(default_factory=OptimizationSpec)
    rollout: RolloutSpec = Field(
        default_factory=RolloutSpec,
        description="How a change of the KV generation (api/generation.py: model revision, dtype, image, "
        "TP layout, connector ...) rolls out: new pools beside the old, make-before-break.",
    )
    gateway: GatewaySpec | None = Field(
        None,
        description="Serve behind a cluster's Gateway too (Gateway API Inference Extension): an InferencePool "
        "of the serving pods, its endpoint picker, in disaggregated mode a P/D sidecar on decode pods, and "
        "optionally an HTTPRoute. The router keeps serving beside it.",
    )
    adapters: list[AdapterSpec] = Field(
        default_factory=list,
        max_length=MAX_ADAPTERS,
        description="LoRA adapters of the base model, each served under its own name. Non-empty: every worker "
        "runs with LoRA on (engine.lora) and loads each adapter at run time, so changing this list rolls no pod "
        "and starts no KV generation; the router sends a request for an adapter only to workers that loaded it. "
        "status.adapters says how many workers serve each.",
    )
