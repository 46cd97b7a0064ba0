#!/usr/bin/env bash
# Set up the environment (idempotent) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$RLSEARCH_ROOT"
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
exec "$VENV/bin/python" -m pytest tests --durations=25 "$@"
