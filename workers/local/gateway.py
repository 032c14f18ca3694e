"""`splitserve up --gateway envoy`: the stack behind an Envoy, as a cluster's Gateway (GAIE) fronts it.

Beside the router (which keeps serving its own endpoint), `up` runs what a Gateway deployment runs:

- `splitserve epp`, the endpoint picker: Envoy's ext_proc server, with the router's discovery (the
  endpoints file `up` writes), model, policies and tokenizer flags, and a `--target-endpoint` per
  decode worker naming that worker's sidecar (aggregated mode: none, Envoy reaches the workers);
- one `splitserve sidecar` per decode worker (disaggregated mode): the P/D proxy in front of it, which
  runs the prefill leg on the prefill worker the picker chose, then decodes on its worker;
- Envoy, from a bootstrap rendered into RUN_DIR/envoy.yaml (ext_proc to the picker, the pool's
  endpoints), ready once its admin /ready answers.

All of them are restarted when they die (restarts.py). The decode workers are fixed for the gateway's
life (Envoy's pool and the picker's targets are written at start): a change of the deployment that
replaces or adds decode workers is refused while it runs; prefill replicas change as without it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from splitserve.gateway.envoy import envoy_binary, render_bootstrap
from splitserve.local.changes import Change
from splitserve.local.deployment import LocalDeployment
from splitserve.local.plan import GatewayPorts, PlanInputs, ProcessSpec, plan_envoy, plan_epp, plan_sidecar
from splitserve.local.ports import LOOPBACK
from splitserve.local.supervisor import RunningProcess, Supervisor

INSTALL_HINT = "pip install 'splitserve[gateway]'"


def fail_open(deployment: LocalDeployment) -> bool:
    """spec.gateway.failureMode, FailClose (the Gateway API Inference Extension's default) unless the file
    sets FailOpen: without a picker, a request fails rather than going to an endpoint Envoy picks."""
    gateway = deployment.spec.gateway
    return gateway is not None and gateway.failure_mode == "FailOpen"


def missing_envoy() -> str | None:
    """Why `--gateway envoy` cannot run here, in one line; None when it can."""
    if envoy_binary() is None:
        return f"--gateway envoy needs the envoy binary, which is not installed: {INSTALL_HINT}"
    return None


def refusal(change: Change) -> str | None:
    """Why the running gateway cannot take a change of the deployment, or None when it can."""
    if change.new_generation:
        return "a new KV generation replaces the decode workers, which the gateway's Envoy and picker are fixed to"
    changed = sorted(role for role in change.replicas if role != "prefill")
    if changed:
        return f"{', '.join(changed)} replicas: the gateway's Envoy and picker are fixed to the decode workers"
    return None


class LocalGateway:
    """The gateway's processes of one `up` run: their ports, specs and bootstrap file."""

    def __init__(self, supervisor: Supervisor, allocate_port: Callable[[], int], binary: str) -> None:
        self.supervisor = supervisor
        self.allocate_port = allocate_port
        self.binary = binary
        self.ports = GatewayPorts(
            listen=allocate_port(), admin=allocate_port(), epp_grpc=allocate_port(), epp_http=allocate_port()
        )
        self.bootstrap_path: Path = supervisor.run_dir / "envoy.yaml"
        self.processes: list[RunningProcess] = []

    @property
    def endpoint(self) -> str:
        return f"http://{LOOPBACK}:{self.ports.listen}"

    def plan(
        self, deployment: LocalDeployment, inputs: PlanInputs, workers: Sequence[ProcessSpec]
    ) -> list[ProcessSpec]:
        """Sidecars, picker and Envoy for these workers, the bootstrap written; nothing started."""
        decode = [worker for worker in workers if worker.role == "decode"]
        sidecars = [plan_sidecar(deployment, inputs, worker, self.allocate_port()) for worker in decode]
        targets = {worker.base_url: sidecar.port for worker, sidecar in zip(decode, sidecars, strict=True)}
        epp = plan_epp(deployment, inputs, self.ports, targets)
        # The InferencePool: what the picker names, the decode workers' sidecars (aggregated: the workers).
        pool = sidecars or [worker for worker in workers if worker.pool == "decode"]
        self.bootstrap_path.write_text(
            render_bootstrap(
                listen_port=self.ports.listen,
                admin_port=self.ports.admin,
                epp_port=self.ports.epp_grpc,
                fail_open=fail_open(deployment),
                pool_endpoints=[f"{LOOPBACK}:{spec.port}" for spec in pool],
                host=LOOPBACK,
            )
        )
        return [*sidecars, epp, plan_envoy(self.binary, str(self.bootstrap_path), self.ports)]

    def start(
        self,
        deployment: LocalDeployment,
        inputs: PlanInputs,
        workers: Sequence[ProcessSpec],
        startup_timeout: float,
    ) -> list[RunningProcess]:
        """Start them all and wait until each is ready (the stack's finally stops them on failure)."""
        for spec in self.plan(deployment, inputs, workers):
            self.processes.append(self.supervisor.start(spec))
        self.supervisor.wait_ready(self.processes, startup_timeout)
        return self.processes
