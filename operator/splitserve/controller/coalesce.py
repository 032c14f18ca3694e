"""Child events coalesced per InferenceDeployment: a burst of them (a rollout's status updates, ten
pods becoming ready) costs one reconcile of the owner, not one each.

A request marks the owner dirty. The first one schedules a run after `window` seconds; requests that
arrive before the run starts join it, and requests during a run make exactly one more run after it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

log = logging.getLogger("splitserve.coalesce")

Key = tuple[str, str]


@dataclass
class Coalescer:
    run: Callable[[str, str], Awaitable[None]]
    window: float = 0.2
    _pending: dict[Key, asyncio.Task[None]] = field(default_factory=dict)
    _again: set[Key] = field(default_factory=set)
    _running: set[Key] = field(default_factory=set)

    def request(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        if key in self._running:
            self._again.add(key)
        elif key not in self._pending:
            self._pending[key] = asyncio.get_running_loop().create_task(self._later(key), name=f"reconcile {key}")

    async def _later(self, key: Key) -> None:
        try:
            while True:
                await asyncio.sleep(self.window)
                self._running.add(key)
                try:
                    await self.run(*key)
                except asyncio.CancelledError:
                    raise
                except Exception:  # the owner's own handlers retry; a child event must never kill the loop
                    log.exception("%s/%s: reconcile after a child event failed", *key)
                finally:
                    self._running.discard(key)
                if key not in self._again:
                    return
                self._again.discard(key)
        finally:
            self._pending.pop(key, None)

    async def aclose(self) -> None:
        tasks = list(self._pending.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
