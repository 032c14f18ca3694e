"""The pieces of `up`'s rollouts without processes: what a new file changes, the endpoints file and the
router's report, the --apply hand-over, the file watch and the local generation."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from splitserve.api.spec import DEFAULT_WORKER_IMAGE
from splitserve.api.topology import Owner
from splitserve.builders.target import Target
from splitserve.local.changes import Change, describe_change, with_replicas
from splitserve.local.control import ControlChannel, FileWatch, NoStack, StackInfo, find_stack, follow, submit
from splitserve.local.deployment import TINY_MODEL_URI, LocalDeployment, parse_deployment
from splitserve.local.endpoints import EndpointsFile, all_healthy, drained, inflight_on
from splitserve.local.plan import ProcessSpec, local_generation
from splitserve.router.discovery_file import read_endpoints_file


def _deployment(name: str = "t", **spec: Any) -> LocalDeployment:
    """A small valid deployment; each keyword is merged into its top-level spec section."""
    base: dict[str, Any] = {
        "model": {"name": "tiny", "source": {"uri": TINY_MODEL_URI}},
        "mode": "disaggregated",
        "prefill": {"replicas": 1, "minReplicas": 0, "maxReplicas": 4},
        "decode": {"replicas": 1, "minReplicas": 1, "maxReplicas": 4},
    }
    for key, value in spec.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    document = {"apiVersion": "splitserve.io/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": name}}
    return parse_deployment(yaml.safe_dump({**document, "spec": base}))


def _change(before: LocalDeployment, after: LocalDeployment) -> Change:
    return describe_change(
        before, before, after, local_generation(before, "/m/tiny"), local_generation(after, "/m/tiny")
    )


# --------------------------------------------------------------------------- what a file changes


def test_a_generation_field_is_a_rollout_and_says_what_changed() -> None:
    before = _deployment()
    change = _change(before, _deployment(engine={"blockSize": 32}))
    assert change.new_generation and not change.refused
    assert change.generation_changes == ("engine.blockSize: null -> 32",)
    assert change.worker_settings == () and change.needs_restart == ()


def test_replica_counts_change_in_place_and_bounds_have_no_local_effect() -> None:
    change = _change(_deployment(), _deployment(decode={"replicas": 3, "maxReplicas": 5}))
    assert not change.new_generation and change.replicas == {"decode": (1, 3)}
    assert change.no_local_effect == ("decode.maxReplicas: 4 -> 5",)
    assert not change.applies_nothing


def test_router_and_worker_settings_need_a_restart_unless_a_new_generation_brings_new_workers() -> None:
    before = _deployment()
    same_generation = _change(before, _deployment(router={"admissionQueueLimit": 7}, engine={"maxNumSeqs": 8}))
    assert same_generation.needs_restart == (
        "router.admissionQueueLimit: 1024 -> 7",
        "engine.maxNumSeqs: null -> 8",
    )
    assert same_generation.applies_nothing
    rolled = _change(before, _deployment(router={"admissionQueueLimit": 7}, engine={"maxNumSeqs": 8, "blockSize": 32}))
    assert rolled.needs_restart == ("router.admissionQueueLimit: 1024 -> 7",), "the new workers take engine settings"


def test_extra_args_count_for_the_generation_only_through_their_kv_flags() -> None:
    before = _deployment(engine={"extraArgs": ["--enforce-eager"]})
    revision = _change(before, _deployment(engine={"extraArgs": ["--enforce-eager", "--revision", "b"]}))
    assert revision.new_generation and revision.worker_settings == ()
    other = _change(before, _deployment(engine={"extraArgs": ["--max-num-batched-tokens", "64"]}))
    assert not other.new_generation
    assert other.worker_settings == ('engine.extraArgs: ["--enforce-eager"] -> ["--max-num-batched-tokens","64"]',)


@pytest.mark.parametrize(
    ("after", "refusal"),
    [
        (_deployment(mode="aggregated"), "spec.mode cannot change in a running stack"),
        (_deployment(model={"name": "other"}), "spec.model.name cannot change in a running stack"),
        (_deployment(name="other"), "metadata.name is 'other', the stack runs 't'"),
    ],
)
def test_mode_model_name_and_deployment_name_are_refused(after: LocalDeployment, refusal: str) -> None:
    change = _change(_deployment(), after)
    assert any(refusal in reason for reason in change.refused), change.refused


def test_with_replicas_keeps_everything_else() -> None:
    running = _deployment(engine={"maxNumSeqs": 8})
    scaled = with_replicas(running, {"decode": 3})
    assert (scaled.spec.prefill.replicas, scaled.spec.decode.replicas) == (1, 3)
    assert scaled.spec.engine.max_num_seqs == 8 and scaled.document["spec"]["decode"]["replicas"] == 3
    assert running.spec.decode.replicas == 1, "the original is untouched"
    aggregated = with_replicas(_deployment(mode="aggregated"), {"aggregated": 2})
    assert aggregated.spec.decode.replicas == 2


# --------------------------------------------------------------------------- the local generation


def test_the_local_generation_covers_the_model_location_up_resolves() -> None:
    deployment = _deployment()
    assert local_generation(deployment, "/m/a")[0] == local_generation(deployment, "/m/a")[0]
    assert local_generation(deployment, "/m/a")[0] != local_generation(deployment, "/m/b")[0]
    assert local_generation(deployment, "/m/a")[1]["model.source"] == {"uri": "/m/a"}
    # Any other source is the cluster's generation for the same file.
    real = _deployment(model={"name": "tiny", "source": {"huggingFace": {"repo": "org/m", "revision": "v2"}}})
    assert local_generation(real, "org/m")[0] == Target(Owner("t", "default"), real.spec).generation
    assert Target(Owner("t", "default"), real.spec).images.worker == DEFAULT_WORKER_IMAGE


# --------------------------------------------------------------------------- endpoints file and router report


def _spec(name: str, port: int, role: str, generation: str) -> ProcessSpec:
    return ProcessSpec(name=name, argv=("x",), port=port, ready_path="/health", role=role, generation=generation)


def test_the_endpoints_file_is_the_routers_format_written_whole(tmp_path: Path) -> None:
    endpoints = EndpointsFile(tmp_path / "endpoints.json")
    endpoints.add([_spec("prefill-0", 8101, "prefill", "aaaa"), _spec("decode-0", 8201, "decode", "aaaa")])
    endpoints.add([_spec("worker-1", 8202, "aggregated", "bbbb")])
    endpoints.mark_terminating(["http://127.0.0.1:8201"])
    pools = read_endpoints_file(str(endpoints.path))
    assert pools["prefill"].ready == {"http://127.0.0.1:8101"}
    assert pools["decode"].ready == {"http://127.0.0.1:8202"} and pools["decode"].terminating == {
        "http://127.0.0.1:8201"
    }
    assert pools["decode"].generations == {"http://127.0.0.1:8201": "aaaa", "http://127.0.0.1:8202": "bbbb"}
    endpoints.remove(["http://127.0.0.1:8201"])
    assert json.loads(endpoints.path.read_text())["pools"]["decode"] == [
        {"url": "http://127.0.0.1:8202", "generation": "bbbb", "state": "ready"}
    ]
    assert [path.name for path in tmp_path.iterdir()] == ["endpoints.json"], "no temporary file left"


def test_drained_means_not_routed_to_and_nothing_in_flight() -> None:
    old = ["http://127.0.0.1:1", "http://127.0.0.1:2"]

    def report(state: str, inflight: int) -> dict[str, list[dict[str, object]]]:
        return {
            "prefill": [{"url": old[0], "generation": "a", "state": "terminating", "inflight": 0}],
            "decode": [{"url": old[1], "generation": "a", "state": state, "inflight": inflight}],
        }

    assert not drained(report("healthy", 0), old), "still routed to"
    assert not drained(report("ejected", 0), old), "may come back"
    assert not drained(report("terminating", 2), old) and inflight_on(report("terminating", 2), old) == 2
    assert drained(report("terminating", 0), old) and drained(report("departing", 0), old)
    assert drained({"prefill": [], "decode": []}, old), "forgotten by the router"
    assert all_healthy(report("healthy", 0), old[1:]) and not all_healthy(report("healthy", 0), old)


# --------------------------------------------------------------------------- --apply's hand-over


def test_apply_finds_the_stack_hands_over_the_file_and_prints_its_lines(tmp_path: Path) -> None:
    registry = tmp_path / "stacks"
    info = StackInfo(pid=os.getpid(), deployment="d", file="/x.yaml", endpoint="http://e/v1", run_dir=tmp_path / "run")
    control = ControlChannel(info, registry)
    control.open()
    assert find_stack("d", None, registry) == info
    assert find_stack("ignored", tmp_path / "run", registry) == info
    with pytest.raises(NoStack, match="no running `splitserve up` serves deployment 'other'"):
        find_stack("other", None, registry)

    request_id = submit(info, Path("/new.yaml"), "text: 1\n")
    lines: list[str] = []

    def stack_side() -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            pending = control.pending()
            if pending:
                (request,) = pending
                assert (request.id, request.file, request.text) == (request_id, "/new.yaml", "text: 1\n")
                request.say("[ 1.0s] rollout: generation a -> b")
                request.say("[ 2.0s] rollout complete in 1.0 s")
                request.finish(True, "rollout complete in 1.0 s")
                return
            time.sleep(0.02)

    thread = threading.Thread(target=stack_side)
    thread.start()
    result = follow(info, request_id, lines.append, poll_seconds=0.02)
    thread.join()
    assert result.ok and result.message == "rollout complete in 1.0 s"
    assert lines == ["[ 1.0s] rollout: generation a -> b", "[ 2.0s] rollout complete in 1.0 s"]
    assert list(info.requests.iterdir()) == [], "the exchange leaves nothing behind"

    late = submit(info, Path("/late.yaml"), "")
    control.close()
    assert not (info.run_dir / "control.json").exists() and not list(registry.iterdir())
    assert json.loads((info.requests / f"{late}.result.json").read_text())["ok"] is False
    with pytest.raises(NoStack, match="no running `splitserve up` in"):
        find_stack("d", tmp_path / "run", registry)


def test_a_registry_entry_of_a_dead_stack_is_ignored_and_removed(tmp_path: Path) -> None:
    dead = StackInfo(pid=2**22 + 12345, deployment="d", file="", endpoint="", run_dir=tmp_path)
    (tmp_path / "stacks").mkdir()
    (tmp_path / "stacks" / "1.json").write_text(json.dumps(dead.document()))
    with pytest.raises(NoStack):
        find_stack("d", None, tmp_path / "stacks")
    assert not (tmp_path / "stacks" / "1.json").exists()


def test_two_stacks_of_one_deployment_need_run_dir(tmp_path: Path) -> None:
    for name in ("a", "b"):
        live = StackInfo(pid=os.getpid(), deployment="d", file="", endpoint="", run_dir=tmp_path / name)
        (tmp_path / "stacks").mkdir(exist_ok=True)
        (tmp_path / "stacks" / f"{name}.json").write_text(json.dumps(live.document()))
    with pytest.raises(NoStack, match=r"2 stacks serve deployment 'd'.*choose one with --run-dir"):
        find_stack("d", None, tmp_path / "stacks")


def test_the_file_watch_takes_a_save_once_it_settled(tmp_path: Path) -> None:
    path = tmp_path / "d.yaml"
    path.write_text("one")
    watch = FileWatch(path)
    assert watch.poll() is None, "nothing saved yet"
    path.write_text("two!")
    assert watch.poll() is None, "just changed: wait one look"
    polled = watch.poll()
    assert polled is not None and polled[1] == "two!"
    assert watch.poll() is None, "taken once"
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    watch.poll()
    assert watch.poll() == (path.stat().st_mtime_ns, "two!"), "saving unchanged applies it again"
    path.unlink()
    assert watch.poll() is None and watch.poll() is None
