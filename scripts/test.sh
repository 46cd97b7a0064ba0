#!/usr/bin/env bash
# Set up the environment (idempotent) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
exec "${RLSEARCH_VENV:-$ROOT/.venv}/bin/python" -m pytest tests "$@"
