"""The adapter sync: keeps an engine's LoRA adapters equal to the adapters file, at run time.

    splitserve worker ... --adapters-file /etc/splitserve/adapters/adapters.json
    splitserve sim-worker ... --adapters-file PATH

Once the engine answers /health, and then whenever the file changes (read every 2 s) and every 30 s
anyway (the engine may have restarted and lost them), it makes the engine's /v1/models list exactly the
file's adapters: `POST /v1/load_lora_adapter` for the missing ones, `POST /v1/unload_lora_adapter` for the
ones no longer listed, then reads /v1/models again to confirm. vLLM needs `--enable-lora` and
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True for that API. Changing the list this way changes no pod template:
no roll, no new KV generation.

A load that fails is one log line, `adapter NAME: cannot load from PATH: <vLLM's message>`, and is
retried with back-off (2 s doubling, at most 5 min); the engine goes on serving everything else.
Hugging Face entries are downloaded (huggingface_hub.snapshot_download, HF_TOKEN from the environment)
in a child process, while the loop goes on; the snapshot directory is the lora_path.

In a cluster (POD_NAME and POD_NAMESPACE set) the outcome is also a condition on the worker's own Pod
(pod_condition.py). The decisions are pure functions in adapter_plan.py.

Public API: `run_adapter_sync` (an asyncio task beside an engine in the same loop, as `sim-worker` runs
it), `AdapterSyncThread` (the same in a thread of its own, as `splitserve worker` runs it beside vLLM),
`AdapterSync` for finer control, and `AdaptersState` for what `on_change` receives.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from splitserve.engine.adapter_plan import (
    AdapterEntry,
    AdaptersFileError,
    AdaptersState,
    EngineModels,
    HuggingFaceSource,
    adapters_state,
    confirmed,
    error_message,
    parse_adapters_file,
    parse_models,
    plan_sync,
    retry_delay,
)
from splitserve.engine.pod_condition import PodConditionReporter

__all__ = ["AdapterSync", "AdapterSyncThread", "AdaptersState", "run_adapter_sync"]

log = logging.getLogger(__name__)

FILE_POLL_SECONDS = 2.0
MODELS_CHECK_SECONDS = 30.0
HEALTH_POLL_SECONDS = 1.0
RETRY_FIRST_SECONDS = 2.0
RETRY_CAP_SECONDS = 300.0
# Loading reads the adapter's weights from disk: a large one on a slow volume takes a while.
LOAD_TIMEOUT_SECONDS = 120.0
REQUEST_TIMEOUT_SECONDS = 10.0

OnChange = Callable[[AdaptersState], None]
# (repo, revision, token) -> the snapshot directory; its exception's text is the reason shown.
Download = Callable[[str, str | None, str | None], Coroutine[Any, Any, str]]

_DOWNLOAD_SCRIPT = """
import sys
try:
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import disable_progress_bars
    disable_progress_bars()  # noise in `kubectl logs`
    print(snapshot_download(repo_id=sys.argv[1], revision=sys.argv[2] or None))
except Exception as error:
    print(f"{type(error).__name__}: {' '.join(str(error).split())}", file=sys.stderr)
    sys.exit(1)
"""


async def hub_download(repo: str, revision: str | None, token: str | None) -> str:
    """huggingface_hub.snapshot_download of `repo` at `revision`: the local snapshot directory.

    In a child process, not a thread: a download still running when the worker stops is killed,
    where a thread (and huggingface_hub's own pool of them) would hold up the process's exit.
    """
    env = dict(os.environ)
    if token:
        env["HF_TOKEN"] = token
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _DOWNLOAD_SCRIPT, repo, revision or "",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    try:
        out, err = await process.communicate()
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await asyncio.shield(process.wait())
    if process.returncode != 0:
        lines = err.decode(errors="replace").strip().splitlines()
        raise RuntimeError((lines[-1] if lines else f"exit status {process.returncode}")[:400])
    return out.decode().strip().splitlines()[-1]


@dataclass
class _Failure:
    reason: str
    source: str  # the path or repo it failed from: a new one in the file is tried at once
    failures: int
    retry_at: float


class EngineUnavailable(Exception):
    """The engine stopped answering: wait for /health again, then sync everything."""


class AdapterSync:
    """Makes one engine serve exactly the adapters of one file; `run` until a stop event.

    `state` is the latest AdaptersState; `on_change` is called (in the loop) with each new one, the
    first as soon as the file was read.
    """

    def __init__(
        self,
        base_url: str,
        adapters_file: str | Path,
        *,
        on_change: OnChange | None = None,
        http: httpx.AsyncClient | None = None,
        download: Download = hub_download,
        environ: Mapping[str, str] | None = None,
        file_poll_s: float = FILE_POLL_SECONDS,
        models_check_s: float = MODELS_CHECK_SECONDS,
        health_poll_s: float = HEALTH_POLL_SECONDS,
        retry_first_s: float = RETRY_FIRST_SECONDS,
        retry_cap_s: float = RETRY_CAP_SECONDS,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.adapters_file = Path(adapters_file)
        self._on_change = on_change
        self._http = http
        self._download = download
        self._token = (os.environ if environ is None else environ).get("HF_TOKEN") or None
        self._file_poll_s = file_poll_s
        self._models_check_s = models_check_s
        self._health_poll_s = health_poll_s
        self._retry_first_s = retry_first_s
        self._retry_cap_s = retry_cap_s

        self._text: str | None = None  # the file's content last read, good or not
        self._file_problem: str | None = None  # the last thing logged about the file
        self._entries: tuple[AdapterEntry, ...] | None = None  # the last good list; None: none read yet
        self._downloaded: dict[HuggingFaceSource, str] = {}
        self._downloading: dict[HuggingFaceSource, asyncio.Task[str]] = {}
        self._failed: dict[str, _Failure] = {}
        self._loaded: set[str] = set()
        self._ours: set[str] = set()  # loaded by this sync: unloaded when delisted, whatever their parent
        self._wake = asyncio.Event()
        self.state = AdaptersState()

    # ------------------------------------------------------------------ the loop

    async def run(self, stop: asyncio.Event) -> None:
        """Sync until `stop` is set. Never raises: not for the engine, the file or a download, and a
        round that fails unexpectedly is logged and tried again."""
        async with contextlib.AsyncExitStack() as stack:
            if self._http is None:
                self._http = await stack.enter_async_context(
                    httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_SECONDS, connect=2.0))
                )
            loop = asyncio.create_task(self._loop())
            stopped = asyncio.create_task(stop.wait())
            try:
                await asyncio.wait({loop, stopped}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                tasks = [loop, stopped, *self._downloading.values()]
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            try:
                await self._wait_for_engine()
                await self._follow()
            except EngineUnavailable as error:
                log.warning("adapters: the engine stopped answering (%s); loading them again when it is back", error)
            except Exception:
                log.exception("adapters: sync round failed; trying again")
                await asyncio.sleep(self._file_poll_s)
            self._loaded.clear()
            self._ours.clear()
            self._publish()

    async def _follow(self) -> None:
        """With the engine up: a round at once, then one whenever the file changed, a retry or a
        download is due, or the models check is; raises EngineUnavailable."""
        next_check = 0.0
        while True:
            changed = self._read_file()
            now = time.monotonic()
            if changed or self._wake.is_set() or now >= next_check or self._retry_due(now):
                self._wake.clear()
                await self.sync_once()
                next_check = time.monotonic() + self._models_check_s
            await self._sleep(self._file_poll_s)

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)

    async def _wait_for_engine(self) -> None:
        health = f"{self.base_url}/health"
        while True:
            self._read_file()
            try:
                if (await self._client.get(health)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(self._health_poll_s)

    @property
    def _client(self) -> httpx.AsyncClient:
        assert self._http is not None, "AdapterSync.run owns the HTTP client"
        return self._http

    def _retry_due(self, now: float) -> bool:
        return any(failure.retry_at <= now for failure in self._failed.values())

    # ------------------------------------------------------------------ the file

    def _read_file(self) -> bool:
        """Read the file; True when a new good list was read. A bad one is logged once and ignored."""
        try:
            text = self.adapters_file.read_text(encoding="utf-8")
        except OSError as error:
            self._file_trouble(f"cannot read {self.adapters_file}: {error.strerror or error}")
            self._text = None
            return False
        if text == self._text:
            return False
        self._text = text
        try:
            entries = parse_adapters_file(text)
        except AdaptersFileError as error:
            self._file_trouble(f"{self.adapters_file}: {error}")
            return False
        self._file_problem = None
        if entries == self._entries:
            return False
        self._entries = entries
        names = {entry.name for entry in entries}
        for name in list(self._failed):
            if name not in names:
                del self._failed[name]
        log.info("adapters: %s lists %s", self.adapters_file, ", ".join(sorted(names)) or "none")
        self._publish()
        return True

    def _file_trouble(self, problem: str) -> None:
        if problem != self._file_problem:
            kept = "keeping the last good list" if self._entries is not None else "no adapters until it is fixed"
            log.warning("adapters: %s; %s", problem, kept)
            self._file_problem = problem

    # ------------------------------------------------------------------ one round

    async def sync_once(self) -> AdaptersState:
        """One round: resolve paths, load and unload, confirm from /v1/models. Raises EngineUnavailable."""
        entries = self._entries
        if entries is None:
            return self.state
        now = time.monotonic()
        paths = self._resolve(entries, now)
        listed = {entry.name for entry in entries}
        served = await self._models()
        plan = plan_sync(listed, paths, served, self._ours)
        for name in plan.unload:
            await self._unload(name)
        for name, path in plan.load + plan.reload:
            failure = self._failed.get(name)
            if failure is not None and failure.source == path and failure.retry_at > now:
                continue
            await self._load(name, path, in_place=(name, path) in plan.reload)
        if plan:
            served = await self._models()
        self._loaded = confirmed(paths, served)
        for name in self._loaded:
            self._failed.pop(name, None)
        self._publish()
        return self.state

    def _resolve(self, entries: tuple[AdapterEntry, ...], now: float) -> dict[str, str]:
        """lora_path per name when known; starts the downloads that are due."""
        paths: dict[str, str] = {}
        for entry in entries:
            if entry.path is not None:
                paths[entry.name] = entry.path
                continue
            source = entry.hugging_face
            assert source is not None
            if source in self._downloaded:
                paths[entry.name] = self._downloaded[source]
                continue
            failure = self._failed.get(entry.name)
            if source not in self._downloading and (failure is None or failure.retry_at <= now):
                if failure is not None:
                    failure.retry_at = math.inf  # the download's outcome sets the next one
                self._downloading[source] = self._start_download(entry.name, source)
        return paths

    def _start_download(self, name: str, source: HuggingFaceSource) -> asyncio.Task[str]:
        log.info("adapter %s: downloading %s", name, source)
        task = asyncio.create_task(self._download(source.repo, source.revision, self._token))

        def done(finished: asyncio.Task[str]) -> None:
            self._downloading.pop(source, None)
            if finished.cancelled():
                return
            error = finished.exception()
            if error is None:
                self._downloaded[source] = finished.result()
                log.info("adapter %s: downloaded %s to %s", name, source, finished.result())
            else:
                self._fail(name, str(source), f"cannot download {source}: {error}", verb="download")
            self._wake.set()

        task.add_done_callback(done)
        return task

    async def _models(self) -> EngineModels:
        try:
            response = await self._client.get(f"{self.base_url}/v1/models")
        except httpx.HTTPError as error:
            raise EngineUnavailable(f"GET /v1/models: {type(error).__name__}") from error
        if response.status_code != 200:
            raise EngineUnavailable(f"GET /v1/models: HTTP {response.status_code}")
        try:
            return parse_models(response.content)
        except ValueError as error:
            raise EngineUnavailable(f"GET /v1/models: {error}") from error

    async def _load(self, name: str, path: str, *, in_place: bool) -> None:
        body: dict[str, object] = {"lora_name": name, "lora_path": path}
        if in_place:
            body["load_inplace"] = True  # no moment without it: requests for it keep being served
        try:
            response = await self._client.post(
                f"{self.base_url}/v1/load_lora_adapter", json=body, timeout=LOAD_TIMEOUT_SECONDS
            )
        except httpx.ConnectError as error:
            raise EngineUnavailable(f"POST /v1/load_lora_adapter: {type(error).__name__}") from error
        except httpx.HTTPError as error:
            self._fail(name, path, f"{type(error).__name__} from the engine", verb="load")
            return
        if response.status_code == 200:
            log.info("adapter %s: loaded from %s", name, path)
            self._ours.add(name)
        else:
            self._fail(name, path, error_message(response.status_code, response.text), verb="load")

    async def _unload(self, name: str) -> None:
        try:
            response = await self._client.post(f"{self.base_url}/v1/unload_lora_adapter", json={"lora_name": name})
        except httpx.ConnectError as error:
            raise EngineUnavailable(f"POST /v1/unload_lora_adapter: {type(error).__name__}") from error
        except httpx.HTTPError as error:
            log.warning("adapter %s: cannot unload: %s from the engine", name, type(error).__name__)
            return
        if response.status_code == 200:
            log.info("adapter %s: unloaded (no longer listed)", name)
            self._ours.discard(name)
        else:
            # Tried again next round (at the latest at the next /v1/models check).
            log.warning("adapter %s: cannot unload: %s", name, error_message(response.status_code, response.text))

    def _fail(self, name: str, source: str, reason: str, *, verb: str) -> None:
        """Record a failed load or download; one log line, again only when the reason changes."""
        previous = self._failed.get(name)
        failures = previous.failures + 1 if previous is not None and previous.source == source else 1
        delay = retry_delay(failures, first_s=self._retry_first_s, cap_s=self._retry_cap_s)
        if previous is None or previous.reason != reason or previous.source != source:
            line = f"cannot load from {source}: {reason}" if verb == "load" else reason
            log.warning("adapter %s: %s", name, line)
        else:
            log.debug("adapter %s: %s failed again; next try in %.0f s", name, verb, delay)
        self._failed[name] = _Failure(reason, source, failures, time.monotonic() + delay)

    def _publish(self) -> None:
        listed = [entry.name for entry in self._entries or ()]
        state = adapters_state(listed, self._loaded, {name: f.reason for name, f in self._failed.items()})
        if state == self.state:
            return
        self.state = state
        log.info("adapters: %s", state.summary())
        if self._on_change is not None:
            try:
                self._on_change(state)
            except Exception:
                log.exception("adapters: on_change failed")


# --------------------------------------------------------------------------- entry points


async def run_adapter_sync(
    base_url: str,
    path: str | Path,
    *,
    stop_event: asyncio.Event,
    on_change: OnChange | None = None,
    environ: Mapping[str, str] | None = None,
) -> None:
    """Keep the engine at `base_url` serving exactly the adapters of the file at `path`, until `stop_event`.

    Run it as a task in the loop beside the engine (it only waits on the network and on a 2 s timer):
    it waits for `base_url`/health, then loads and unloads through vLLM's runtime LoRA API as the file
    says, and keeps doing so as the file changes (see the module's docstring). A file that is missing
    or malformed is one log line; the last good list is kept. `on_change` is called, in the loop, with
    each new AdaptersState (loaded / failed name -> reason / pending). In a cluster, with POD_NAME and
    POD_NAMESPACE in `environ` (default os.environ: also where HF_TOKEN is read), the state is also
    set as the condition splitserve.io/AdaptersReady on that Pod. Returns once `stop_event` is set;
    failures of the engine, the file, a download or the Kubernetes API never end it.
    """
    environ = os.environ if environ is None else environ
    reporter = PodConditionReporter.from_environ(environ)

    def changed(state: AdaptersState) -> None:
        if reporter is not None:
            reporter.update(state)
        if on_change is not None:
            on_change(state)

    sync = AdapterSync(base_url, path, on_change=changed, environ=environ)
    if reporter is None:
        await sync.run(stop_event)
        return
    await asyncio.gather(sync.run(stop_event), reporter.run(stop_event))


class AdapterSyncThread:
    """run_adapter_sync in a daemon thread with its own event loop: for a caller without one, as
    `splitserve worker` is while it supervises vLLM. start() returns at once; stop() ends it."""

    def __init__(
        self,
        base_url: str,
        path: str | Path,
        *,
        on_change: OnChange | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self._args = (base_url, path)
        self._on_change = on_change
        self._environ = environ
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="adapter-sync", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask the sync to stop and wait up to `timeout_s` for it (it is a daemon thread: never longer)."""
        if self._loop is not None and self._stop is not None:
            with contextlib.suppress(RuntimeError):  # its loop already closed
                self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _main(self) -> None:
        async def main() -> None:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            self._ready.set()
            base_url, path = self._args
            await run_adapter_sync(
                base_url, path, stop_event=self._stop, on_change=self._on_change, environ=self._environ
            )

        try:
            asyncio.run(main())
        except Exception:
            log.exception("adapters: the adapter sync stopped")
        finally:
            self._ready.set()
