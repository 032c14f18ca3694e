"""What the end-to-end rigs that play kubelet share: the emulator client, the EndpointSlices they
publish for the workers they start, and reads of the InferenceDeployment and its Deployments.

`EmulatedDeployment` is the base of `ScaleFromZeroRig` (testkit.rigs.scale_from_zero: the harness of
tests/operator_e2e/test_scale_from_zero.py and benchmarks/autoscaling/cold_start.py) and `LoadStepRig`
(tests/operator_e2e/test_load_step.py); a subclass starts its parts in `_start`, registering their
clean-up on `self._stack`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

import httpx

from splitserve.local.ports import free_port
from testkit.emulator.client import ApiError, AsyncEmulatorClient
from testkit.emulator.fixtures import EmulatorProcess
from testkit.operator import NAMESPACE
from testkit.rigs.slices import endpoint_slice as slice_with_addresses

IDEP = ("splitserve.io/v1alpha1", "inferencedeployments")
SLICES = ("discovery.k8s.io/v1", "endpointslices")
T = TypeVar("T")


async def eventually(check: Callable[[], Awaitable[T]], what: str, limit_s: float = 60.0, every_s: float = 0.05) -> T:
    """Poll an async check until it returns something truthy; that value is returned."""
    deadline = time.monotonic() + limit_s
    last: T | None = None
    while time.monotonic() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(every_s)
    raise TimeoutError(f"timed out after {limit_s}s waiting for {what} (last: {last!r})")


def as_async(check: Callable[[], T]) -> Callable[[], Awaitable[T]]:
    """A plain check as the async one `eventually` polls."""

    async def run() -> T:
        return check()

    return run


def endpoint_slice(service: str, port: int, ready: list[str], terminating: Sequence[str] = ()) -> dict[str, Any]:
    """The EndpointSlice the endpoints controller keeps for a worker Service (testkit.rigs.slices' builder,
    taking the ready and the terminating addresses apart)."""
    addresses = {**dict.fromkeys(ready, False), **dict.fromkeys(terminating, True)}
    return slice_with_addresses(service, addresses, port)


class EmulatedDeployment:
    """One InferenceDeployment `name` in the emulator, with the workers' port and the clean-up stack."""

    def __init__(self, emulator: EmulatorProcess, workdir: Path, name: str) -> None:
        self.emulator = emulator
        self.workdir = workdir
        self.name = name
        self.port = free_port()
        self.api = AsyncEmulatorClient(emulator.url)
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> Self:
        try:
            await self._start()
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._stack.aclose()

    async def _start(self) -> None:
        raise NotImplementedError

    async def _delete_deployment(self) -> None:
        with contextlib.suppress(ApiError, httpx.HTTPError):
            await self.api.delete(*IDEP, self.name, namespace=NAMESPACE)

    async def publish(self, service: str, ready: list[str], terminating: Sequence[str] = ()) -> None:
        """Create or replace the Service's EndpointSlice, as the endpoints controller does."""
        body = endpoint_slice(service, self.port, ready, terminating)
        try:
            current = await self.api.get(*SLICES, f"{service}-slice", namespace=NAMESPACE)
        except ApiError as error:
            if error.status_code != 404:
                raise
            await self.api.create(*SLICES, body, namespace=NAMESPACE)
            return
        body["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
        await self.api.request(
            "PUT", f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices/{service}-slice", json=body
        )

    async def replicas(self, pool: str) -> int | None:
        """The pool Deployment's spec.replicas; None while it does not exist. Found by its labels: it is
        named after its KV generation too (`<name>-<role>-<generation>`), one per role outside a rollout."""
        selector = f"splitserve.io/deployment={self.name},splitserve.io/role={pool}"
        found = await self.api.list("apps/v1", "deployments", namespace=NAMESPACE, label_selector=selector)
        if not found:
            return None
        return sum(int(deployment.get("spec", {}).get("replicas", 1)) for deployment in found)

    async def replicas_equal(self, **expected: int) -> bool:
        return all([await self.replicas(pool) == count for pool, count in expected.items()])

    async def status(self) -> dict[str, Any]:
        body = await self.api.get(*IDEP, self.name, namespace=NAMESPACE)
        status: dict[str, Any] = body.get("status") or {}
        return status
