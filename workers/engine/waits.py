"""How a vLLM engine's threads wait for work: `spin` (vLLM's own waits) or `events` (they sleep until woken).

Two waits in vLLM 0.32 keep cores busy, which on a machine where engines share cores (every CPU-only
pool, a laptop, CI) starves the very processes a prefill -> KV transfer -> decode request needs.
Profiling one P/D pair on 2 cores (docs/benchmarks.md, issue 26) found:

1. NIXL's progress thread never sleeps. NIXL's Python agent creates its agent with `pthrDelay = 0`, and
   the UCX backend's progress thread uses that delay, rounded up to milliseconds, as the timeout of its
   `poll()` on the UCX workers' event descriptors: 0 makes it a busy loop (poll, epoll_wait, read: some
   50,000 system calls a second), a whole core per idle engine. vLLM's NixlConnector has no setting for it.
   With a delay the same loop sleeps until UCX signals an event (a request or a notification arriving),
   and for at most the delay, which NIXL keeps as a safety net for an event UCX fails to signal.

2. vLLM's shared-memory queues between the engine core and its worker process (shm_broadcast) wake
   their reader with a ZMQ hint that is lost. The writer publishes the hint on a PUB socket whose send
   high-water mark is 1; libzmq learns that the peer drained that pipe only when it processes its
   command queue, which `send()` does at most about once a millisecond, so a hint sent within a
   millisecond of the previous one is silently dropped (half of them in a back-to-back exchange). A
   reader asleep on a dropped hint wakes at vLLM's 5 s recheck: the multi-second stalls of issue 26.
   vLLM hides it by spinning every reader with sched_yield for 1 s after each message, which keeps a
   core busy per reader while traffic flows and leaves the stall for the first message after a pause.

`events` mode fixes both where they happen: the NIXL agent gets a progress pause (`nixl_poll_us`); the
hint writer's high-water mark is raised so no hint is dropped (the reader's socket conflates hints, so
a burst costs nothing); and a reader spins at most `spin_us` from the start of a wait, then sleeps on
the hint, rechecking its ring every millisecond while traffic flows and every 50 ms when idle.

`install` patches the modules when they are imported (or at once if they already are): it must run in
every process of the engine before vLLM creates its queues, which `splitserve.engine.vllm_server`
arranges. `spin` mode changes nothing. The patches are for vLLM 0.32 and NIXL 1.5: `install` checks the
shapes it relies on and leaves a module alone, with one line on stderr, when they differ.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

from splitserve.engine.wait_settings import WaitSettings

# Where NIXL's agent lives, by build; `nixl._api` is an alias the `nixl` package installs for one of them.
NIXL_API_MODULES = ("nixl_cu13._api", "nixl_cu12._api", "nixl_rocm._api")
SHM_BROADCAST_MODULE = "vllm.distributed.device_communicators.shm_broadcast"

# Enough room for a burst of hints between two command-queue passes of the writer's socket.
HINT_HIGH_WATER_MARK = 1024
# A reader that read within this long is in a flow of messages: a late hint costs at most a millisecond.
ACTIVE_SECONDS = 1.0
ACTIVE_RECHECK_MS = 1
IDLE_RECHECK_MS = 50


# --------------------------------------------------------------------------- counters


class _Counters:
    """What the patched readers saw, in this process (tests and the worker's diagnosis read them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reads = 0
        # Reads found by a recheck after a wait that no hint ended: hints lost or late.
        self.late_hints = 0

    def read(self, late: bool) -> None:
        with self._lock:
            self.reads += 1
            self.late_hints += late


counters = _Counters()


# --------------------------------------------------------------------------- NIXL


class _AgentWithPause:
    """NIXL's bindings module, except that each agent's progress thread pauses `delay_us` between polls."""

    def __init__(self, bindings: Any, delay_us: int) -> None:
        self._bindings = bindings
        self.delay_us = delay_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bindings, name)

    def nixlAgent(self, name: str, config: Any) -> Any:
        config.pthrDelay = self.delay_us
        return self._bindings.nixlAgent(name, config)


def patch_nixl_api(module: ModuleType, delay_us: int) -> bool:
    bindings = getattr(module, "nixlBind", None)
    if bindings is None or not hasattr(bindings, "nixlAgent"):
        return False
    if isinstance(bindings, _AgentWithPause):
        bindings.delay_us = delay_us
    else:
        module.nixlBind = _AgentWithPause(bindings, delay_us)  # type: ignore[attr-defined]
    return True


# --------------------------------------------------------------------------- vLLM's shared-memory queues


def patch_shm_broadcast(module: ModuleType, spin_us: int, *, reliable_hints: bool = True) -> bool:
    """Replace vLLM's reader waits; with `reliable_hints`, also its hint writer (False only shows, in the
    tests, what vLLM's own writer loses)."""
    condition = getattr(module, "SpinCondition", None)
    if condition is None or not all(hasattr(condition, name) for name in ("wait", "record_read", "notify")):
        return False
    import zmq

    spin_seconds = spin_us / 1e6
    sched_yield: Callable[[], None] = getattr(module, "sched_yield", os.sched_yield)
    original_init = getattr(condition, "_splitserve_original_init", condition.__init__)
    original_record_read = getattr(condition, "_splitserve_original_record_read", condition.record_read)

    def __init__(self: Any, is_reader: bool, context: Any, notify_address: str, busy_loop_s: float = 1.0) -> None:
        self._splitserve_spin_until = None
        self._splitserve_hintless = False
        if is_reader or not reliable_hints:
            original_init(self, is_reader, context, notify_address, busy_loop_s)
            return
        # vLLM's writer, with room for hints: its high-water mark of 1 drops them (see the docstring).
        # Set before bind, since a listening socket hands its options to the connections it accepts.
        self.is_reader = False
        self.local_notify_socket = context.socket(zmq.PUB)
        self.local_notify_socket.setsockopt(zmq.SNDHWM, HINT_HIGH_WATER_MARK)
        self.local_notify_socket.bind(notify_address)
        self.last_read = 0
        self.busy_loop_s = 0
        self.read_cancel_socket = None
        self.write_cancel_socket = None
        self.poller = None

    def record_read(self: Any) -> None:
        original_record_read(self)
        self._splitserve_spin_until = None
        counters.read(late=self._splitserve_hintless)
        self._splitserve_hintless = False

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        now = time.monotonic()
        if self._splitserve_spin_until is None:
            self._splitserve_spin_until = now + spin_seconds
        if now < self._splitserve_spin_until:
            sched_yield()
            return
        recheck = ACTIVE_RECHECK_MS if now - self.last_read <= ACTIVE_SECONDS else IDLE_RECHECK_MS
        events = dict(self.poller.poll(timeout=recheck if timeout_ms is None else min(timeout_ms, recheck)))
        if self.local_notify_socket in events:
            self._splitserve_hintless = False
            with contextlib.suppress(zmq.Again):
                self.local_notify_socket.recv(flags=zmq.NOBLOCK, copy=False)
        elif self.read_cancel_socket not in events:
            self._splitserve_hintless = True

    condition._splitserve_original_init = original_init
    condition._splitserve_original_record_read = original_record_read
    condition.__init__ = __init__
    condition.record_read = record_read
    condition.wait = wait
    return True


# --------------------------------------------------------------------------- installing


Patch = Callable[[ModuleType], bool]


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a patch on a module right after it is executed, before anyone else can use it."""

    def __init__(self, patches: Mapping[str, Patch]) -> None:
        self.patches = dict(patches)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        patch = self.patches.get(fullname)
        if patch is None:
            return None
        spec = _find_elsewhere(self, fullname, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        execute = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            _apply(fullname, patch, module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _find_elsewhere(
    finder: importlib.abc.MetaPathFinder, fullname: str, path: Sequence[str] | None, target: ModuleType | None
) -> importlib.machinery.ModuleSpec | None:
    for other in sys.meta_path:
        if other is finder or not hasattr(other, "find_spec"):
            continue
        spec = other.find_spec(fullname, path, target)
        if spec is not None:
            return spec
    return None


def _apply(name: str, patch: Patch, module: ModuleType) -> None:
    try:
        applied = patch(module)
    except Exception as error:  # a patch must never stop the engine from starting
        applied = False
        print(f"splitserve: engine waits: could not patch {name}: {error!r}", file=sys.stderr)
    if not applied:
        print(f"splitserve: engine waits: {name} is not the shape expected; left as it is", file=sys.stderr)


_installed: list[_AfterImport] = []


def install(settings: WaitSettings) -> None:
    """Patch what `settings` asks for, now in the modules already imported, later in the others."""
    if settings.mode != "events":
        return
    patches: dict[str, Patch] = {SHM_BROADCAST_MODULE: lambda module: patch_shm_broadcast(module, settings.spin_us)}
    if settings.nixl_poll_us > 0:
        for name in NIXL_API_MODULES:
            patches[name] = lambda module: patch_nixl_api(module, settings.nixl_poll_us)
    for finder in _installed:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
    pending = {name: patch for name, patch in patches.items() if name not in sys.modules}
    for name in patches.keys() - pending.keys():
        _apply(name, patches[name], sys.modules[name])
    finder = _AfterImport(pending)
    sys.meta_path.insert(0, finder)
    _installed.append(finder)


def install_from_env(environ: Mapping[str, str]) -> WaitSettings:
    settings = WaitSettings.from_env(environ)
    install(settings)
    return settings
