"""Headless Services over the worker pools: one stable name per pool, across KV generations (they
select by role, not generation). The operator's router follows the worker Pods instead (router.py),
since only a Pod carries its generation; the Services serve people and tools that need one name per
pool, and mix both generations while a rollout runs."""

from __future__ import annotations

from typing import Any

from splitserve.api.spec import Mode, Role
from splitserve.api.topology import (
    LABEL_DEPLOYMENT,
    LABEL_ROLE,
    LABEL_SERVES_DECODE,
    WORKER_HTTP_PORT_NAME,
    decode_service_name,
    prefill_service_name,
)
from splitserve.builders.target import Target, metadata


def _headless(target: Target, name: str, component: str, selector: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(target, name, component),
        "spec": {
            "clusterIP": "None",
            "selector": selector,
            # Not-ready workers stay out of DNS/EndpointSlices until vLLM's /health passes.
            "publishNotReadyAddresses": False,
            "ports": [
                {
                    "name": WORKER_HTTP_PORT_NAME,
                    "port": target.spec.engine.port,
                    "targetPort": WORKER_HTTP_PORT_NAME,
                    "protocol": "TCP",
                }
            ],
        },
    }


def build_worker_services(target: Target) -> list[dict[str, Any]]:
    name = target.owner.name
    services = [
        _headless(
            target,
            decode_service_name(name),
            str(Role.DECODE),
            {LABEL_DEPLOYMENT: name, LABEL_SERVES_DECODE: "true"},
        )
    ]
    if target.spec.mode == Mode.DISAGGREGATED:
        services.insert(
            0,
            _headless(
                target, prefill_service_name(name), str(Role.PREFILL), {LABEL_DEPLOYMENT: name, LABEL_ROLE: "prefill"}
            ),
        )
    return services
