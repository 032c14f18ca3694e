"""Just enough of Kubernetes' protobuf encoding to read what `kubectl create <generator>` sends.

kubectl's typed clients (`kubectl create namespace|configmap|secret|serviceaccount`) send bodies as
`application/vnd.kubernetes.protobuf` and accept JSON back. This decodes the envelope
("k8s\\0" + runtime.Unknown) and, for a few simple kinds, the object itself, using their field numbers
from the upstream generated.proto files. Other kinds stay unsupported (415).
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator
from typing import Any

MAGIC = b"k8s\x00"


class ProtobufError(ValueError):
    pass


def _varint(data: bytes, position: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if position >= len(data):
            raise ProtobufError("truncated varint")
        byte = data[position]
        position += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, position
        shift += 7


def fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) pairs: ints for varints, bytes for length-delimited fields."""
    position = 0
    while position < len(data):
        key, position = _varint(data, position)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, position = _varint(data, position)
            yield number, value
        elif wire_type == 2:
            length, position = _varint(data, position)
            yield number, data[position : position + length]
            position += length
        elif wire_type == 1:
            yield number, int.from_bytes(data[position : position + 8], "little")
            position += 8
        elif wire_type == 5:
            yield number, int.from_bytes(data[position : position + 4], "little")
            position += 4
        else:
            raise ProtobufError(f"unsupported wire type {wire_type}")


def _text(value: int | bytes) -> str:
    if not isinstance(value, bytes):
        raise ProtobufError("expected a string field")
    return value.decode()


def _raw(value: int | bytes) -> bytes:
    if not isinstance(value, bytes):
        raise ProtobufError("expected a bytes field")
    return value


def _map_entry(value: int | bytes) -> tuple[str, bytes]:
    key, item = "", b""
    for number, part in fields(_raw(value)):
        if number == 1:
            key = _text(part)
        elif number == 2:
            item = _raw(part)
    return key, item


def _object_meta(data: bytes) -> dict[str, Any]:
    names = {1: "name", 2: "generateName", 3: "namespace"}
    metadata: dict[str, Any] = {}
    for number, value in fields(data):
        if number in names:
            if text := _text(value):  # proto3 sends empty strings; JSON leaves them out
                metadata[names[number]] = text
        elif number in (11, 12):
            key, item = _map_entry(value)
            metadata.setdefault("labels" if number == 11 else "annotations", {})[key] = item.decode()
        elif number == 14:
            metadata.setdefault("finalizers", []).append(_text(value))
    return metadata


def _config_map(data: bytes) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for number, value in fields(data):
        if number == 1:
            obj["metadata"] = _object_meta(_raw(value))
        elif number == 2:
            key, item = _map_entry(value)
            obj.setdefault("data", {})[key] = item.decode()
        elif number == 3:
            key, item = _map_entry(value)
            obj.setdefault("binaryData", {})[key] = base64.b64encode(item).decode()
        elif number == 4:
            obj["immutable"] = bool(value)
    return obj


def _secret(data: bytes) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for number, value in fields(data):
        if number == 1:
            obj["metadata"] = _object_meta(_raw(value))
        elif number == 2:
            key, item = _map_entry(value)
            obj.setdefault("data", {})[key] = base64.b64encode(item).decode()
        elif number == 3:
            obj["type"] = _text(value)
        elif number == 4:
            key, item = _map_entry(value)
            obj.setdefault("stringData", {})[key] = item.decode()
        elif number == 5:
            obj["immutable"] = bool(value)
    return obj


def _metadata_only(data: bytes) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for number, value in fields(data):
        if number == 1:
            obj["metadata"] = _object_meta(_raw(value))
    return obj


_DECODERS: dict[tuple[str, str], Callable[[bytes], dict[str, Any]]] = {
    ("v1", "ConfigMap"): _config_map,
    ("v1", "Secret"): _secret,
    ("v1", "Namespace"): _metadata_only,
    ("v1", "ServiceAccount"): _metadata_only,
}


def decode(body: bytes) -> dict[str, Any]:
    """The JSON-equivalent object of a protobuf request body; ProtobufError for unsupported kinds."""
    if not body.startswith(MAGIC):
        raise ProtobufError("not a Kubernetes protobuf envelope")
    api_version = kind = ""
    raw = b""
    for number, value in fields(body[len(MAGIC) :]):
        if number == 1:
            for type_number, type_value in fields(_raw(value)):
                if type_number == 1:
                    api_version = _text(type_value)
                elif type_number == 2:
                    kind = _text(type_value)
        elif number == 2:
            raw = _raw(value)
    decoder = _DECODERS.get((api_version, kind))
    if decoder is None:
        raise ProtobufError(f"protobuf bodies of {api_version} {kind} are not supported; send JSON")
    return {"apiVersion": api_version, "kind": kind, **decoder(raw)}
