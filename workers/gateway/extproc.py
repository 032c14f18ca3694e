"""The endpoint picker protocol on Envoy's ext_proc stream (GAIE proposal 004), over gRPC.

One ``Process`` stream per HTTP request:

- request headers (kept; answered at once unless the request has no body, then picked there);
- request body (buffered): the pick. The answer sets ``x-gateway-destination-endpoint`` to the
  destination followed by its fallbacks, puts the same value in ``envoy.lb`` dynamic metadata, clears
  the route cache, and sets or removes ``x-prefiller-host-port`` for the decode-side sidecar;
- response headers: the status, and the endpoint that served (the ``upstream.address`` attribute, or
  ``x-gateway-destination-endpoint-served`` in ``envoy.lb`` metadata, whichever the proxy sends);
- the end of the stream: the request is over; its slots go back.

Nothing ready answers 503, a full admission queue 429, a bad request 4xx: each an ImmediateResponse
with the router's OpenAI-style JSON. The proxy's subset hint (``envoy.lb.subset_hint`` metadata) limits
the choice.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from splitserve.gateway.envoy import (
    DESTINATION_HEADER,
    EXT_PROC_FILTER,
    LB_NAMESPACE,
    SERVED_KEY,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
)
from splitserve.gateway.picker import EndpointPicker, Placement
from splitserve.router import errors

log = logging.getLogger(__name__)


def _headers(message: pb.HttpHeaders) -> dict[str, str]:
    found: dict[str, str] = {}
    for header in message.headers.headers:
        value = header.raw_value.decode("utf-8", "replace") if header.raw_value else header.value
        found[header.key.lower()] = value
    return found


def _endpoints(value: struct_pb2.Value) -> list[str]:
    """A subset hint: a list of ``ip:port`` (GAIE), or one comma-separated string (a header mapped to metadata)."""
    if value.HasField("list_value"):
        return [v.string_value.strip() for v in value.list_value.values if v.string_value.strip()]
    return [e.strip() for e in value.string_value.split(",") if e.strip()]


def subset_hint(request: pb.ProcessingRequest) -> frozenset[str] | None:
    namespace = request.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET_KEY not in namespace.fields:
        return None
    return frozenset(_endpoints(namespace.fields[SUBSET_KEY]))


def served_endpoint(request: pb.ProcessingRequest) -> str | None:
    """The endpoint that served, as the proxy reports it."""
    lb = request.metadata_context.filter_metadata.get(LB_NAMESPACE)
    if lb is not None and SERVED_KEY in lb.fields:
        return lb.fields[SERVED_KEY].string_value or None
    attributes = request.attributes.get(EXT_PROC_FILTER)
    if attributes is not None and "upstream.address" in attributes.fields:
        return attributes.fields["upstream.address"].string_value or None
    return None


def _mutation(set_headers: dict[str, str], remove: Iterable[str] = ()) -> pb.HeaderMutation:
    return pb.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
            for key, value in set_headers.items()
        ],
        remove_headers=list(remove),
    )


def _picked(placement: Placement) -> tuple[pb.CommonResponse, struct_pb2.Struct]:
    destination = placement.destination
    common = pb.CommonResponse(
        header_mutation=_mutation({DESTINATION_HEADER: destination, **placement.headers}, placement.remove_headers),
        clear_route_cache=True,
    )
    metadata = struct_pb2.Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION_HEADER: destination}})
    return common, metadata


def immediate(error: errors.RouterError) -> pb.ProcessingResponse:
    headers = {"content-type": "application/json", **{k.lower(): v for k, v in error.headers.items()}}
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=error.status),
            headers=_mutation(headers),
            body=error.body(),
            details=f"splitserve_epp_{error.code}",
        )
    )


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """``envoy.service.ext_proc.v3.ExternalProcessor`` answered by an :class:`EndpointPicker`."""

    def __init__(self, picker: EndpointPicker) -> None:
        self._picker = picker

    async def _pick(
        self, headers: dict[str, str], body: bytes | None, subset: frozenset[str] | None, *, body_phase: bool
    ) -> tuple[Placement | None, pb.ProcessingResponse]:
        """The placement and the answer to the phase it was made in (None and an ImmediateResponse when
        the request cannot go anywhere)."""
        path = headers.get(":path", "/").split("?", 1)[0]
        try:
            placement = await self._picker.place(path, headers, body, subset)
        except errors.RouterError as error:
            self._picker.rejected(error)
            return None, immediate(error)
        common, metadata = _picked(placement)
        if body_phase:
            return placement, pb.ProcessingResponse(
                request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata
            )
        return placement, pb.ProcessingResponse(
            request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata
        )

    async def Process(  # the gRPC method's name
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessingResponse]:
        picker = self._picker
        placement: Placement | None = None
        headers: dict[str, str] = {}
        subset: frozenset[str] | None = None
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("request")
                if kind == "request_headers":
                    headers = _headers(message.request_headers)
                    subset = subset_hint(message)
                    if not message.request_headers.end_of_stream:
                        yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
                        continue
                    # No body follows (GET): the pick happens now.
                    placement, answer = await self._pick(headers, None, subset, body_phase=False)
                    yield answer
                    if placement is None:
                        return
                elif kind == "request_body":
                    placement, answer = await self._pick(headers, message.request_body.body, subset, body_phase=True)
                    yield answer
                    if placement is None:
                        return
                elif kind == "response_headers":
                    if placement is not None:
                        status_text = _headers(message.response_headers).get(":status", "")
                        status = int(status_text) if status_text.isdigit() else None
                        picker.response_started(placement, status, served_endpoint(message))
                    yield pb.ProcessingResponse(response_headers=pb.HeadersResponse())
                elif kind == "request_trailers":
                    yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
                elif kind == "response_body":
                    yield pb.ProcessingResponse(response_body=pb.BodyResponse())
                elif kind == "response_trailers":
                    yield pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
        finally:
            # The proxy ends the stream when the HTTP request is over (or gone): its slots go back.
            if placement is not None:
                picker.finished(placement)
