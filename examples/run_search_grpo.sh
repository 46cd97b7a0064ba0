#!/usr/bin/env bash
# Train a search agent with GRPO on the embedded default (tiny model, toy corpus, local BM25 retriever).
# Installs what is missing, builds the default assets once, then trains.
# Any dotted config override is passed through, e.g.:
#   bash examples/run_search_grpo.sh trainer.total_steps=3 trainer.output_dir=/tmp/run
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
PY="${RLSEARCH_VENV:-$ROOT/.venv}/bin/python"
export HF_HUB_OFFLINE=1 PYTHONWARNINGS=ignore

ASSETS="outputs/assets"
[[ -f "$ASSETS/tiny-qwen2/config.json" ]] || "$PY" -m rlsearch make-tiny-model --out "$ASSETS/tiny-qwen2"
[[ -f "$ASSETS/toy/corpus.jsonl" ]] || "$PY" -m rlsearch make-toy-data --out "$ASSETS/toy"

exec "$PY" -m rlsearch train --config "${RLSEARCH_CONFIG:-examples/configs/search_grpo_tiny.yaml}" "$@"
