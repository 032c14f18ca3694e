"""The workers of a running local stack, and the changes a new deployment file makes to them.

A new KV generation rolls out make-before-break, each step waiting for the one before (no sleeps):
1. the new generation's workers start beside the old ones, on new ports (names go on counting:
   prefill-1, decode-1, ...) and `up` waits until each is ready;
2. they join the endpoints file as ready, and `up` waits until the router lists them healthy;
3. the old workers are marked terminating there: the router sends them nothing new;
4. `up` waits until the router reports them no longer healthy with 0 requests in flight (a request
   keeps its decode slot until it ends, and its prefill's KV has been pulled by then);
5. they leave the file, then get SIGTERM (their own drain) and are gone.
A worker of the new generation that fails to start (or is not ready in time) stops the rollout:
the new workers stop, the old ones never left the file, and they keep serving. A serving process
that dies meanwhile is restarted (restarts.py, through the supervisor's on_wait); a draining one is
not.

The same generation with other replica counts changes in place: added workers join the file once
ready; removed ones (the newest of their role) drain as in steps 3-5.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from splitserve.local.changes import Change, describe_change, with_replicas
from splitserve.local.deployment import LocalDeployment
from splitserve.local.endpoints import EndpointsFile, RouterWorkers, all_healthy, drained, inflight_on, router_workers
from splitserve.local.plan import PlanInputs, ProcessSpec, plan_worker, role_counts
from splitserve.local.supervisor import Progress, RunningProcess, StartupError, StopRequested, Supervisor
from splitserve.router.adapters import adapter_names, parse_models

POLL_SECONDS = 0.1
# How long the router may take to list workers just written to the endpoints file (it polls the file
# every 0.2 s; more means it does not follow the file at all).
TAKE_UP_SECONDS = 30.0


@dataclass(frozen=True)
class Generation:
    """A KV generation's id, the values it hashes (api/generation.py) and how its workers are planned."""

    id: str
    inputs: dict[str, Any]
    plan_inputs: PlanInputs


@dataclass(frozen=True)
class Outcome:
    ok: bool
    message: str


def _names(workers: Sequence[RunningProcess | ProcessSpec]) -> str:
    return ", ".join(worker.name for worker in workers)


class Fleet:
    """Owns the workers (of every generation present) and the endpoints file the router follows."""

    def __init__(
        self,
        supervisor: Supervisor,
        progress: Progress,
        endpoints: EndpointsFile,
        router_url: str,
        *,
        startup_timeout: float,
        on_started: Callable[[Sequence[RunningProcess]], None] = lambda _: None,
    ) -> None:
        self.supervisor = supervisor
        self.progress = progress
        self.endpoints = endpoints
        self.router_url = router_url
        self.startup_timeout = startup_timeout
        self.on_started = on_started
        self.workers: list[RunningProcess] = []
        # Workers being drained (terminating, then stopped): not restarted if they die meanwhile.
        self.leaving: list[RunningProcess] = []
        self.router: RunningProcess | None = None
        self._next_index: dict[str, int] = {}
        self._http = httpx.Client(timeout=httpx.Timeout(2.0, connect=0.5))
        # Set by start(): what runs now.
        self.deployment: LocalDeployment | None = None  # what the workers were started from, counts as running
        self.router_deployment: LocalDeployment | None = None  # what the router was started from
        # Whose spec.adapters the adapters file lists (it changes at run time, without new workers).
        self.adapters_deployment: LocalDeployment | None = None
        self.generation: Generation | None = None

    def close(self) -> None:
        self._http.close()

    # ------------------------------------------------------------------ start

    def start(self, deployment: LocalDeployment, generation: Generation) -> list[RunningProcess]:
        """The first generation's workers, ready and in the endpoints file (the router starts after)."""
        self.deployment = self.router_deployment = self.adapters_deployment = deployment
        self.generation = generation
        workers = self._start_workers(deployment, generation, role_counts(deployment))
        self.endpoints.add(worker.spec for worker in workers)
        self.workers = workers
        return workers

    def _start_workers(
        self, deployment: LocalDeployment, generation: Generation, counts: dict[str, int]
    ) -> list[RunningProcess]:
        """Start workers and wait until all are ready; on failure stop those started, then raise."""
        specs = []
        for role, count in counts.items():
            for _ in range(count):
                index = self._next_index.get(role, 0)
                self._next_index[role] = index + 1
                specs.append(plan_worker(deployment, generation.plan_inputs, role, index))
        started: list[RunningProcess] = []
        try:
            for spec in specs:
                started.append(self.supervisor.start(spec))
            self.on_started(started)
            self.supervisor.wait_ready(started, self.startup_timeout)
        except (StartupError, StopRequested):
            self.supervisor.stop(started)
            raise
        return started

    # ------------------------------------------------------------------ checks

    def serving(self) -> list[RunningProcess]:
        return [*self.workers, *([self.router] if self.router is not None else [])]

    def restartable(self) -> list[RunningProcess]:
        """The serving processes to restart when they die: all but the workers being drained."""
        return [process for process in self.serving() if process not in self.leaving]

    def _check(self) -> None:
        if self.supervisor.stop_reason is not None:
            raise StopRequested(self.supervisor.stop_reason)
        self.supervisor.waiting()

    def _wait_router(self, condition: Callable[[RouterWorkers], bool], seconds: float) -> RouterWorkers | None:
        """Poll the router's /splitserve/workers until `condition` holds; None when time ran out."""
        deadline = time.monotonic() + seconds
        report: RouterWorkers | None = None
        while True:
            self._check()
            report = router_workers(self._http, self.router_url)
            if report is not None and condition(report):
                return report
            if time.monotonic() >= deadline:
                return None
            time.sleep(POLL_SECONDS)

    # ------------------------------------------------------------------ changes

    def describe(self, new: LocalDeployment, new_generation: tuple[str, dict[str, Any]]) -> Change:
        assert self.deployment is not None and self.router_deployment is not None and self.generation is not None
        current = (self.generation.id, self.generation.inputs)
        return describe_change(
            self.deployment, self.router_deployment, new, current, new_generation, self.adapters_deployment
        )

    def roll_out(self, new: LocalDeployment, generation: Generation, change: Change) -> Outcome:
        """Make-before-break from the current generation to `generation` (steps in the module doc)."""
        assert self.generation is not None
        started = time.monotonic()
        old_id = self.generation.id
        changed = "; ".join(change.generation_changes) or "no input differs"
        self.progress.say(f"rollout: generation {old_id} -> {generation.id} ({changed})")
        try:
            new_workers = self._start_workers(new, generation, role_counts(new))
        except StartupError as error:
            return self._failed(f"rollout to generation {generation.id} failed: {error}", error.log_tail)
        self.workers += new_workers
        if not self._join(new_workers):
            self.workers = [worker for worker in self.workers if worker not in new_workers]
            self.endpoints.remove(worker.spec.base_url for worker in new_workers)
            self.supervisor.stop(new_workers)
            return self._failed(
                f"rollout to generation {generation.id} failed: the router did not take the new workers "
                f"within {TAKE_UP_SECONDS:.0f}s (log: {self.supervisor.run_dir / 'router.log'})",
                "",
            )
        self.progress.say(f"new workers ready: {_names(new_workers)} (generation {generation.id})")
        old = [worker for worker in self.workers if worker not in new_workers]
        self._drain(old, "old workers")
        self.deployment, self.generation = new, generation
        took = time.monotonic() - started
        message = f"rollout complete in {took:.1f} s: generation {generation.id} serves ({_names(new_workers)})"
        self.progress.say(message)
        return Outcome(True, message)

    def scale(self, new: LocalDeployment, change: Change) -> Outcome:
        """The same generation with other replica counts: add workers first, then drain the extra ones."""
        assert self.deployment is not None and self.generation is not None
        started = time.monotonic()
        counts = dict(role_counts(self.deployment))
        grow = {role: after - before for role, (before, after) in change.replicas.items() if after > before}
        shrink = {role: before - after for role, (before, after) in change.replicas.items() if after < before}
        what = ", ".join(f"{role} {before} -> {after}" for role, (before, after) in change.replicas.items())
        self.progress.say(f"replicas: {what} (generation {self.generation.id}, in place)")
        if grow:
            try:
                added = self._start_workers(self.deployment, self.generation, grow)
            except StartupError as error:
                return self._failed(f"adding workers failed: {error}", error.log_tail)
            self.workers += added
            if not self._join(added):
                self.workers = [worker for worker in self.workers if worker not in added]
                self.endpoints.remove(worker.spec.base_url for worker in added)
                self.supervisor.stop(added)
                return self._failed(f"the router did not take {_names(added)} within {TAKE_UP_SECONDS:.0f}s", "")
            self.progress.say(f"new workers ready: {_names(added)}")
            counts.update({role: counts[role] + count for role, count in grow.items()})
        if shrink:
            leaving = []
            for role, count in shrink.items():
                of_role = [worker for worker in self.workers if worker.spec.role == role]
                leaving += of_role[-count:]  # the newest go first
                counts[role] -= count
            self._drain(leaving, "removed workers")
        self.deployment = with_replicas(self.deployment, counts)
        message = f"replicas applied in {time.monotonic() - started:.1f} s: {what}"
        self.progress.say(message)
        return Outcome(True, message)

    def wait_adapters(self, names: Collection[str], seconds: float) -> str | None:
        """Until every worker's /v1/models lists exactly the adapters `names`, then the router's (it learns
        them from the workers); None once they do, else which process lists what when time ran out."""
        wanted = frozenset(names)
        processes = {worker.spec.base_url: worker.name for worker in self.workers} | {self.router_url: "router"}
        deadline = time.monotonic() + seconds
        while True:
            self._check()
            # The router last: it lists what the workers list, a poll later.
            behind = next(
                ((url, listed) for url in processes if (listed := self._adapters_of(url)) != wanted),
                None,
            )
            if behind is None:
                return None
            if time.monotonic() >= deadline:
                url, listed = behind
                what = "nothing (not answering)" if listed is None else ", ".join(sorted(listed)) or "no adapter"
                return f"{processes[url]} lists {what}, not {', '.join(sorted(wanted)) or 'no adapter'}"
            time.sleep(POLL_SECONDS)

    def _adapters_of(self, base_url: str) -> frozenset[str] | None:
        try:
            response = self._http.get(f"{base_url}/v1/models")
            return adapter_names(parse_models(response.content)) if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def _join(self, workers: Sequence[RunningProcess]) -> bool:
        """Add ready workers to the endpoints file and wait until the router routes to them."""
        urls = [worker.spec.base_url for worker in workers]
        self.endpoints.add(worker.spec for worker in workers)
        return self._wait_router(lambda report: all_healthy(report, urls), TAKE_UP_SECONDS) is not None

    def _drain(self, workers: Sequence[RunningProcess], what: str) -> None:
        """Terminating in the file, nothing left in flight at the router, out of the file, then stopped."""
        if not workers:
            return
        assert self.router_deployment is not None
        urls = [worker.spec.base_url for worker in workers]
        self.leaving = list(workers)
        self.endpoints.mark_terminating(urls)
        self.progress.say(f"{what} terminating: {_names(workers)}; waiting for their requests to finish")
        # A request may take the router's whole request timeout; it is not cut short.
        seconds = self.router_deployment.spec.router.timeouts.request_seconds + 5.0
        if self._wait_router(lambda report: drained(report, urls), seconds) is None:
            report = router_workers(self._http, self.router_url)
            left = "unknown" if report is None else str(inflight_on(report, urls))
            self.progress.say(f"{what} not drained after {seconds:.0f}s ({left} requests in flight): stopping anyway")
        self.endpoints.remove(urls)
        self.progress.say(f"{what} drained: {_names(workers)}")
        self.workers = [worker for worker in self.workers if worker not in workers]
        self.leaving = []
        self.supervisor.stop(workers)

    def _failed(self, message: str, tail: str) -> Outcome:
        assert self.generation is not None
        self.progress.say(message)
        if tail:
            self.progress.say("last lines of its log:\n" + tail)
        self.progress.say(f"still serving generation {self.generation.id} ({_names(self.workers)})")
        return Outcome(False, message)
