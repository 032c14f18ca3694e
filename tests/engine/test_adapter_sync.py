"""The adapter sync against a stand-in for vLLM's runtime LoRA API (fake_lora_engine.py): loads and
unloads as the file changes, a failed load named with vLLM's reason and retried, a malformed file
ignored, an engine that lost its adapters refilled, Hugging Face downloads beside the rest, and the
thread `splitserve worker` runs it in."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from splitserve.engine.adapter_plan import AdaptersState
from splitserve.engine.adapters import AdapterSync, AdapterSyncThread, hub_download
from testkit.router import wait_until
from tests.engine.fake_lora_engine import BASE, FakeLoraEngine, running_fake_engine


def fast_sync(url: str, path: Path, **kwargs: Any) -> AdapterSync:
    """A sync at test speed: the file read every 30 ms, /v1/models checked every 0.3 s, retries 0.1 to 0.4 s apart."""
    fast: dict[str, Any] = {
        "file_poll_s": 0.03,
        "models_check_s": 0.3,
        "health_poll_s": 0.03,
        "retry_first_s": 0.1,
        "retry_cap_s": 0.4,
    }
    return AdapterSync(url, path, **fast, **kwargs)


def write(path: Path, *entries: dict[str, Any]) -> None:
    path.write_text(json.dumps({"adapters": list(entries)}))


@contextlib.asynccontextmanager
async def syncing(sync: AdapterSync) -> AsyncIterator[AdapterSync]:
    stop = asyncio.Event()
    task = asyncio.create_task(sync.run(stop))
    try:
        yield sync
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)


async def test_loads_what_the_file_lists_and_follows_its_changes(tmp_path: Path) -> None:
    adapters = tmp_path / "adapters.json"
    write(adapters, {"name": "a", "path": "/adapters/a"}, {"name": "b", "path": "/adapters/b"})
    states: list[AdaptersState] = []
    async with running_fake_engine(FakeLoraEngine(loadable={"/adapters/a", "/adapters/b", "/adapters/c"})) as engine:
        engine.healthy = False
        engine.loras["static"] = "/adapters/static"  # e.g. from --lora-modules: not in the file
        async with syncing(fast_sync(engine.url, adapters, on_change=states.append)) as sync:
            await wait_until(lambda: sync.state.pending == ("a", "b"))
            await asyncio.sleep(0.1)
            assert engine.calls == []  # nothing before the engine is ready
            engine.healthy = True
            await wait_until(lambda: sync.state == AdaptersState(loaded=("a", "b")))
            assert engine.loras == {"a": "/adapters/a", "b": "/adapters/b"}  # "static" unloaded: not listed

            write(adapters, {"name": "b", "path": "/adapters/b"}, {"name": "c", "path": "/adapters/c"})
            await wait_until(lambda: sync.state == AdaptersState(loaded=("b", "c")))
            assert engine.loras == {"b": "/adapters/b", "c": "/adapters/c"}

            write(adapters, {"name": "b", "path": "/adapters/c"})  # same name, another path: in place
            await wait_until(lambda: engine.loras == {"b": "/adapters/c"})
            assert engine.calls_to("load")[-1] == {"lora_name": "b", "lora_path": "/adapters/c", "load_inplace": True}
            await wait_until(lambda: sync.state == AdaptersState(loaded=("b",)))
    assert BASE not in [body["lora_name"] for body in engine.calls_to("unload")]
    assert states[0] == AdaptersState(pending=("a", "b"))
    assert AdaptersState(loaded=("a", "b")) in states


async def test_a_failed_load_is_named_with_vllms_reason_retried_and_then_loaded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    adapters = tmp_path / "adapters.json"
    write(adapters, {"name": "good", "path": "/adapters/good"}, {"name": "bad", "path": "/adapters/bad"})
    async with (
        running_fake_engine(FakeLoraEngine(loadable={"/adapters/good"})) as engine,
        syncing(fast_sync(engine.url, adapters)) as sync,
    ):
        reason = "Loading lora bad failed: No adapter found for /adapters/bad"
        await wait_until(lambda: sync.state == AdaptersState(loaded=("good",), failed={"bad": reason}))
        await wait_until(lambda: len(engine.calls_to("load")) >= 4)  # "good" once, then "bad" retried
        lines = [
            r.getMessage() for r in caplog.records if r.name == "splitserve.engine.adapters" and "bad" in r.message
        ]
        assert lines.count(f"adapter bad: cannot load from /adapters/bad: {reason}") == 1  # one line, not one a try
        # Backing off: over 1 s, tries 0.1, 0.2, 0.4, 0.4 ... s apart, not one every file poll (0.03 s).
        tries = len(engine.calls_to("load"))
        await asyncio.sleep(1.0)
        assert len(engine.calls_to("load")) - tries <= 5
        assert engine.loras == {"good": "/adapters/good"}  # the engine kept serving the rest

        engine.loadable.add("/adapters/bad")  # e.g. the volume is populated
        await wait_until(lambda: sync.state == AdaptersState(loaded=("bad", "good")), within=3)


async def test_a_malformed_file_keeps_the_last_good_list(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    adapters = tmp_path / "adapters.json"
    write(adapters, {"name": "a", "path": "/adapters/a"})
    async with (
        running_fake_engine(FakeLoraEngine(loadable={"/adapters/a", "/adapters/b"})) as engine,
        syncing(fast_sync(engine.url, adapters)) as sync,
    ):
        await wait_until(lambda: sync.state == AdaptersState(loaded=("a",)))
        adapters.write_text('{"adapters": [{"name": "b"')
        await asyncio.sleep(0.4)  # past a /v1/models check
        adapters.write_text('{"adapters": [{"name": "b"}]}')  # no source: still malformed
        await asyncio.sleep(0.2)
        assert engine.loras == {"a": "/adapters/a"} and sync.state == AdaptersState(loaded=("a",))
        problems = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(problems) == 2, problems  # one line for each bad content, not one per poll
        assert "not valid JSON" in problems[0] and "keeping the last good list" in problems[0]
        assert "adapters[0] (b): give exactly one of path, huggingFace" in problems[1]

        write(adapters, {"name": "b", "path": "/adapters/b"})
        await wait_until(lambda: engine.loras == {"b": "/adapters/b"})


async def test_an_engine_that_lost_its_adapters_gets_them_back(tmp_path: Path) -> None:
    adapters = tmp_path / "adapters.json"
    write(adapters, {"name": "a", "path": "/adapters/a"})
    async with (
        running_fake_engine(FakeLoraEngine(loadable={"/adapters/a"})) as engine,
        syncing(fast_sync(engine.url, adapters)) as sync,
    ):
        await wait_until(lambda: sync.state == AdaptersState(loaded=("a",)))
        engine.restart()  # lost behind our back: found at the next /v1/models check
        await wait_until(lambda: engine.loras == {"a": "/adapters/a"}, within=3)

        engine.healthy = False  # down for a while: pending, then loaded again once it is back
        await wait_until(lambda: sync.state == AdaptersState(pending=("a",)), within=3)
        engine.restart()
        engine.healthy = True
        await wait_until(lambda: sync.state == AdaptersState(loaded=("a",)) and engine.loras == {"a": "/adapters/a"})


async def test_hugging_face_entries_download_without_holding_up_the_rest(tmp_path: Path) -> None:
    adapters = tmp_path / "adapters.json"
    write(
        adapters,
        {"name": "hub", "huggingFace": {"repo": "org/adapter", "revision": "v1"}},
        {"name": "local", "path": "/adapters/local"},
    )
    release = asyncio.Event()
    asked: list[tuple[str, str | None, str | None]] = []

    async def download(repo: str, revision: str | None, token: str | None) -> str:
        asked.append((repo, revision, token))
        if len(asked) == 1:
            raise RuntimeError("401 Client Error: Unauthorized")
        await release.wait()
        return "/hub/snapshots/v1"

    engine = FakeLoraEngine(loadable={"/adapters/local", "/hub/snapshots/v1"})
    async with (
        running_fake_engine(engine),
        syncing(fast_sync(engine.url, adapters, download=download, environ={"HF_TOKEN": "hf_x"})) as sync,
    ):
        failed = "cannot download org/adapter@v1: 401 Client Error: Unauthorized"
        await wait_until(lambda: sync.state == AdaptersState(loaded=("local",), failed={"hub": failed}))
        await wait_until(lambda: len(asked) == 2)  # retried; this one takes until released
        await asyncio.sleep(0.1)
        assert engine.loras == {"local": "/adapters/local"}
        release.set()
        await wait_until(lambda: sync.state == AdaptersState(loaded=("hub", "local")))
    assert engine.loras["hub"] == "/hub/snapshots/v1"
    assert asked == [("org/adapter", "v1", "hf_x")] * 2


async def test_hub_download_offline_from_a_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real download path (a child process running huggingface_hub), offline against a local cache."""
    commit = "0" * 40
    repo = tmp_path / "hub" / "models--org--adapter"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "adapter_config.json").write_text("{}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert await hub_download("org/adapter", "main", None) == str(repo / "snapshots" / commit)
    with pytest.raises(RuntimeError, match="Error: "):
        await hub_download("org/absent", "main", "hf_x")


async def test_the_worker_thread_starts_and_stops(tmp_path: Path) -> None:
    adapters = tmp_path / "adapters.json"
    write(adapters, {"name": "a", "path": "/adapters/a"})
    seen: list[AdaptersState] = []
    async with running_fake_engine(FakeLoraEngine(loadable={"/adapters/a"})) as engine:
        thread = AdapterSyncThread(engine.url, adapters, on_change=seen.append, environ={})
        thread.start()
        try:
            await wait_until(lambda: engine.loras == {"a": "/adapters/a"})
        finally:
            await asyncio.to_thread(thread.stop)
        assert not thread._thread.is_alive()
        assert seen[-1] == AdaptersState(loaded=("a",))
