#!/usr/bin/env bash
# Sourced by the example run scripts: installs what is missing (scripts/setup.sh), builds the embedded default
# assets once (tiny model, toy corpus and QA under outputs/assets) and sets PY to the environment's python.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
PY="${RLSEARCH_VENV:-$ROOT/.venv}/bin/python"
export HF_HUB_OFFLINE=1 PYTHONWARNINGS=ignore

# quietly LOG COMMAND...: run COMMAND with its output in LOG; on failure print LOG's end and stop
quietly() {
  local log="$1"; shift
  mkdir -p "$(dirname "$log")"
  if ! "$@" > "$log" 2>&1; then
    tail -n 40 "$log" >&2
    echo "$(basename "$0"): failed: $*; its whole output: $log" >&2
    exit 1
  fi
}

ASSETS="outputs/assets"
# sft.jsonl (the demonstrations) came later than the rest: assets made before it are made again
if [[ ! -f "$ASSETS/tiny-qwen2/config.json" || ! -f "$ASSETS/toy/sft.jsonl" ]]; then
  echo "[rlsearch] building the embedded default once: a random-init tiny Qwen2 and a toy corpus with questions ($ASSETS)"
  [[ -f "$ASSETS/tiny-qwen2/config.json" ]] ||
    quietly "$ASSETS/make-tiny-model.log" "$PY" -m rlsearch make-tiny-model --out "$ASSETS/tiny-qwen2"
  quietly "$ASSETS/make-toy-data.log" "$PY" -m rlsearch make-toy-data --out "$ASSETS/toy"
fi
