"""Many simulators in one process, and the CLI."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import aiohttp
from sim_helpers import fast_config, post

from splitserve.sim import Role, SimConfig, SimFleet, generate_text, tokenize


async def test_thirty_sims_in_one_process_start_and_answer(http: aiohttp.ClientSession) -> None:
    configs = [fast_config(role=Role.AGGREGATED, model=f"m{i % 3}") for i in range(30)]
    async with SimFleet(configs) as fleet:
        assert len(set(fleet.urls)) == 30
        replies = await asyncio.gather(
            *(
                post(http, w.url + "/v1/completions", {"model": w.config.model, "prompt": f"hi {i}", "max_tokens": 8})
                for i, w in enumerate(fleet.workers)
            )
        )
    for i, (status, body) in enumerate(replies):
        assert status == 200
        assert body["choices"][0]["text"] == generate_text(tokenize(f"hi {i}"), 8)


async def test_replicas_get_distinct_engine_ids_and_ports() -> None:
    async with SimFleet.replicas(fast_config(role="prefill"), 4) as fleet:  # type: ignore[arg-type]
        assert all(w.role is Role.PREFILL for w in fleet.workers)
        assert len({w.engine_id for w in fleet.workers}) == 4
        assert len({w.port for w in fleet.workers}) == 4


def _cli(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "splitserve", "sim-worker", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def test_cli_serves_and_drains_on_sigterm() -> None:
    # `with`: its pipes are closed on the way out.
    with _cli("--role", "decode", "--port", "0", "--count", "2", "--time-scale", "0.1", "--model", "tiny") as process:
        try:
            assert process.stdout is not None
            ready = [json.loads(process.stdout.readline()) for _ in range(2)]
            assert [r["event"] for r in ready] == ["ready", "ready"] and {r["role"] for r in ready} == {"decode"}

            async def ask() -> tuple[int, object]:
                async with aiohttp.ClientSession() as session:
                    return await post(session, ready[1]["url"] + "/v1/completions", {"prompt": "x y", "max_tokens": 3})

            status, body = asyncio.run(ask())
            assert status == 200 and body["model"] == "tiny"  # type: ignore[index]
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=20) == 0
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()


def test_cli_rejects_bad_config_with_one_line() -> None:
    process = _cli("--port", "0", "--num-kv-blocks", "1")
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 2
    assert stderr.strip().count("\n") == 0 and "cannot hold one request" in stderr


def test_config_from_profile_rejects_unknown_profile() -> None:
    try:
        SimConfig.from_profile("tpu-v9")
    except ValueError as error:
        assert "cpu-tiny" in str(error)
    else:
        raise AssertionError("unknown profile accepted")
