"""Restarting what dies while the stack serves, as a kubelet restarts the containers of a pod.

Every long-running process of a serving stack (workers, router, Prometheus, the gateway's processes)
is started again from its own ProcessSpec when it exits: the same ports and arguments, its log
appended to, a new pid. One line says so:

    [  42.1s] decode-0 exited (signal 9); restarted (restart 1, pid 12345)

A process that keeps dying backs off as a kubelet's CrashLoopBackOff does: the first restart is
immediate, then 10 s, 20 s, 40 s, ... up to 5 minutes between them; a process that ran 10 minutes
before it exited starts over with an immediate restart. A restarted process is polled at its ready
URL, without blocking the stack, and only once it answers is it ready again: a worker leaves the
endpoints file when it dies (the router sends it nothing) and comes back once ready, as a pod's
endpoint is ready only while its readiness probe passes.

Nothing restarts once a stop was asked for (Ctrl-C, SIGTERM, --exit-after), nor a worker that a
rollout is draining, nor a one-shot process (the tiny-model build), which is never watched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import httpx

from splitserve.local.supervisor import Progress, RunningProcess, Supervisor

# kubelet's container restart back-off (pkg/kubelet: initial 10 s, doubling, 300 s at most, and
# reset once a container ran for twice the maximum).
BACKOFF_INITIAL_SECONDS = 10.0
BACKOFF_MAX_SECONDS = 300.0
BACKOFF_RESET_SECONDS = 600.0


@dataclass(frozen=True)
class CrashLoopBackoff:
    """How long to wait before restarting a process that exited: pure arithmetic, no clock."""

    initial_seconds: float = BACKOFF_INITIAL_SECONDS
    max_seconds: float = BACKOFF_MAX_SECONDS
    reset_after_seconds: float = BACKOFF_RESET_SECONDS

    def delay(self, crashes: int) -> float:
        """The wait before the restart after the `crashes`-th exit in a row (1 = the first): 0 for the
        first, then initial, doubling, at most max."""
        if crashes <= 1:
            return 0.0
        doublings = min(crashes - 2, 32)  # 2**32 * 10 s is past any cap; no float overflow beyond
        return float(min(self.max_seconds, self.initial_seconds * 2**doublings))

    def after_exit(self, crashes_before: int, ran_seconds: float) -> tuple[int, float]:
        """(exits in a row counting this one, seconds to wait before the restart) for a process that
        exited after running `ran_seconds`, having exited `crashes_before` times in a row before."""
        crashes = 1 if ran_seconds >= self.reset_after_seconds else crashes_before + 1
        return crashes, self.delay(crashes)


def exit_reason(returncode: int) -> str:
    """`code 3` for an exit, `signal 9` for a process killed by a signal (Popen's negative codes)."""
    return f"signal {-returncode}" if returncode < 0 else f"code {returncode}"


@dataclass
class _State:
    crashes: int = 0  # exits in a row, for the back-off
    due: float | None = None  # dead and waiting: restart at this elapsed time
    exited: str = ""  # why it last exited, for the line of a restart after a back-off
    starting: bool = False  # restarted, not ready yet


@dataclass
class Restarter:
    """Watches the processes `watched()` returns and restarts those that exited; tick() does one look.

    Inactive until `active` is set (start-up failures end `up` instead) and whenever the supervisor
    has a stop reason. `on_exit` runs when a process is found dead, `on_ready` when a restarted one
    answers its ready URL again (a worker leaving and rejoining the endpoints file)."""

    supervisor: Supervisor
    progress: Progress
    watched: Callable[[], Iterable[RunningProcess]]
    policy: CrashLoopBackoff = field(default_factory=CrashLoopBackoff)
    on_exit: Callable[[RunningProcess], None] = lambda _: None
    on_ready: Callable[[RunningProcess], None] = lambda _: None
    # Whether a process answers its ready URL; an HTTP GET by default (the tests stand in for it).
    probe: Callable[[RunningProcess], bool] | None = None
    active: bool = False
    _states: dict[str, _State] = field(default_factory=dict)
    _http: httpx.Client | None = None

    def close(self) -> None:
        if self._http is not None:
            self._http.close()

    def _ready(self, process: RunningProcess) -> bool:
        if self.probe is not None:
            return self.probe(process)
        if self._http is None:
            self._http = httpx.Client(timeout=httpx.Timeout(1.0, connect=0.2))
        try:
            return self._http.get(process.spec.ready_url).status_code == 200
        except httpx.HTTPError:
            return False

    def tick(self) -> None:
        if not self.active or self.supervisor.stop_reason is not None:
            return
        processes = list(self.watched())
        names = {process.name for process in processes}
        for gone in [name for name in self._states if name not in names]:
            del self._states[gone]  # stopped on purpose (a rollout replaced it): nothing to restart
        for process in processes:
            if self.supervisor.stop_reason is not None:
                return  # a signal arrived during this look: from now on, only stopping
            state = self._states.setdefault(process.name, _State())
            if state.due is not None:
                if self.progress.elapsed() >= state.due:
                    self._restart(process, state, f"{process.name} exited ({state.exited}), back-off over")
                continue
            returncode = process.popen.poll()
            if returncode is None:
                if state.starting and self._ready(process):
                    state.starting = False
                    took = self.progress.elapsed() - process.started_at
                    self.progress.say(f"{process.name} ready again at {process.spec.base_url} ({took:.1f}s)")
                    self.on_ready(process)
                continue
            self._exited(process, state, returncode)

    def _exited(self, process: RunningProcess, state: _State, returncode: int) -> None:
        ran = self.progress.elapsed() - process.started_at
        state.crashes, delay = self.policy.after_exit(state.crashes, ran)
        state.starting = False
        state.exited = exit_reason(returncode)
        self.on_exit(process)
        if delay <= 0:
            self._restart(process, state, f"{process.name} exited ({state.exited})")
            return
        state.due = self.progress.elapsed() + delay
        self.progress.say(
            f"{process.name} exited ({state.exited}) after {ran:.1f}s, {state.crashes} exits in a row: "
            f"back-off, restart {process.restarts + 1} in {delay:.0f}s (log: {process.log_path})"
        )

    def _restart(self, process: RunningProcess, state: _State, what: str) -> None:
        state.due = None
        try:
            self.supervisor.respawn(process)
        except OSError as error:
            # As a process that exited at once: the next try backs off.
            state.crashes, delay = self.policy.after_exit(state.crashes, 0.0)
            state.due = self.progress.elapsed() + max(delay, self.policy.initial_seconds)
            self.progress.say(
                f"{what}; cannot restart it ({error.strerror or error}): next try in "
                f"{state.due - self.progress.elapsed():.0f}s"
            )
            return
        state.starting = True
        self.progress.say(f"{what}; restarted (restart {process.restarts}, pid {process.pid})")
