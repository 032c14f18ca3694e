"""Operator benchmark (counted, not timed by a test): API calls and seconds against the API emulator.

    python benchmarks/operator/bench_reconcile.py [--counts 1,100,300] [--baseline REF --baseline-counts 1,100]
    python benchmarks/operator/bench_reconcile.py --smoke --out /tmp/reconcile.json   # seconds: does it still run?

For each count N, a fresh emulator and a fresh `splitserve operator --all-namespaces` (production
settings: 60 s drift pass, 300 s diagnosis), then:

- apply N InferenceDeployments; seconds and API calls (by verb) until every one is Ready;
- a no-op reconcile: annotate every decode Deployment (a child event that changes nothing the operator
  owns), wait until the operator has run N more reconciles (its own metric says so), and divide the
  calls made meanwhile by the reconciles run;
- idle: first the calls until every CR carries its first diagnosis (the diagnosis timer's first run,
  60 s after a CR appears, writes status once), then calls per CR per minute over --idle-seconds
  with nothing happening (calls by verb and resource in both);
- the operator's RSS, idle before the run and at its peak.

`--baseline REF` runs the same for the operator at a git ref (e.g. the commit before the watch caches),
in the same run, from a link tree of that ref's package, so the two are compared on the same machine
at the same moment. Calls are the operator's own (its User-Agent and kopf's), watches excluded: a
watch is one long request. The emulator (testkit/emulator) stands in for kube-apiserver, its fake
Deployment controller marking replicas ready at once: the seconds measure the operator's work plus
the emulator's on one machine (both share its cores), not a real cluster's scheduling.

`--smoke` runs one CR with a 3 s diagnosis timer and 3 idle seconds (tests/benchmarks runs it): it
shows the steps still work, not what they cost.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from splitserve.api.crd import render_crd_yaml  # noqa: E402
from splitserve.local.ports import free_port  # noqa: E402
from testkit.emulator.client import EmulatorClient  # noqa: E402
from testkit.emulator.fixtures import EmulatorProcess  # noqa: E402
from testkit.operator import operator_requests, reconciles_total, worker_pool  # noqa: E402

IDEP = ("splitserve.io/v1alpha1", "inferencedeployments")
NAMESPACE = "bench"
LIMIT_S = 900.0
# --smoke: the diagnosis timer's first run after 3 s instead of 60 (its interval and first delay).
SMOKE_OPERATOR_ENV = {"SPLITSERVE_DIAGNOSIS_INTERVAL_SECONDS": "3"}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def idep(name: str) -> dict[str, object]:
    return {
        "apiVersion": IDEP[0],
        "kind": "InferenceDeployment",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"model": {"name": name, "source": {"uri": "s3://models/x"}}},
    }


def ready_count(client: EmulatorClient) -> int:
    items = client.list(*IDEP, namespace=NAMESPACE)
    return sum(1 for item in items if (item.get("status") or {}).get("ready") == "True")


def operator_calls(client: EmulatorClient) -> collections.Counter[str]:
    """The operator's calls by verb (its client and kopf's), watches excluded."""
    return collections.Counter(str(record.get("verb")) for record in operator_requests(client))


def operator_calls_by_resource(client: EmulatorClient) -> collections.Counter[str]:
    """The operator's calls as "verb resource[/subresource]", e.g. "patch inferencedeployments/status"."""
    return collections.Counter(
        f"{record.get('verb')} {record.get('resource')}"
        + (f"/{record['subresource']}" if record.get("subresource") else "")
        for record in operator_requests(client)
    )


def diagnosed_count(client: EmulatorClient) -> int:
    items = client.list(*IDEP, namespace=NAMESPACE)
    return sum(1 for item in items if (item.get("status") or {}).get("diagnosis"))


def until(
    check: Callable[[], bool],
    what: str,
    every_s: float = 0.2,
    during: Callable[[], None] | None = None,
    limit_s: float = LIMIT_S,
) -> None:
    deadline = time.monotonic() + limit_s
    while not check():
        if during is not None:
            during()
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(every_s)


def package_tree(ref: str, workdir: Path) -> Path:
    """A directory to put first on PYTHONPATH that imports `splitserve` as it was at `ref`."""
    source = workdir / "source"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(source), ref], check=True)
    tree = workdir / "site"
    tree.mkdir()
    # A tree of symlinks: the old package's files, with the data-plane packages where setuptools maps them.
    subprocess.run(["cp", "-rs", str(source / "operator" / "splitserve"), str(tree / "splitserve")], check=True)
    for sub in ("router", "sim", "engine", "local"):
        if (source / "workers" / sub).is_dir():
            os.symlink(source / "workers" / sub, tree / "splitserve" / sub)
    return tree


def decode_pool_name(client: EmulatorClient, name: str) -> str:
    """The decode Deployment of CR `name`, found by its labels as the operator finds its pools: it is
    named after its KV generation (`<name>-decode-<generation>`)."""
    pool = worker_pool(client, name, "decode", namespace=NAMESPACE)
    if pool is None:
        raise RuntimeError(f"{name} is Ready without a decode Deployment (labelled splitserve.io/role=decode)")
    return str(pool["metadata"]["name"])


def measure(
    count: int, idle_seconds: float, pythonpath: Path | None, operator_env: Mapping[str, str] | None = None
) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="bench-operator-"))
    emulator = EmulatorProcess(workdir)
    emulator.start()
    port = free_port()
    metrics_url = f"http://127.0.0.1:{port}/metrics"
    env = {**emulator.env(), **(operator_env or {})}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    result: dict[str, Any] = {"count": count}
    with emulator.client() as client:
        client.apply(yaml.safe_load(render_crd_yaml()), field_manager="bench", force=True)
        client.create_namespace(NAMESPACE)
        log = (workdir / "operator.log").open("wb")
        command = [sys.executable, "-m", "splitserve", "operator", "--standalone", "--all-namespaces"]
        operator = subprocess.Popen([*command, "--metrics-port", str(port)], env=env, stdout=log, stderr=log)
        try:
            until(lambda: _serving(metrics_url), "operator metrics")
            time.sleep(2)
            result["rss_idle_mib"] = round(rss_mib(operator.pid), 1)
            client.clear_requests_log()
            peak = 0.0

            def sample_rss() -> None:
                nonlocal peak
                peak = max(peak, rss_mib(operator.pid))

            started = time.monotonic()
            for index in range(count):
                client.create(idep(f"m{index}"))
            until(lambda: ready_count(client) >= count, f"{count} Ready", during=sample_rss)
            result["seconds_to_all_ready"] = round(time.monotonic() - started, 2)
            calls = operator_calls(client)
            result["calls_to_all_ready"] = sum(calls.values())
            result["calls_to_all_ready_by_verb"] = dict(calls.most_common())
            result["calls_to_all_ready_by_resource"] = dict(operator_calls_by_resource(client).most_common())

            # Let the roll-out's last events settle, then one child event per CR.
            time.sleep(3)
            client.clear_requests_log()
            before = reconciles_total(metrics_url)
            decode = [decode_pool_name(client, f"m{index}") for index in range(count)]
            client.clear_requests_log()
            for index in range(count):
                client.patch(
                    "apps/v1",
                    "deployments",
                    decode[index],
                    {"metadata": {"annotations": {"bench.splitserve.io/touched": str(time.time())}}},
                    namespace=NAMESPACE,
                )
            until(lambda: reconciles_total(metrics_url) >= before + count, "a reconcile per touched CR")
            time.sleep(1)
            ran = reconciles_total(metrics_url) - before
            calls = operator_calls(client)
            result["noop_reconcile"] = {
                "reconciles": ran,
                "calls_per_reconcile": round(sum(calls.values()) / ran, 2),
                "calls_per_reconcile_by_verb": {verb: round(n / ran, 2) for verb, n in calls.most_common()},
            }

            # The diagnosis timer's first run on each CR (60 s after it appeared) writes its first
            # diagnosis once; counted apart, then idle is measured once every CR carries one.
            client.clear_requests_log()
            waited = time.monotonic()
            # An operator without a diagnosis timer (or a slower one) times out here: idle is measured anyway.
            with contextlib.suppress(TimeoutError):
                until(lambda: diagnosed_count(client) >= count, "first diagnosis", every_s=1.0, limit_s=150.0)
            calls = operator_calls_by_resource(client)
            result["first_diagnosis"] = {
                "seconds": round(time.monotonic() - waited, 1),
                "diagnosed": diagnosed_count(client),
                "calls": sum(calls.values()),
                "calls_by_resource": dict(calls.most_common()),
            }

            client.clear_requests_log()
            time.sleep(idle_seconds)
            sample_rss()
            calls = operator_calls_by_resource(client)
            result["idle"] = {
                "seconds": idle_seconds,
                "calls": sum(calls.values()),
                "calls_by_resource": dict(calls.most_common()),
                "calls_per_cr_per_minute": round(sum(calls.values()) / count / (idle_seconds / 60), 3),
            }
            result["rss_peak_mib"] = round(peak, 1)
        finally:
            operator.terminate()
            operator.wait(timeout=30)
            emulator.kill()
    return result


def _serving(metrics_url: str) -> bool:
    try:
        return httpx.get(metrics_url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", default="1,100,300")
    parser.add_argument("--idle-seconds", type=float, default=75.0)
    parser.add_argument("--baseline", default=None, help="a git ref whose operator runs the same steps")
    parser.add_argument("--baseline-counts", default="1,100")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument(
        "--smoke", action="store_true", help="one CR, a 3 s diagnosis timer, 3 idle seconds, no baseline: a few seconds"
    )
    args = parser.parse_args()
    operator_env: dict[str, str] = {}
    if args.smoke:
        args.counts, args.idle_seconds, args.baseline = "1", 3.0, None
        operator_env = SMOKE_OPERATOR_ENV
    runs = [measure(int(n), args.idle_seconds, None, operator_env) for n in args.counts.split(",")]
    report: dict[str, Any] = {"splitserve": runs}
    if args.baseline:
        with tempfile.TemporaryDirectory(prefix="bench-baseline-") as scratch:
            tree = package_tree(args.baseline, Path(scratch))
            try:
                report["baseline"] = {
                    "ref": args.baseline,
                    "runs": [measure(int(n), args.idle_seconds, tree) for n in args.baseline_counts.split(",")],
                }
            finally:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(Path(scratch) / "source")])
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
