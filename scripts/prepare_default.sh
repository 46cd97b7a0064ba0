#!/usr/bin/env bash
# Sourced by the example run scripts: installs what is missing (scripts/setup.sh), builds the embedded default
# assets once (tiny model, toy corpus and QA under outputs/assets) and sets PY to the environment's python.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
PY="${RLSEARCH_VENV:-$ROOT/.venv}/bin/python"
export HF_HUB_OFFLINE=1 PYTHONWARNINGS=ignore

ASSETS="outputs/assets"
[[ -f "$ASSETS/tiny-qwen2/config.json" ]] || "$PY" -m rlsearch make-tiny-model --out "$ASSETS/tiny-qwen2"
# sft.jsonl (the demonstrations) came later than the rest: assets made before it are made again
[[ -f "$ASSETS/toy/sft.jsonl" ]] || "$PY" -m rlsearch make-toy-data --out "$ASSETS/toy"
