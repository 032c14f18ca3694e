"""`splitserve up` rolls out new versions of its deployment under load: simulators, real router, real CLI.

The simulators run with `--generation` and refuse KV pulls from another generation, and the router
names the generation that answered in `X-Splitserve-Generation`; so 0 failed requests and only known
generations in that header mean no request was split across generations and none was dropped while
workers came and went.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest

from splitserve.local.procs import is_alive
from testkit.upctl import ENDPOINT_LINE, REPO, UpRun, start_up

pytestmark = pytest.mark.slow

DISAGGREGATED = REPO / "deploy/local/tiny-disaggregated.yaml"
AGGREGATED = REPO / "deploy/local/tiny-aggregated.yaml"
GENERATION_LINE = re.compile(r"KV generation ([0-9a-f]{10})")
COMPLETE_LINE = re.compile(r"rollout complete in [\d.]+ s: generation ([0-9a-f]{10})")
APPLY_LINE = re.compile(r"splitserve up --apply FILE. while serving")


@dataclass
class Answer:
    started: float
    finished: float
    generation: str | None = None
    error: str | None = None


@dataclass
class Load:
    """Requests through the router, back to back, from a few threads, until stopped."""

    endpoint: str
    threads: int = 2
    answers: list[Answer] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _workers: list[threading.Thread] = field(default_factory=list)

    def _run(self) -> None:
        client = openai.OpenAI(base_url=self.endpoint, api_key="unused", max_retries=0, timeout=30)
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                raw = client.completions.with_raw_response.create(
                    model="tiny-llama", prompt="Hello, my name is", max_tokens=8
                )
                completion = raw.parse()
                error = None if completion.choices[0].text else "empty answer"
                answer = Answer(started, time.monotonic(), raw.headers.get("x-splitserve-generation"), error)
            except openai.OpenAIError as failure:
                answer = Answer(started, time.monotonic(), error=f"{type(failure).__name__}: {failure}")
            self.answers.append(answer)

    def __enter__(self) -> Load:
        for _ in range(self.threads):
            thread = threading.Thread(target=self._run, daemon=True)
            thread.start()
            self._workers.append(thread)
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._workers:
            thread.join(timeout=40)

    def wait_for(self, generation: str, count: int, after: float, seconds: float = 30) -> None:
        """Until `count` requests started after `after` were answered by `generation`."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if sum(a.generation == generation and a.started > after for a in list(self.answers)) >= count:
                return
            time.sleep(0.05)
        raise AssertionError(f"fewer than {count} answers of generation {generation} after {after}")


def _workers(up: UpRun) -> dict[str, tuple[int, str]]:
    """name -> (pid, generation) of the workers in run.json."""
    return {
        str(entry["name"]): (int(str(entry["pid"])), str(entry.get("generation", "")))
        for entry in up.process_state()
        if entry["name"] != "router"
    }


def _wait_gone(pids: set[int], seconds: float = 10) -> set[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(is_alive(pid) for pid in pids):
        time.sleep(0.05)
    return {pid for pid in pids if is_alive(pid)}


def _apply(file: Path, run_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "splitserve", "up", "--apply", str(file), "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )


@dataclass
class Serving:
    up: UpRun
    served: Path  # the deployment file the stack runs (a test edits it)
    original: str  # its text at the start
    run_dir: Path
    generation: str  # the KV generation the stack started with
    endpoint: str


@contextmanager
def _serving(source: Path, tmp_path: Path) -> Iterator[Serving]:
    """`up --engine sim` on a copy of `source`, once it serves its first generation and takes --apply;
    stopped on the way out."""
    served = tmp_path / "deployment.yaml"
    original = source.read_text()
    served.write_text(original)
    run_dir = tmp_path / "run"
    up = start_up("--engine", "sim", "-f", str(served), "--port", "0", run_dir=run_dir)
    try:
        generation = up.wait_for_line(GENERATION_LINE, seconds=60).group(1)
        endpoint = up.wait_for_line(ENDPOINT_LINE, seconds=60).group(1)
        up.wait_for_line(APPLY_LINE, seconds=10)
        yield Serving(up, served, original, run_dir, generation, endpoint)
    finally:
        up.stop()


def test_new_generations_roll_out_under_load_by_apply_and_by_editing_the_file(tmp_path: Path) -> None:
    with _serving(DISAGGREGATED, tmp_path) as stack:
        up, first = stack.up, stack.generation
        generation_zero = _workers(up)
        assert {gen for _, gen in generation_zero.values()} == {first}
        endpoints = json.loads((stack.run_dir / "endpoints.json").read_text())
        assert {e["generation"] for pool in endpoints["pools"].values() for e in pool} == {first}

        with Load(stack.endpoint) as load:
            load.wait_for(first, 5, after=0)

            # 1. `up --apply FILE`: a new block size is a new KV generation.
            block_size = tmp_path / "block-size.yaml"
            block_size.write_text(stack.original.replace("extraArgs:", "blockSize: 32\n    extraArgs:", 1))
            applied_at = time.monotonic()
            result = _apply(block_size, stack.run_dir)
            done_at = time.monotonic()
            assert result.returncode == 0, result.stdout + result.stderr
            second = COMPLETE_LINE.search(result.stdout)
            assert second is not None, result.stdout
            second_id = second.group(1)
            assert second_id != first
            assert f"rollout: generation {first} -> {second_id} (engine.blockSize: null -> 32)" in result.stdout
            assert "new workers ready: prefill-1, decode-1" in result.stdout
            assert "old workers drained: prefill-0, decode-0" in result.stdout
            assert up.wait_for_line(COMPLETE_LINE, seconds=10).group(1) == second_id, "the stack says so too"
            assert _wait_gone({pid for pid, _ in generation_zero.values()}) == set(), "old workers must exit"
            generation_one = _workers(up)
            assert set(generation_one) == {"prefill-1", "decode-1"}
            assert {gen for _, gen in generation_one.values()} == {second_id}
            load.wait_for(second_id, 5, after=done_at)

            # 2. Editing the file the stack runs: another model source (a new revision of the weights).
            edited_at = time.monotonic()
            stack.served.write_text(
                block_size.read_text().replace("uri: splitserve://tiny-model", f"uri: {tmp_path / 'model-b'}")
            )
            up.wait_for_line(re.compile(rf"rollout: generation {second_id} -> \w+ \(model\.source: "), seconds=30)
            third_id = up.wait_for_line(COMPLETE_LINE, seconds=60).group(1)
            edit_done_at = time.monotonic()
            assert third_id not in (first, second_id)
            assert _wait_gone({pid for pid, _ in generation_one.values()}) == set()
            generation_two = _workers(up)
            assert set(generation_two) == {"prefill-2", "decode-2"}
            assert {gen for _, gen in generation_two.values()} == {third_id}
            load.wait_for(third_id, 5, after=edit_done_at)

            # 3. An invalid file, applied or written: reported, and the stack keeps serving.
            bad = tmp_path / "bad.yaml"
            bad.write_text(stack.original.replace("mode: disaggregated", "mode: disaggregated\n  colour: blue"))
            result = _apply(bad, stack.run_dir)
            assert result.returncode == 1
            assert "not applied, still serving generation " + third_id in result.stdout
            assert "colour" in result.stdout and "not applied: 1 problem(s)" in result.stderr
            assert "Traceback" not in result.stdout + result.stderr
            stack.served.write_text("spec: [not, a, deployment\n")
            up.wait_for_line(re.compile(rf"deployment\.yaml: not applied, still serving generation {third_id}"), 30)
            bad_done_at = time.monotonic()
            load.wait_for(third_id, 5, after=bad_done_at)
            assert _workers(up) == generation_two, "nothing restarted"
        assert up.popen.poll() is None, "the stack still runs"
    assert up.popen.returncode == 0, up.stderr()

    answers = load.answers
    failed = [answer for answer in answers if answer.error is not None]
    assert failed == [], f"{len(failed)} of {len(answers)} requests failed, first: {failed[0].error}"
    generations = [answer.generation for answer in answers]
    assert set(generations) <= {first, second_id, third_id}, "every answer names a generation that was served"
    assert all(a.generation == first for a in answers if a.finished < applied_at)
    assert all(a.generation == second_id for a in answers if done_at < a.started and a.finished < edited_at)
    assert all(a.generation == third_id for a in answers if a.started > edit_done_at)
    counts = {gen: generations.count(gen) for gen in (first, second_id, third_id)}
    assert all(counts.values()), counts


def test_replica_counts_change_in_place_within_the_generation(tmp_path: Path) -> None:
    with _serving(AGGREGATED, tmp_path) as stack:
        up, generation, original = stack.up, stack.generation, stack.original
        with Load(stack.endpoint) as load:
            load.wait_for(generation, 3, after=0)
            two = tmp_path / "two.yaml"
            two.write_text(
                re.sub(r"replicas: 1\n(\s+)minReplicas: 1\n(\s+)maxReplicas: 1", r"replicas: 2\n\1minReplicas: 1\n"
                       r"\2maxReplicas: 2", original, count=1)
            )  # fmt: skip
            assert "replicas: 2" in two.read_text()
            result = _apply(two, stack.run_dir)
            assert result.returncode == 0, result.stdout + result.stderr
            assert f"replicas: aggregated 1 -> 2 (generation {generation}, in place)" in result.stdout
            assert "new workers ready: worker-1" in result.stdout
            assert "no effect on local processes: decode.maxReplicas: 1 -> 2" in result.stdout
            assert "rollout:" not in result.stdout
            workers = _workers(up)
            assert set(workers) == {"worker-0", "worker-1"}
            assert {gen for _, gen in workers.values()} == {generation}
            added = time.monotonic()
            load.wait_for(generation, 5, after=added)

            stack.served.write_text(original)  # back to one: the newest worker drains and stops
            up.wait_for_line(re.compile(r"replicas applied in [\d.]+ s: aggregated 2 -> 1"), seconds=30)
            assert _wait_gone({workers["worker-1"][0]}) == set()
            assert set(_workers(up)) == {"worker-0"}
            assert is_alive(workers["worker-0"][0])
            load.wait_for(generation, 5, after=time.monotonic())
    assert up.popen.returncode == 0, up.stderr()
    assert [a.error for a in load.answers if a.error] == []
    assert {a.generation for a in load.answers} == {generation}


def test_apply_without_a_running_stack_is_one_clear_line(tmp_path: Path) -> None:
    result = _apply(DISAGGREGATED, tmp_path)
    assert result.returncode == 1
    assert f"no running `splitserve up` in {tmp_path}" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_change_that_comes_during_a_rollout_is_applied_after_it(tmp_path: Path) -> None:
    with _serving(DISAGGREGATED, tmp_path) as stack:
        up, first, original, run_dir = stack.up, stack.generation, stack.original, stack.run_dir
        fp16 = tmp_path / "fp16.yaml"
        fp16.write_text(original.replace("dtype: float32", "dtype: float16"))
        applying = subprocess.Popen(
            [sys.executable, "-m", "splitserve", "up", "--apply", str(fp16), "--run-dir", str(run_dir)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        # The file is saved once the --apply request is in, so the rollout it asks for comes second.
        deadline = time.monotonic() + 30
        while not list((run_dir / "apply").glob("*.json")) and not list((run_dir / "apply").glob("*.out")):
            assert time.monotonic() < deadline and applying.poll() is None, "the request never came"
            time.sleep(0.01)
        stack.served.write_text(original.replace("maxModelLen: 2048", "maxModelLen: 1024"))
        rollout = re.compile(r"rollout: generation (\w+) -> (\w+) \((.*)\)")
        one = up.wait_for_line(rollout, seconds=30)
        assert (one.group(1), one.group(3)) == (first, "model.dtype: float32 -> float16")
        assert up.wait_for_line(COMPLETE_LINE, seconds=60).group(1) == one.group(2)
        two = up.wait_for_line(rollout, seconds=30)
        assert two.group(1) == one.group(2), "the second change starts from the first one's generation"
        assert two.group(3) == "model.dtype: float16 -> float32; model.maxModelLen: 2048 -> 1024"
        assert up.wait_for_line(COMPLETE_LINE, seconds=60).group(1) == two.group(2)
        out, err = applying.communicate(timeout=30)  # reads and closes its pipes
        assert applying.returncode == 0, out + err
        assert {gen for _, gen in _workers(up).values()} == {two.group(2)}
