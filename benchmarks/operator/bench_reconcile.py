"""Operator benchmark (not a test): time from applying 1 and 100 InferenceDeployments to every
child applied and status written (Ready=True), and the operator's memory, against the API emulator.

    python benchmarks/operator/bench_reconcile.py [--counts 1,100]

The emulator (testkit/emulator) stands in for kube-apiserver, with its fake Deployment controller
marking replicas ready at once; so the figures measure the operator's own work plus the
emulator's, not a real cluster's scheduling. Run from the repository root.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from splitserve.api.crd import render_crd_yaml  # noqa: E402
from testkit.emulator.client import EmulatorClient  # noqa: E402
from testkit.emulator.fixtures import EmulatorProcess  # noqa: E402


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def idep(name: str, namespace: str) -> dict[str, object]:
    return {
        "apiVersion": "splitserve.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"model": {"name": name, "source": {"uri": "s3://models/x"}}},
    }


def ready_count(client: EmulatorClient, namespace: str) -> int:
    items = client.list("splitserve.io/v1alpha1", "inferencedeployments", namespace=namespace)
    return sum(1 for item in items if (item.get("status") or {}).get("ready") == "True")


def run(counts: list[int]) -> dict[str, object]:
    workdir = Path(tempfile.mkdtemp(prefix="bench-operator-"))
    emulator = EmulatorProcess(workdir)
    emulator.start()
    results: dict[str, object] = {}
    with emulator.client() as client:
        client.apply(yaml.safe_load(render_crd_yaml()), field_manager="bench", force=True)
        namespaces = [f"bench-{count}" for count in counts]
        for namespace in namespaces:
            client.create_namespace(namespace)
        log = (workdir / "operator.log").open("wb")
        operator = subprocess.Popen(
            [sys.executable, "-m", "splitserve", "operator", "--standalone", "--all-namespaces"],
            env=emulator.env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            time.sleep(5)
            results["operator_rss_idle_mib"] = round(rss_mib(operator.pid), 1)
            for count, namespace in zip(counts, namespaces, strict=True):
                started = time.monotonic()
                for index in range(count):
                    client.create(idep(f"m{index}", namespace))
                created = time.monotonic() - started
                peak = 0.0
                while ready_count(client, namespace) < count:
                    peak = max(peak, rss_mib(operator.pid))
                    if time.monotonic() - started > 600:
                        raise TimeoutError(f"{count} deployments not ready in 600 s")
                    time.sleep(0.2)
                elapsed = time.monotonic() - started
                results[f"n{count}"] = {
                    "seconds_to_all_ready": round(elapsed, 2),
                    "seconds_to_create": round(created, 2),
                    "per_deployment_ms": round(1000 * elapsed / count, 1),
                    "operator_rss_peak_mib": round(max(peak, rss_mib(operator.pid)), 1),
                }
            requests = client.requests_log()
            results["api_requests_by_operator"] = sum(
                1 for r in requests if str(r.get("user_agent", "")).startswith(("splitserve-operator", "kopf"))
            )
        finally:
            operator.terminate()
            operator.wait(timeout=30)
            emulator.kill()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", default="1,100")
    args = parser.parse_args()
    print(json.dumps(run([int(c) for c in args.counts.split(",")]), indent=2))


if __name__ == "__main__":
    main()
