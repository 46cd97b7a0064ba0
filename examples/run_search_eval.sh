#!/usr/bin/env bash
# Score a HuggingFace model as a search agent (eval only) on the embedded default: the tiny model on the toy test
# set with the local BM25 retriever. Installs what is missing and builds the default assets once, then evaluates.
# Any config override is passed through, e.g.:
#   bash examples/run_search_eval.sh output_dir=/tmp/eval model.path=/ckpt/hf eval.max_examples=50
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/prepare_default.sh"

exec "$PY" -m rlsearch eval --config "${RLSEARCH_CONFIG:-examples/configs/eval_search.yaml}" "$@"
