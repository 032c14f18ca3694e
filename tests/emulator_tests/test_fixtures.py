"""The fixtures other test folders use: options, the async client, the kubeconfig for python clients."""

from __future__ import annotations

from collections.abc import Callable

import yaml

from testkit.emulator.client import ApiError, AsyncEmulatorClient
from testkit.emulator.fixtures import EmulatorProcess


def test_omitted_groups_are_not_served(emulator_factory: Callable[..., EmulatorProcess]) -> None:
    process = emulator_factory(omitted_resources=["monitoring.coreos.com", "keda.sh/scaledobjects"])
    with process.client() as client:
        groups = {group["name"] for group in client.request("GET", "/apis")["groups"]}
        assert "monitoring.coreos.com" not in groups and "keda.sh" not in groups
        try:
            client.request("GET", "/apis/monitoring.coreos.com/v1/namespaces/default/servicemonitors/x")
        except ApiError as error:
            # What an operator sees when prometheus-operator's CRDs are not installed.
            assert error.status_code == 404 and "the server could not find" in error.body["message"]
        else:
            raise AssertionError("an omitted resource was served")


def test_kubeconfig_points_at_the_emulator(emulator: EmulatorProcess) -> None:
    config = yaml.safe_load(emulator.kubeconfig.read_text())
    assert config["clusters"][0]["cluster"]["server"] == emulator.url
    assert config["users"][0]["user"]["token"]


async def test_async_client_round_trip(async_emulator_client: AsyncEmulatorClient) -> None:
    body = {"metadata": {"name": "a"}, "data": {"k": "v"}}
    await async_emulator_client.create("v1", "configmaps", body, namespace="default")
    patched = await async_emulator_client.patch("v1", "configmaps", "a", {"data": {"k": "w"}}, namespace="default")
    assert patched["data"] == {"k": "w"}
    assert [
        o["metadata"]["name"] for o in await async_emulator_client.list("v1", "configmaps", namespace="default")
    ] == ["a"]
    log = await async_emulator_client.requests_log()
    assert [r["verb"] for r in log if r["resource"] == "configmaps"] == ["create", "patch", "list"]
