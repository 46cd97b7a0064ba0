#!/usr/bin/env bash
# Train a search agent with GRPO on the embedded default (tiny model, toy corpus, local BM25 retriever).
# Installs what is missing, builds the default assets once, then trains.
# Any dotted config override is passed through, e.g.:
#   bash examples/run_search_grpo.sh trainer.total_steps=3 trainer.output_dir=/tmp/run
# RLSEARCH_WARM_START=sft first fine-tunes the model on the toy demonstrations (rlsearch sft, once per
# RLSEARCH_SFT_DIR, default outputs/sft_tiny) and trains from that model, without the random model's prefill and
# logit bias, scoring the policy on the toy test set after the last step:
#   RLSEARCH_WARM_START=sft bash examples/run_search_grpo.sh trainer.total_steps=20
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/prepare_default.sh"

case "${RLSEARCH_WARM_START:-none}" in
  none) ;;
  sft)
    SFT_DIR="${RLSEARCH_SFT_DIR:-outputs/sft_tiny}"
    [[ -f "$SFT_DIR/hf/config.json" ]] || "$PY" -m rlsearch sft --config examples/configs/sft_tiny.yaml \
      output_dir="$SFT_DIR" ${RLSEARCH_SFT_OVERRIDES:-}
    set -- model.path="$SFT_DIR/hf" rollout.assistant_prefix= 'rollout.logit_bias={}' trainer.eval_interval=1000000 \
      "$@"
    ;;
  *) echo "run_search_grpo.sh: RLSEARCH_WARM_START must be none or sft, got '$RLSEARCH_WARM_START'" >&2; exit 2 ;;
esac

exec "$PY" -m rlsearch train --config "${RLSEARCH_CONFIG:-examples/configs/search_grpo_tiny.yaml}" "$@"
