#!/usr/bin/env bash
# Set up the environment (idempotent) and run the whole test suite. Extra arguments go to pytest.
# The suite runs in two lanes side by side (tests/conftest.py says which tests go where); RLSEARCH_TEST_LANES=1 runs
# it in one process, in order (for -x, --pdb, or a machine with one core).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$RLSEARCH_ROOT"
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
LANES=(-n "${RLSEARCH_TEST_LANES:-2}" --dist loadgroup)
if [ "${RLSEARCH_TEST_LANES:-2}" = 1 ]; then LANES=(-p no:xdist); fi
exec "$VENV/bin/python" -m pytest tests "${LANES[@]}" --durations=25 "$@"
