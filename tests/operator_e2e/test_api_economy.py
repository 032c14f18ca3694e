"""The operator's API economy, counted by the emulator's request log: once a deployment is Ready,
reconciles (a child event, the drift pass) read from the watch caches and write nothing.

The operator runs with a 1 s drift pass and its metrics served, so the test knows that reconciles
ran (splitserve_operator_reconciles_total{result="unchanged"} grows) while it counts what they cost."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator

import pytest

from splitserve.local.ports import free_port
from testkit.emulator.client import EmulatorClient, wait_for
from testkit.emulator.fixtures import EmulatorProcess
from testkit.operator import (
    NAMESPACE,
    OperatorProcess,
    install_crd,
    operator_requests,
    reconciles_total,
    worker_pool,
)

pytestmark = [pytest.mark.emulator, pytest.mark.slow]
IDEP = ("splitserve.io/v1alpha1", "inferencedeployments")
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def economy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmulatorClient, str]]:
    workdir = tmp_path_factory.mktemp("economy")
    emulator = EmulatorProcess(workdir)
    emulator.start()
    port = free_port()
    operator = OperatorProcess(
        emulator,
        workdir,
        # Drift every second, so reconciles run while the test counts; the diagnosis (its own status
        # part, tested on its own) out of the way.
        env={"SPLITSERVE_DRIFT_INTERVAL_SECONDS": "1", "SPLITSERVE_DIAGNOSIS_INTERVAL_SECONDS": "3600"},
        args=["--metrics-port", str(port)],
    )
    try:
        with emulator.client() as client:
            install_crd(client)
            operator.start()
            yield client, f"http://127.0.0.1:{port}/metrics"
    finally:
        operator.stop()
        emulator.kill()
        sys.stderr.write(operator.log()[-4000:])


def unchanged_reconciles(metrics_url: str) -> float:
    return reconciles_total(metrics_url, "unchanged")


def ready(client: EmulatorClient, name: str) -> bool:
    obj = client.get_or_none(*IDEP, name, namespace=NAMESPACE)
    return ((obj or {}).get("status") or {}).get("ready") == "True"


def test_a_child_event_and_the_drift_pass_cost_no_call_once_ready(economy: tuple[EmulatorClient, str]) -> None:
    client, metrics_url = economy
    body = {"model": {"name": "tiny", "source": {"uri": "s3://models/tiny"}}}
    client.create(
        {"apiVersion": IDEP[0], "kind": "InferenceDeployment", "metadata": {"name": "calm", "namespace": NAMESPACE}}
        | {"spec": body}
    )
    wait_for(lambda: ready(client, "calm"), timeout=TIMEOUT, message="calm Ready")
    # Settled: two drift passes in a row changed nothing.
    settled = unchanged_reconciles(metrics_url)
    wait_for(lambda: unchanged_reconciles(metrics_url) >= settled + 2, timeout=TIMEOUT, message="two no-op passes")

    # The filter sees the operator: getting to Ready took its writes.
    assert any(call.get("verb") in ("create", "patch") for call in operator_requests(client))
    client.clear_requests_log()
    before = unchanged_reconciles(metrics_url)
    # The review's case: one annotation on the decode Deployment (a child event), then a few drift passes.
    decode = worker_pool(client, "calm", "decode")
    assert decode is not None
    client.patch(
        "apps/v1",
        "deployments",
        decode["metadata"]["name"],
        {"metadata": {"annotations": {"example.com/touched": "yes"}}},
        namespace=NAMESPACE,
    )
    wait_for(lambda: unchanged_reconciles(metrics_url) >= before + 3, timeout=TIMEOUT, message="three no-op passes")

    calls = operator_requests(client)
    assert calls == [], json.dumps(calls)[:2000]
    # The log did record this window: the test's own patch is in it.
    assert any(record.get("verb") == "patch" for record in client.requests_log())
