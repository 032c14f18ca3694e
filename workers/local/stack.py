"""`splitserve up`: bring a deployment's router and workers up as local processes, then supervise them."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from splitserve.local.deployment import LocalDeployment
from splitserve.local.plan import (
    Engine,
    LocalPlan,
    PlanInputs,
    ProcessSpec,
    model_location,
    plan_processes,
    resolved_document,
    uses_tiny_model,
)
from splitserve.local.ports import PortAllocator
from splitserve.local.requestlog import RequestLogFollower
from splitserve.local.smoke import example_commands, send_smoke_request
from splitserve.local.supervisor import (
    Progress,
    RunningProcess,
    StartupError,
    StopRequested,
    Supervisor,
    log_tail,
)

# A vLLM-CPU worker holds about 2.3 GB; beyond this many the machine likely runs out of memory.
VLLM_WORKERS_WARNING = 4


@dataclass(frozen=True)
class UpOptions:
    engine: Engine
    router_port: int
    run_dir: Path
    model_dir: Path
    startup_timeout: float
    stop_grace: float
    exit_after: float | None = None
    smoke: bool = False
    verbose: bool = False
    sim_profile: str | None = None


def splitserve_command() -> tuple[str, ...]:
    """How children run the CLI: this interpreter, so the venv `up` runs in is the one they use."""
    return (sys.executable, "-m", "splitserve")


def vllm_missing() -> bool:
    return importlib.util.find_spec("vllm") is None


class LocalStack:
    """One `up` run: the supervisor, the plan it follows and what the user sees."""

    def __init__(self, deployment: LocalDeployment, options: UpOptions, progress: Progress) -> None:
        self.deployment = deployment
        self.options = options
        self.progress = progress
        self.supervisor = Supervisor(options.run_dir, progress, stop_grace_seconds=options.stop_grace)
        self.ports = PortAllocator()
        self.ports.reserve(options.router_port)

    def run(self) -> int:
        with self.supervisor.signals_handled():
            follower: RequestLogFollower | None = None
            try:
                plan = self._plan()
                self._start(plan)
                if self.options.smoke:
                    return self._smoke(plan)
                follower = self._follow_requests(plan)
                return self._serve()
            except StartupError as error:
                self._fail(str(error), error.log_tail)
                return 1
            except StopRequested as stop:
                self.progress.say(f"{stop} received during start-up")
                return 0
            finally:
                if follower is not None:
                    follower.stop()
                self.supervisor.stop_all()

    # ------------------------------------------------------------------ steps

    def _plan(self) -> LocalPlan:
        inputs = PlanInputs(
            engine=self.options.engine,
            router_port=self.options.router_port,
            allocate_port=self.ports.allocate,
            splitserve=splitserve_command(),
            sim_profile=self.options.sim_profile,
            router_drain_seconds=max(1.0, self.options.stop_grace / 2),
        )
        if self.options.engine is Engine.VLLM:
            model_path = self._model_path()
            document, notes = resolved_document(self.deployment, model_path)
            spec_path = self.options.run_dir / "spec.yaml"
            spec_path.write_text(yaml.safe_dump(document, sort_keys=False))
            for note in notes:
                self.progress.say(f"local adjustment: {note}")
            inputs = dataclasses.replace(inputs, model_path=model_path, spec_path=str(spec_path))
        return plan_processes(self.deployment, inputs)

    def _model_path(self) -> str:
        if not uses_tiny_model(self.deployment):
            return model_location(self.deployment, str(self.options.model_dir))
        model_dir = self.options.model_dir
        if (model_dir / "config.json").exists():
            self.progress.say(f"tiny model: {model_dir}")
            return str(model_dir)
        # Build next to the target and rename, so an interrupted build never looks finished.
        partial = model_dir.with_name(f"{model_dir.name}.partial-{os.getpid()}")
        model_dir.parent.mkdir(parents=True, exist_ok=True)
        spec = ProcessSpec(
            name="tiny-model", argv=(*splitserve_command(), "tiny-model", str(partial)), port=0, ready_path=""
        )
        process = self.supervisor.start(spec, one_shot=True)
        try:
            self._wait_exit(process, timeout=600.0)
        except (StartupError, StopRequested):
            self.supervisor.stop_all()  # the builder must stop writing before its folder goes
            shutil.rmtree(partial, ignore_errors=True)
            raise
        try:
            os.replace(partial, model_dir)
        except OSError as error:
            shutil.rmtree(partial, ignore_errors=True)
            if not (model_dir / "config.json").exists():  # else another `up` finished its build first
                raise StartupError(f"cannot move the tiny model into {model_dir}: {error.strerror or error}") from error
        self.progress.say(f"tiny model built in {model_dir}")
        return str(model_dir)

    def _wait_exit(self, process: RunningProcess, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while process.popen.poll() is None:
            if self.supervisor.stop_reason is not None:
                raise StopRequested(self.supervisor.stop_reason)
            if time.monotonic() > deadline:
                raise StartupError(f"{process.name} did not finish in {timeout:.0f}s", log_tail(process.log_path))
            time.sleep(0.2)
        if process.popen.returncode != 0:
            raise StartupError(
                f"{process.name} failed with code {process.popen.returncode} (log: {process.log_path})",
                log_tail(process.log_path),
            )

    def _start(self, plan: LocalPlan) -> None:
        workers = [self.supervisor.start(spec) for spec in plan.workers]
        self.supervisor.wait_ready(workers, self.options.startup_timeout)
        router = self.supervisor.start(plan.router)
        self.supervisor.wait_ready([router], self.options.startup_timeout)
        memory_mb = self.supervisor.memory_bytes() / 2**20
        self.progress.say(f"all {len(plan.processes)} processes ready ({memory_mb:.0f} MiB resident)")
        print(f"OpenAI endpoint: {plan.endpoint}   (model {plan.model_name!r})", flush=True)
        if not self.options.smoke:
            curl, python = example_commands(plan.endpoint, plan.model_name)
            print(f"  try: {curl}", flush=True)
            print(f"   or: {python}", flush=True)
            print("Ctrl-C stops everything.", flush=True)

    def _smoke(self, plan: LocalPlan) -> int:
        self.progress.say("smoke test: one completion through the router")
        try:
            text = send_smoke_request(plan.endpoint, plan.model_name)
        except RuntimeError as error:
            self._fail(f"smoke request failed: {error}", log_tail(self.options.run_dir / "router.log"))
            return 1
        print(f"answer: {text!r}", flush=True)
        return 0

    def _follow_requests(self, plan: LocalPlan) -> RequestLogFollower | None:
        if not self.options.verbose:
            return None
        names = {spec.base_url: spec.name for spec in plan.processes}
        follower = RequestLogFollower(self.options.run_dir / "router.log", names, self.progress.say)
        follower.start()
        return follower

    def _serve(self) -> int:
        deadline = None if self.options.exit_after is None else time.monotonic() + self.options.exit_after
        died = self.supervisor.watch(deadline)
        if died is not None:
            self._fail(
                f"{died.name} exited with code {died.popen.returncode} (log: {died.log_path})",
                log_tail(died.log_path),
            )
            return 1
        self.progress.say(f"{self.supervisor.stop_reason}: stopping")
        return 0

    def _fail(self, message: str, tail: str) -> None:
        print(f"error: {message}", file=sys.stderr, flush=True)
        if tail:
            print("---- last lines of its log ----", file=sys.stderr)
            print(tail, file=sys.stderr)
            print("-------------------------------", file=sys.stderr, flush=True)
