#!/usr/bin/env bash
# Set up the environment (idempotent) and run the whole test suite. Extra arguments go to pytest.
# The suite runs in two lanes side by side (tests/plugins/lanes.py says which tests go where); RLSEARCH_TEST_LANES=1 runs
# it in one process, in order (for -x, --pdb, or a machine with one core).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$RLSEARCH_ROOT"
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
LANES=(-n "${RLSEARCH_TEST_LANES:-2}" --dist loadgroup)
if [ "${RLSEARCH_TEST_LANES:-2}" = 1 ]; then LANES=(-p no:xdist); fi
# each lane's processes share the lane's cores: torch, OpenMP (faiss) and the vLLM engines run that many threads, not
# one per core of the machine each (two 2-thread processes on 2 cores took twice as long as two 1-thread processes)
LANE_CORES=$(( $(nproc) / ${RLSEARCH_TEST_LANES:-2} ))
export RLSEARCH_CPU_CORES="${RLSEARCH_CPU_CORES:-$(( LANE_CORES > 0 ? LANE_CORES : 1 ))}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$RLSEARCH_CPU_CORES}"
# The run's scratch: what the suite and the engines, ranks and Ray clusters it starts put in a temporary directory
# (pytest's tmp_path, checkpoints, Ray's sessions, vLLM's sockets) goes to one folder per checkout, which the next run
# clears and a green run removes; a passed test's tmp_path goes as soon as it ends (docs/testing.md, "Disk").
SCRATCH="/tmp/rls-$(printf %s "$RLSEARCH_ROOT" | sha1sum | cut -c1-8)"  # short: Ray's socket paths must fit 107 bytes
rm -rf "$SCRATCH" && mkdir -p "$SCRATCH"
export TMPDIR="$SCRATCH"
status=0
# A test that hangs fails by name with its stack after TEST_TIMEOUT_S (pytest-timeout), generous for the slowest CPU
# seen (its slowest item but the README run took 619 s; tests/plugins/lanes.py gives the README run more); -rs lists skips
"$VENV/bin/python" -m pytest tests "${LANES[@]}" --durations=25 -rs --timeout="${TEST_TIMEOUT_S:-1200}" \
  -o tmp_path_retention_policy=failed "$@" || status=$?
if [ "$status" = 0 ]; then
  rm -rf "$SCRATCH"
else
  echo "test.sh: the run's files are kept in $SCRATCH until the next run" >&2
fi
exit "$status"
