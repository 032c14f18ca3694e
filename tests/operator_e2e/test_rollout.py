"""Make-before-break rollouts of a new KV generation in the real operator, against the API emulator.

The emulator runs without its fake controllers: the test plays kubelet and Deployment controller
(`Kubelet`). A Deployment's pods appear not ready when its spec.replicas grows, become ready one at
a time when the test says so, and are gone at once when spec.replicas shrinks. A watcher thread
follows every Deployment event, keeps the timeline (when each pool came, grew, shrank and went) and
checks on every event that some generation has a ready prefill and a ready decode worker.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from testkit.emulator.client import EmulatorClient
from testkit.emulator.fixtures import EmulatorProcess, Kubectl
from testkit.operator import NAMESPACE, OperatorProcess, eventually, operator_on_emulator, worker_pool, worker_pools

pytestmark = [pytest.mark.emulator, pytest.mark.slow]
IDEP = ("splitserve.io/v1alpha1", "inferencedeployments")
GENERATION = "splitserve.io/generation"
ROLE = "splitserve.io/role"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmulatorProcess, OperatorProcess]]:
    # Nothing here reads telemetry: the diagnosis only adds status writes.
    env = {"SPLITSERVE_DIAGNOSIS_INTERVAL_SECONDS": "600"}
    workdir = tmp_path_factory.mktemp("rollout")
    with operator_on_emulator(workdir, env=env, fake_controllers=False, log_tail=3000) as cluster:
        yield cluster


def create(client: EmulatorClient, name: str, revision: str, **spec: Any) -> None:
    body = {
        "model": {"name": "tiny", "source": {"huggingFace": {"repo": "org/tiny", "revision": revision}}},
        "prefill": {"replicas": 2},
        "decode": {"replicas": 2},
        "rollout": {"prefill": {"maxSurge": 1}, "decode": {"maxSurge": 1}},
        **spec,
    }
    client.create(
        {
            "apiVersion": IDEP[0],
            "kind": "InferenceDeployment",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": body,
        }
    )


def revise(client: EmulatorClient, name: str, revision: str) -> None:
    patch = {"spec": {"model": {"source": {"huggingFace": {"revision": revision}}}}}
    client.patch(*IDEP, name, patch, namespace=NAMESPACE)


def status(client: EmulatorClient, name: str) -> dict[str, Any]:
    return client.get(*IDEP, name, namespace=NAMESPACE).get("status") or {}


def condition(client: EmulatorClient, name: str, kind: str) -> tuple[str, str]:
    found: dict[str, str] = next((c for c in status(client, name).get("conditions", []) if c["type"] == kind), {})
    return found.get("status", ""), found.get("reason", "")


def events(client: EmulatorClient, name: str, reason: str) -> list[dict[str, Any]]:
    return [
        event
        for event in client.list("v1", "events", namespace=NAMESPACE)
        if event.get("reason") == reason and event.get("involvedObject", {}).get("name") == name
    ]


def pools_of(client: EmulatorClient, name: str, generation: str) -> dict[str, dict[str, Any]]:
    """One generation's worker Deployments, by role."""
    return {
        d["metadata"]["labels"][ROLE]: d
        for d in worker_pools(client, name)
        if d["metadata"]["labels"].get(GENERATION) == generation
    }


@dataclass
class Kubelet:
    """What the kubelet and the Deployment controller would report, played by the test."""

    client: EmulatorClient
    name: str

    def _patch(self, deployment: dict[str, Any], status: dict[str, Any]) -> None:
        self.client.patch(
            "apps/v1",
            "deployments",
            deployment["metadata"]["name"],
            {"status": status},
            namespace=NAMESPACE,
            subresource="status",
        )

    def sync(self) -> None:
        """Pods follow spec.replicas: new ones start not ready, removed ones are gone at once. The
        router is always ready (not what these tests are about)."""
        selector = f"splitserve.io/deployment={self.name}"
        for d in self.client.list("apps/v1", "deployments", namespace=NAMESPACE, label_selector=selector):
            wanted = int(d["spec"].get("replicas", 1))
            current = d.get("status") or {}
            is_worker = d["metadata"]["labels"].get(ROLE) != "router"
            ready = min(int(current.get("readyReplicas", 0)), wanted) if is_worker else wanted
            status = {
                "replicas": wanted,
                "readyReplicas": ready,
                "availableReplicas": ready,
                "updatedReplicas": wanted,
                "observedGeneration": d["metadata"]["generation"],
            }
            if any(current.get(key, 0) != value for key, value in status.items()):
                self._patch(d, status)

    def ready_one(self, deployment: dict[str, Any]) -> None:
        current = deployment.get("status") or {}
        ready = min(int(current.get("replicas", 0)), int(current.get("readyReplicas", 0)) + 1)
        self._patch(deployment, {**current, "readyReplicas": ready, "availableReplicas": ready})

    def all_ready(self) -> None:
        self.sync()
        for d in worker_pools(self.client, self.name):
            wanted = int(d["spec"].get("replicas", 1))
            self._patch(d, {**(d.get("status") or {}), "readyReplicas": wanted, "availableReplicas": wanted})

    def not_ready(self, deployment: dict[str, Any]) -> dict[str, Any] | None:
        return deployment if int((deployment.get("status") or {}).get("replicas", 0)) > ready_of(deployment) else None


def ready_of(deployment: dict[str, Any]) -> int:
    return int((deployment.get("status") or {}).get("readyReplicas", 0))


@dataclass
class Watcher:
    """Every Deployment event of one InferenceDeployment: the timeline, and a check on each event that
    some generation has a ready prefill and a ready decode worker (armed once one has)."""

    url: str
    name: str
    started: float = field(default_factory=time.monotonic)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    state: dict[str, dict[str, Any]] = field(default_factory=dict)
    armed: bool = False
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> Watcher:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        params = {"watch": "true", "labelSelector": f"splitserve.io/deployment={self.name}", "timeoutSeconds": "120"}
        path = f"{self.url}/apis/apps/v1/namespaces/{NAMESPACE}/deployments"
        with httpx.Client(timeout=httpx.Timeout(5.0, read=1.0)) as http:
            while not self._stop.is_set():
                try:
                    with http.stream("GET", path, params=params) as response:
                        for line in response.iter_lines():
                            if line:
                                event = json.loads(line)
                                self._event(event)
                                params["resourceVersion"] = event["object"]["metadata"]["resourceVersion"]
                            if self._stop.is_set():
                                return
                except httpx.ReadTimeout:
                    continue  # quiet for a second: look at the stop flag, then watch on from the last event

    def _event(self, event: dict[str, Any]) -> None:
        obj = event["object"]
        labels = obj["metadata"].get("labels") or {}
        role = labels.get(ROLE)
        if role in (None, "router"):
            return
        name = obj["metadata"]["name"]
        row = {
            "t": round(time.monotonic() - self.started, 2),
            "event": event["type"],
            "deployment": name,
            "generation": labels.get(GENERATION, "legacy"),
            "role": role,
            "replicas": int(obj.get("spec", {}).get("replicas", 1)),
            "ready": ready_of(obj),
            "pods": int((obj.get("status") or {}).get("replicas", 0)),
        }
        with self._lock:
            previous = self.state.get(name)
            if event["type"] == "DELETED":
                self.state.pop(name, None)
            else:
                self.state[name] = row
            # The initial listing repeats what is known: keep only what changed.
            key = ("replicas", "ready", "pods")
            if event["type"] != "MODIFIED" or previous is None or any(previous[k] != row[k] for k in key):
                self.timeline.append(row)
            paired = self._paired()
            if paired:
                self.armed = True
            elif self.armed:
                self.violations.append(f"t={row['t']}: no generation with a ready pair after {row}: {self.state}")

    def _paired(self) -> bool:
        ready: dict[str, set[str]] = {}
        for row in self.state.values():
            if row["ready"] >= 1:
                ready.setdefault(row["generation"], set()).add("decode" if row["role"] == "aggregated" else row["role"])
        return any({"prefill", "decode"} <= roles for roles in ready.values())

    def rows(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.timeline)


def print_timeline(rows: list[dict[str, Any]], path: Path, notes: list[dict[str, Any]]) -> None:
    path.write_text(json.dumps({"deployments": rows, "status": notes}, indent=1))
    print(f"\nrollout timeline (also in {path}):")
    print(f"{'t (s)':>7}  {'event':<8} {'deployment':<28} {'replicas':>8} {'ready':>5} {'pods':>4}")
    for row in rows:
        print(
            f"{row['t']:>7.2f}  {row['event']:<8} {row['deployment']:<28} {row['replicas']:>8} {row['ready']:>5} "
            f"{row['pods']:>4}"
        )
    print("status:")
    for note in notes:
        print(f"{note['t']:>7.2f}  Progressing={note['progressing']:<22} rollout={note['rollout']}")


def snapshot(client: EmulatorClient, name: str) -> list[tuple[str, int, int]]:
    return [(d["metadata"]["name"], int(d["spec"].get("replicas", 1)), ready_of(d)) for d in worker_pools(client, name)]


async def drive(
    client: EmulatorClient,
    kubelet: Kubelet,
    name: str,
    generation: str,
    done: Any,
    watcher: Watcher | None = None,
    notes: list[dict[str, Any]] | None = None,
    limit_s: float = 60.0,
) -> None:
    """Play kubelet until `done()`: sync the pods, make one not-ready worker of `generation` ready
    (prefill and decode in turn), wait for the operator's answer (a changed Deployment), repeat."""
    deadline = time.monotonic() + limit_s
    turn = 0
    while not done():
        assert time.monotonic() < deadline, f"the rollout did not finish: {snapshot(client, name)}"
        kubelet.sync()
        if notes is not None and watcher is not None:
            observed = status(client, name)
            note = {
                "t": round(time.monotonic() - watcher.started, 2),
                "progressing": "/".join(condition(client, name, "Progressing")),
                "rollout": (observed.get("rollout") or {}).get("summary", "-"),
            }
            if not notes or (notes[-1]["progressing"], notes[-1]["rollout"]) != (note["progressing"], note["rollout"]):
                notes.append(note)
        pools = pools_of(client, name, generation)
        waiting = [d for role in ("prefill", "decode") if (d := pools.get(role)) and kubelet.not_ready(d)]
        if not waiting:
            await asyncio.sleep(0.2)  # pods that went, or the operator still to answer the last step
            continue
        kubelet.ready_one(waiting[turn % len(waiting)])
        turn += 1
        # The operator's answer to a worker becoming ready: a Deployment resized, created or deleted.
        before = snapshot(client, name)
        for _ in range(20):
            await asyncio.sleep(0.1)
            if snapshot(client, name) != before or done():
                break


async def serving(client: EmulatorClient, kubelet: Kubelet, name: str, roles: int = 2) -> str:
    """Wait for the first generation's pools, make them ready; returns the generation."""
    await eventually(lambda: len(worker_pools(client, name)) == roles, "the worker pools", every_s=0.1)
    kubelet.all_ready()
    await eventually(lambda: condition(client, name, "Ready")[0] == "True", "Ready", every_s=0.1)
    generation: str = status(client, name)["kvGeneration"]
    return generation


async def started(client: EmulatorClient, name: str, *old: str) -> str:
    """The spec's new generation (not one of `old`), once its pools exist."""
    new: str = await eventually(
        lambda: (g := status(client, name).get("kvGeneration")) not in old and g, "a new kvGeneration", every_s=0.1
    )
    await eventually(lambda: len(pools_of(client, name, new)) == 2, "the new pools", every_s=0.1)
    return new


async def test_a_revision_change_brings_the_new_pools_up_before_the_old_go(
    cluster: tuple[EmulatorProcess, OperatorProcess], client: EmulatorClient, tmp_path: Path
) -> None:
    name = "roll"
    create(client, name, "r1")
    kubelet = Kubelet(client, name)
    old = await serving(client, kubelet, name)
    watcher = Watcher(cluster[0].url, name).start()
    notes: list[dict[str, Any]] = []
    try:
        await eventually(lambda: watcher.armed, "the watcher sees the serving pair", every_s=0.1)
        revise(client, name, "r2")
        new = await started(client, name, old)
        during = status(client, name)
        assert during["rollout"]["generation"] == new and during["rollout"]["replacing"] == [old]
        assert condition(client, name, "Progressing") == ("True", "RollingOut")
        assert [(g["id"], g["state"]) for g in during["generations"]] == [(new, "RollingOut"), (old, "Serving")]
        assert any("model.source" in change for change in during["generations"][0]["changed"])

        def finished() -> bool:
            pools = worker_pools(client, name)
            return {d["metadata"]["labels"][GENERATION] for d in pools} == {new} and all(
                ready_of(d) == d["spec"]["replicas"] == 2 for d in pools
            )

        await drive(client, kubelet, name, new, finished, watcher, notes)
        await eventually(lambda: condition(client, name, "Progressing") == ("False", "Stable"), "Stable", every_s=0.1)
        await asyncio.sleep(0.5)  # the watcher's last events
    finally:
        watcher.stop()
    rows = watcher.rows()
    notes.append({"t": round(time.monotonic() - watcher.started, 2), "progressing": "False/Stable", "rollout": "-"})
    print_timeline(rows, tmp_path / "rollout-timeline.json", notes)
    assert not watcher.violations, watcher.violations

    def first(predicate: Any) -> float:
        return float(next(row["t"] for row in rows if predicate(row)))

    old_names = {f"{name}-{role}-{old}" for role in ("prefill", "decode")}
    new_names = {f"{name}-{role}-{new}" for role in ("prefill", "decode")}
    # Created first: both new pools exist before either old one shrinks.
    created = max(first(lambda r, n=n: r["deployment"] == n and r["event"] == "ADDED") for n in new_names)
    shrank = first(lambda r: r["deployment"] in old_names and r["replicas"] < 2)
    assert created < shrank
    # Deleted last: only once the new pools serve at target and the old ones have no replica and no pod.
    for gone in old_names:
        deleted = first(lambda r, g=gone: r["deployment"] == g and r["event"] == "DELETED")
        before = [row for row in rows if row["t"] <= deleted]
        last_old = [row for row in before if row["deployment"] == gone and row["event"] != "DELETED"][-1]
        assert (last_old["replicas"], last_old["pods"]) == (0, 0), last_old
        for pool in new_names:
            last_new = [row for row in before if row["deployment"] == pool][-1]
            assert (last_new["replicas"], last_new["ready"]) == (2, 2), last_new
    # Step by step: never more than maxSurge (1) new workers of a pool loading at once.
    assert all(row["replicas"] - row["ready"] <= 1 for row in rows if row["deployment"] in new_names)
    assert {d["metadata"]["name"] for d in worker_pools(client, name)} == new_names
    final = status(client, name)
    assert "rollout" not in final and final["kvGeneration"] == new
    assert [(g["id"], g["state"], g["trafficShare"]) for g in final["generations"]] == [(new, "Serving", 1.0)]
    assert condition(client, name, "Ready") == ("True", "AllComponentsReady")
    assert final["prefill"]["summary"] == final["decode"]["summary"] == "2/2"
    assert "RollingOut" in {note["progressing"].split("/")[1] for note in notes}
    (started_event,) = events(client, name, "RolloutStarted")
    assert new in started_event["message"] and old in started_event["message"]
    await eventually(lambda: events(client, name, "RolloutComplete"), "a RolloutComplete Event", every_s=0.1)
    client.delete(*IDEP, name, namespace=NAMESPACE)


async def half_rolled(client: EmulatorClient, kubelet: Kubelet, name: str, old: str, new: str) -> None:
    """The new generation has a ready pair; the old has given up one worker per pool."""
    for role in ("prefill", "decode"):
        kubelet.sync()
        kubelet.ready_one(pools_of(client, name, new)[role])
    await eventually(
        lambda: all(d["spec"]["replicas"] == 1 for d in pools_of(client, name, old).values()),
        "the old pools shrink by one",
        every_s=0.1,
    )
    kubelet.sync()


async def test_a_revert_mid_rollout_reuses_the_old_pools_and_drains_the_new(client: EmulatorClient) -> None:
    name = "revert"
    create(client, name, "r1")
    kubelet = Kubelet(client, name)
    old = await serving(client, kubelet, name)
    uids = {d["metadata"]["name"]: d["metadata"]["uid"] for d in worker_pools(client, name)}
    revise(client, name, "r2")
    new = await started(client, name, old)
    await half_rolled(client, kubelet, name, old, new)

    revise(client, name, "r1")
    await eventually(lambda: (status(client, name).get("rollout") or {}).get("generation") == old, "the revert")
    reverted = await eventually(lambda: events(client, name, "RolloutReverted"), "a RolloutReverted Event")
    assert old in reverted[0]["message"] and new in reverted[0]["message"]
    # The old pools, the same objects (name and uid), grow back; the new ones drain and go.
    await drive(client, kubelet, name, old, lambda: not pools_of(client, name, new))
    assert {d["metadata"]["name"]: d["metadata"]["uid"] for d in worker_pools(client, name)} == uids
    assert all(d["spec"]["replicas"] == ready_of(d) == 2 for d in worker_pools(client, name))
    await eventually(lambda: "rollout" not in status(client, name), "the rollout over")
    assert status(client, name)["kvGeneration"] == old
    client.delete(*IDEP, name, namespace=NAMESPACE)


async def test_a_pause_puts_traffic_back_on_the_old_until_the_spec_changes(
    cluster: tuple[EmulatorProcess, OperatorProcess], client: EmulatorClient
) -> None:
    name = "pause"
    create(client, name, "r1")
    kubelet = Kubelet(client, name)
    old = await serving(client, kubelet, name)
    revise(client, name, "r2")
    new = await started(client, name, old)
    await half_rolled(client, kubelet, name, old, new)

    # What the rollout analysis writes on a regression.
    message = "error rate 0.300 vs 0.010 over 300s (+0.290 > 0.020)"
    pause = {"rollout": {"generation": new, "paused": True, "reason": "RolloutPaused", "message": message}}
    client.patch(*IDEP, name, {"status": pause}, namespace=NAMESPACE, subresource="status")
    await eventually(
        lambda: (
            all(d["spec"]["replicas"] == 0 for d in pools_of(client, name, new).values())
            and all(d["spec"]["replicas"] == 2 for d in pools_of(client, name, old).values())
        ),
        "the new generation at 0, the old back at 2",
        every_s=0.1,
    )
    kubelet.sync()
    await eventually(lambda: condition(client, name, "Progressing") == ("False", "RolloutPaused"), "RolloutPaused")
    paused = await eventually(lambda: events(client, name, "RolloutPaused"), "a RolloutPaused Event")
    assert paused[0]["type"] == "Warning" and message in paused[0]["message"]
    observed = status(client, name)
    assert observed["rollout"]["paused"] and observed["rollout"]["message"] == message
    assert [(g["id"], g["state"]) for g in observed["generations"]] == [(new, "Paused"), (old, "Serving")]
    output = Kubectl(cluster[0], namespace=NAMESPACE)("get", "idep", name).stdout
    header, row = output.strip().splitlines()
    assert "ROLLOUT" in header.split()
    assert f"{new} paused" in row
    # Nothing more happens while paused.
    await asyncio.sleep(1)
    assert {d["metadata"]["labels"][GENERATION] for d in worker_pools(client, name)} == {old, new}

    # A new spec generation clears the pause and starts a new rollout, the paused pools among the old.
    revise(client, name, "r3")
    third = await started(client, name, old, new)
    await eventually(lambda: condition(client, name, "Progressing") == ("True", "RollingOut"), "rolling out again")
    again = status(client, name)["rollout"]
    assert (again["generation"], again["paused"]) == (third, False) and set(again["replacing"]) == {old, new}
    assert {d["metadata"]["labels"][GENERATION] for d in worker_pools(client, name)} == {old, new, third}
    client.delete(*IDEP, name, namespace=NAMESPACE)


async def test_a_change_outside_the_generation_rolls_pods_within_it(client: EmulatorClient) -> None:
    name = "inplace"
    create(client, name, "r1", prefill={"replicas": 1}, decode={"replicas": 1})
    kubelet = Kubelet(client, name)
    generation = await serving(client, kubelet, name)
    before = {d["metadata"]["name"]: d for d in worker_pools(client, name)}
    router = client.get("apps/v1", "deployments", f"{name}-router", namespace=NAMESPACE)
    client.patch(
        *IDEP,
        name,
        {"spec": {"decode": {"extraArgs": ["--max-num-seqs", "8"]}, "router": {"admissionQueueLimit": 512}}},
        namespace=NAMESPACE,
    )

    def decode_args() -> list[str]:
        found = worker_pool(client, name, "decode") or {}
        return list(
            found.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [{}])[0].get("args", [])
        )

    await eventually(lambda: "--max-num-seqs" in decode_args(), "the decode template changed", every_s=0.1)
    await eventually(
        lambda: (
            client.get("apps/v1", "deployments", f"{name}-router", namespace=NAMESPACE)["metadata"]["generation"]
            > router["metadata"]["generation"]
        ),
        "the router template changed",
        every_s=0.1,
    )
    kubelet.sync()
    await asyncio.sleep(1)
    after = {d["metadata"]["name"]: d for d in worker_pools(client, name)}
    assert set(after) == set(before) == {f"{name}-prefill-{generation}", f"{name}-decode-{generation}"}
    assert all(after[n]["metadata"]["uid"] == before[n]["metadata"]["uid"] for n in before)
    decode = f"{name}-decode-{generation}"
    assert after[decode]["metadata"]["generation"] > before[decode]["metadata"]["generation"]  # its pods roll
    prefill = f"{name}-prefill-{generation}"
    assert after[prefill]["spec"]["template"] == before[prefill]["spec"]["template"]
    observed = status(client, name)
    assert observed["kvGeneration"] == generation and "rollout" not in observed
    assert not events(client, name, "RolloutStarted")
    client.delete(*IDEP, name, namespace=NAMESPACE)
