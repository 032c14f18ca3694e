"""`splitserve router` flags, user errors, and SIGTERM draining in a real process."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
import time

import aiohttp
import pytest

from splitserve.router import cli
from splitserve.router.config import DiscoveryKind
from splitserve.router.processes import usable_cores
from splitserve.sim import SimWorker
from testkit.router import sim_config


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.configure(parser)
    return parser.parse_args(list(argv))


def test_workers_default_to_the_usable_cores_and_must_be_positive() -> None:
    cores = usable_cores()
    assert 1 <= cores <= len(os.sched_getaffinity(0))
    assert cli.config_from_args(parse("--decode", "http://d:1")).workers == cores
    assert cli.config_from_args(parse("--decode", "http://d:1", "--workers", "3")).workers == 3
    with pytest.raises(ValueError, match="--workers must be at least 1"):
        cli.config_from_args(parse("--decode", "http://d:1", "--workers", "0"))


def test_kv_events_endpoint_overrides_are_parsed() -> None:
    config = cli.config_from_args(
        parse("--decode", "http://d:1", "--kv-events-endpoint", "http://d:1/=tcp://10.0.0.1:5557")
    )
    assert config.kv_event_endpoints == (("http://d:1", "tcp://10.0.0.1:5557"),)
    with pytest.raises(SystemExit):
        parse("--decode", "http://d:1", "--kv-events-endpoint", "tcp://10.0.0.1:5557")


def test_static_flags_build_the_config() -> None:
    config = cli.config_from_args(
        parse(
            *["--prefill", "http://p1:8000,http://p2:8000/", "--decode", "http://d1:8000", "--policy", "prefix-aware"],
            *["--decode-policy", "kv-aware", "--disagg-threshold-tokens", "256", "--model", "m"],
        )
    )
    assert config.discovery is DiscoveryKind.STATIC
    assert config.prefill_urls == ("http://p1:8000", "http://p2:8000")
    assert (config.prefill_policy, config.decode_policy) == ("prefix-aware", "kv-aware")
    assert config.disagg_threshold_tokens == 256


def test_kubernetes_flags_build_the_config() -> None:
    config = cli.config_from_args(
        parse("--discovery", "kubernetes", "--namespace", "ns", "--prefill-service", "p", "--decode-service", "d")
    )
    assert (config.discovery, config.namespace, config.decode_service) == (DiscoveryKind.KUBERNETES, "ns", "d")
    assert config.has_prefill_source


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ((), "static discovery needs --decode"),
        (("--discovery", "dns"), "needs --decode-service"),
        (("--decode", "http://d:1", "--queue-timeout", "0"), "--queue-timeout must be positive"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(
    argv: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.run(parse(*argv)) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err


def test_bad_url_is_an_argparse_error() -> None:
    with pytest.raises(SystemExit):
        parse("--decode", "d1:8000")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow
@pytest.mark.parametrize("processes", ["1", "2"])
async def test_sigterm_stops_accepting_and_finishes_in_flight_streams(processes: str) -> None:
    slow = sim_config("aggregated", time_scale=1.0)  # CPU-tiny speed: a 400-token answer takes a while
    async with SimWorker(slow) as worker:
        port = _free_port()
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "splitserve.cli", "router", "--host", "127.0.0.1", "--port", str(port),
            "--decode", worker.url, "--drain-seconds", "20", "--log-level", "warning", "--workers", processes,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as session:
                deadline = time.monotonic() + 20
                while True:
                    try:
                        async with session.get(url + "/ready") as ready:
                            if ready.status == 200:
                                break
                    except aiohttp.ClientConnectionError:
                        pass
                    assert time.monotonic() < deadline, "router did not become ready"
                    await asyncio.sleep(0.1)
                body = {"model": "sim-model", "prompt": "tell me a story", "max_tokens": 400, "stream": True}
                async with session.post(url + "/v1/completions", json=body) as response:
                    first = await response.content.readany()
                    process.send_signal(signal.SIGTERM)
                    refused_by = time.monotonic() + 5
                    while True:  # the listening socket closes at once; allow for a busy machine
                        try:
                            async with aiohttp.ClientSession() as fresh, fresh.get(url + "/health"):
                                pass
                        except aiohttp.ClientConnectionError:
                            break
                        assert time.monotonic() < refused_by, "still accepting connections after SIGTERM"
                        await asyncio.sleep(0.05)
                    assert not response.content.at_eof()  # the in-flight stream outlived the listener
                    rest = await response.read()
            stream = first + rest
            assert stream.endswith(b"data: [DONE]\n\n") and b'"error"' not in stream
            assert await asyncio.wait_for(process.wait(), 20) == 0
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ("--discovery", "kubernetes", "--decode-service", "d", "--kubeconfig", "/no/such/kubeconfig"),
            "kubernetes discovery",
        ),
        (("--decode", "http://d:1", "--tokenizer", "/no/such/tokenizer"), "cannot load tokenizer"),
    ],
)
def test_environment_problems_are_one_line_and_exit_1(
    argv: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.run(parse(*argv)) == 1
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err
