#!/usr/bin/env bash
# Train a search agent with GRPO on the embedded default (tiny model, toy corpus, local BM25 retriever).
# Installs what is missing, builds the default assets once, then trains.
# Any dotted config override is passed through, e.g.:
#   bash examples/run_search_grpo.sh trainer.total_steps=3 trainer.output_dir=/tmp/run
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/prepare_default.sh"

exec "$PY" -m rlsearch train --config "${RLSEARCH_CONFIG:-examples/configs/search_grpo_tiny.yaml}" "$@"
