"""Cold start from zero decode replicas, measured phase by phase on the real control path.

The path is the one tests/operator_e2e/test_scale_from_zero.py proves (its `ScaleFromZeroRig`, in
testkit/rigs/scale_from_zero.py, is the harness): the API emulator and the kopf operator as
subprocesses, a real Prometheus scraping the router and the workers, the router with EndpointSlice
discovery, simulated vLLM workers. Each run sends one streaming request with decode at zero and
times, from the request's arrival:

    queued       the router holds it in the decode admission queue
    scaled       the decode Deployment's spec.replicas is 1 (the autoscaler's /scale landed)
    ready        a decode worker is up and in the router's pool (sim: starts in milliseconds)
    first token  the first streamed token reached the client (prefill leg + KV pull + decode step;
                 the simulated workers run the cpu-tiny profile at its real speed, time_scale 1)

then waits for the autoscaler to take decode back to zero (the scale-down window) before the next run.

A simulated worker is ready in milliseconds; a real vLLM engine is not. The "with vLLM" lines add a
documented engine start-up time (tests/vllm/CALIBRATION.md and /work/shared/notes/vllm-cpu.md:
`splitserve worker` start to /health 200) plus the kubelet's startup-probe period, instead of
starting vLLM here.

    python benchmarks/autoscaling/cold_start.py                       # 4 runs at 1 s/1 s, 2 at 5 s/5 s
    python benchmarks/autoscaling/cold_start.py --runs 3 --settings 1:1s --json cold_start.json
    python benchmarks/autoscaling/cold_start.py --smoke --out /tmp/cold_start.json   # one run at 1 s/1 s

Needs the `prometheus` binary. Takes about seven minutes with the defaults (scaling back to zero
between runs waits out the scale-down window and the p90 latency's one-minute rate window).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from testkit.emulator.fixtures import EmulatorProcess  # noqa: E402
from testkit.operator import OperatorProcess, install_crd  # noqa: E402
from testkit.prometheus import PROMETHEUS_BINARY  # noqa: E402
from testkit.rigs.scale_from_zero import ColdStart, RigSettings, ScaleFromZeroRig  # noqa: E402

# `splitserve worker` start to /health 200 for one vLLM-CPU engine with the tiny model, seconds.
# Idle machine: /work/shared/notes/vllm-cpu.md (~26 s alone); loaded 2-core machine (load average
# 10-28): tests/vllm/CALIBRATION.md, "one engine alone on the loaded machine" (155-184 s).
VLLM_READY_FIGURES_S: dict[str, tuple[float, float]] = {
    "vLLM-CPU, idle machine": (26.0, 26.0),
    "vLLM-CPU, loaded machine": (155.0, 184.0),
}
# The worker's startupProbe polls /health every 10 s (builders/workers.py): up to one period more.
STARTUP_PROBE_PERIOD_S = 10.0


@dataclass(frozen=True)
class Phases:
    """One run's phases as durations, seconds."""

    arrival_to_queued: float
    queued_to_scaled: float
    scaled_to_ready: float
    ready_to_first_token: float
    time_to_first_token: float
    scale_back_to_zero: float

    @classmethod
    def of(cls, start: ColdStart, back_to_zero_s: float) -> Phases:
        return cls(
            arrival_to_queued=start.queued_s,
            queued_to_scaled=start.scaled_s - start.queued_s,
            scaled_to_ready=start.worker_ready_s - start.scaled_s,
            ready_to_first_token=start.first_token_s - start.worker_ready_s,
            time_to_first_token=start.first_token_s,
            scale_back_to_zero=back_to_zero_s,
        )


@dataclass(frozen=True)
class SettingsResult:
    autoscaling_interval_s: int
    scrape_interval: str
    scale_down_window_s: int
    runs: list[Phases]


def parse_setting(text: str) -> tuple[int, str]:
    """'INTERVAL:SCRAPE', e.g. '1:1s' → (1, '1s')."""
    interval, _, scrape = text.partition(":")
    if not interval.isdigit() or not scrape.endswith("s") or not scrape[:-1].isdigit():
        raise argparse.ArgumentTypeError(f"expected AUTOSCALING_INTERVAL_S:SCRAPE_INTERVAL like 1:1s, got {text!r}")
    return int(interval), scrape


async def measure(
    emulator: EmulatorProcess, workdir: Path, index: int, interval_s: int, scrape: str, window_s: int, runs: int
) -> SettingsResult:
    settings = RigSettings(
        name=f"coldstart{index}",
        autoscaling_interval_s=interval_s,
        scrape_interval=scrape,
        scale_down_window_s=window_s,
        time_scale=1.0,  # the cpu-tiny profile at its real speed: first-token times like vLLM-CPU's
    )
    results: list[Phases] = []
    async with ScaleFromZeroRig(emulator, workdir / settings.name, settings) as rig:
        for run in range(runs):
            start = await rig.cold_start()
            if start.completion_tokens <= 0:
                raise RuntimeError(f"run {run}: empty answer {start.answer!r}")
            back = await rig.back_to_zero()
            phases = Phases.of(start, back)
            results.append(phases)
            print(
                f"  [{interval_s}s/{scrape}] run {run + 1}/{runs}: queued {phases.arrival_to_queued:.3f}s, "
                f"scaled +{phases.queued_to_scaled:.2f}s, ready +{phases.scaled_to_ready:.3f}s, "
                f"first token +{phases.ready_to_first_token:.3f}s (TTFT {phases.time_to_first_token:.2f}s); "
                f"back to zero after {phases.scale_back_to_zero:.1f}s",
                flush=True,
            )
    return SettingsResult(interval_s, scrape, window_s, results)


def spread(values: Sequence[float]) -> str:
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"


def report(results: list[SettingsResult]) -> str:
    lines = ["", "Cold start from zero decode replicas (seconds, min / median / max)", ""]
    for result in results:
        runs = result.runs
        lines.append(
            f"autoscaling.intervalSeconds={result.autoscaling_interval_s}, Prometheus scrape {result.scrape_interval}, "
            f"scaleDownStabilizationSeconds={result.scale_down_window_s}, {len(runs)} runs:"
        )
        rows = [
            ("request arrival -> held in router queue", [r.arrival_to_queued for r in runs]),
            ("held -> scale decision applied (0->1)", [r.queued_to_scaled for r in runs]),
            ("scaled -> sim worker ready in router", [r.scaled_to_ready for r in runs]),
            ("ready -> first token (prefill+KV+decode)", [r.ready_to_first_token for r in runs]),
            ("TTFT, simulated worker (cpu-tiny speed)", [r.time_to_first_token for r in runs]),
            ("idle -> scaled back to zero", [r.scale_back_to_zero for r in runs]),
        ]
        lines += [f"  {label:<44} {spread(values)}" for label, values in rows]
        control = [r.arrival_to_queued + r.queued_to_scaled for r in runs]
        token = [r.ready_to_first_token for r in runs]
        for label, (low, high) in VLLM_READY_FIGURES_S.items():
            best = min(control) + low + min(token)
            worst = max(control) + high + STARTUP_PROBE_PERIOD_S + max(token)
            lines.append(f"  {'TTFT projected, ' + label:<44} {best:.0f} - {worst:.0f}")
        lines.append("")
    lines.append(
        "Projection: arrival->scaled and ready->first token as measured, plus the engine's documented start-up "
        f"({', '.join(f'{k} {a:g}-{b:g} s' for k, (a, b) in VLLM_READY_FIGURES_S.items())}) "
        f"and up to one {STARTUP_PROBE_PERIOD_S:g} s startup-probe period; image pull and scheduling not included."
    )
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> list[SettingsResult]:
    with tempfile.TemporaryDirectory(prefix="cold-start-") as tmp:
        workdir = Path(tmp)
        emulator = EmulatorProcess(workdir)
        emulator.start()
        operator = OperatorProcess(emulator, workdir)
        try:
            with emulator.client() as client:
                install_crd(client)
            operator.start()
            results = []
            for index, (interval_s, scrape) in enumerate(args.settings):
                runs = args.runs if args.runs is not None else (4 if index == 0 else 2)
                results.append(
                    await measure(emulator, workdir, index, interval_s, scrape, args.scale_down_window, runs)
                )
            return results
        finally:
            operator.stop()
            emulator.kill()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--settings",
        type=parse_setting,
        nargs="+",
        default=[(1, "1s"), (5, "5s")],
        help="AUTOSCALING_INTERVAL_S:SCRAPE_INTERVAL pairs to measure (default: 1:1s 5:5s)",
    )
    parser.add_argument("--runs", type=int, default=None, help="runs per setting (default: 4, then 2)")
    parser.add_argument("--scale-down-window", type=int, default=5, help="scaleDownStabilizationSeconds")
    parser.add_argument("--json", "--out", type=Path, default=None, help="also write the runs to this JSON file")
    parser.add_argument("--smoke", action="store_true", help="one run at 1 s/1 s (seconds): does it still run?")
    args = parser.parse_args(argv)
    if args.runs is not None and args.runs < 1:
        parser.error("--runs must be at least 1")
    if args.smoke:
        args.settings, args.runs = [(1, "1s")], 1
        args.json = args.json or Path(tempfile.mkdtemp(prefix="cold-start-smoke-")) / "cold_start.json"

    if shutil.which(PROMETHEUS_BINARY) is None:
        print(f"cold_start: error: the {PROMETHEUS_BINARY!r} binary is needed (apt-get install prometheus)")
        return 1
    results = asyncio.run(main_async(args))
    print(report(results))
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
        print(f"\nruns written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
