"""Reconciles requested per InferenceDeployment, coalesced and retried.

Every reason to reconcile an owner (a spec change, a child event, the drift pass, a retry) is a
request. A burst of them (a rollout's status updates, ten pods becoming ready) costs one reconcile,
not one each:

- a request marks the owner due after `window` seconds (or `after`, for a retry); requests before the
  run starts join it, and an earlier due time wins;
- requests during a run make exactly one more run after it;
- `full` (a spec change, or first sight after a restart) is kept until a run takes it, so a joined
  child event never hides a spec change;
- a run that fails is retried with a growing delay, one that asks for a retry (returns seconds) after
  that long; both keep `full`. A newer request still runs at its own, earlier, time.

One task per owner at most, only while something is due: an idle operator holds none.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

log = logging.getLogger("splitserve.coalesce")

Key = tuple[str, str]
# (namespace, name, full) -> None, or seconds after which to run again (the spec cannot be realised yet).
Run = Callable[[str, str, bool], Awaitable[float | None]]
# After an unexpected failure (an API error): as kopf's error delays were.
BACKOFF_SECONDS: Sequence[float] = (1, 2, 5, 10, 20, 30)


@dataclass
class Coalescer:
    run: Run
    window: float = 0.2
    backoff: Sequence[float] = BACKOFF_SECONDS
    _pending: dict[Key, asyncio.Task[None]] = field(default_factory=dict)
    _due: dict[Key, float] = field(default_factory=dict)  # when the pending task runs (loop time)
    _again: dict[Key, float] = field(default_factory=dict)  # due time of the run after the current one
    _full: set[Key] = field(default_factory=set)
    _running: set[Key] = field(default_factory=set)
    _failures: dict[Key, int] = field(default_factory=dict)

    def request(self, namespace: str, name: str, *, full: bool = False, after: float | None = None) -> None:
        key = (namespace, name)
        loop = asyncio.get_running_loop()
        due = loop.time() + (self.window if after is None else after)
        if full:
            self._full.add(key)
        if key in self._running:
            self._again[key] = min(self._again.get(key, math.inf), due)
            return
        if key in self._pending and self._due[key] <= due:
            return
        self._schedule(key, due)

    def forget(self, namespace: str, name: str) -> None:
        """The owner is gone: nothing more to run for it."""
        key = (namespace, name)
        task = self._pending.pop(key, None)
        if task is not None and key not in self._running:
            task.cancel()
        self._due.pop(key, None)
        self._again.pop(key, None)
        self._full.discard(key)
        self._failures.pop(key, None)

    @property
    def idle(self) -> bool:
        return not self._pending

    def _schedule(self, key: Key, due: float) -> None:
        previous = self._pending.get(key)
        if previous is not None:
            previous.cancel()  # still sleeping: never cancelled while running (see request)
        self._due[key] = due
        self._pending[key] = asyncio.get_running_loop().create_task(self._later(key), name=f"reconcile {key}")

    async def _later(self, key: Key) -> None:
        this = asyncio.current_task()
        loop = asyncio.get_running_loop()
        try:
            while True:
                await asyncio.sleep(max(0.0, self._due[key] - loop.time()))
                full = key in self._full
                self._full.discard(key)
                self._running.add(key)
                retry_after: float | None
                try:
                    retry_after = await self.run(key[0], key[1], full)
                    self._failures.pop(key, None)
                except asyncio.CancelledError:
                    raise
                except Exception:  # retried below; a failing owner must never stop the others
                    failures = self._failures.get(key, 0)
                    self._failures[key] = failures + 1
                    retry_after = self.backoff[min(failures, len(self.backoff) - 1)]
                    log.exception("%s/%s: reconcile failed; retrying in %s s", *key, retry_after)
                finally:
                    self._running.discard(key)
                if retry_after is not None:
                    if full:
                        self._full.add(key)
                    self._again[key] = min(self._again.get(key, math.inf), loop.time() + retry_after)
                if key not in self._again:
                    return
                self._due[key] = self._again.pop(key)
        finally:
            if self._pending.get(key) is this:
                del self._pending[key]
                self._due.pop(key, None)

    async def aclose(self) -> None:
        tasks = list(self._pending.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
