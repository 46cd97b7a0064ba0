#!/usr/bin/env bash
# Train a search agent with GRPO on the embedded default: a tiny Qwen2 with the real Qwen tokenizer, a generated
# corpus about invented entities, a local BM25 retriever. Installs what is missing and builds the default assets once.
#
# The default run warm-starts: a 60-step SFT on the toy demonstrations (about a minute on 2 cores, made once into
# RLSEARCH_SFT_DIR, default outputs/assets/sft-tiny) teaches the tags, then 30 GRPO steps (4 questions x 8 samples)
# reward well-formed searches and answers (reward.format_score, reward.search_score) on top of exact match. The reward climbs and invalid calls
# fall within a few minutes; answering correctly takes far longer on a CPU (docs/benchmarks.md, bench/learning.py).
#   bash examples/run_search_grpo.sh                          # the default run
#   bash examples/run_search_grpo.sh trainer.total_steps=3 trainer.output_dir=/tmp/run   # any dotted override
#   RLSEARCH_WARM_START=none bash examples/run_search_grpo.sh # the random-init model as it is: the opening tag is
#                                                             # prefilled and the closing tag biased (see the config)
#   RLSEARCH_CONFIG=examples/configs/search_grpo_moe_tiny.yaml bash examples/run_search_grpo.sh
#                   # another config: trains its own model.path (no warm start unless RLSEARCH_WARM_START=sft)
#   RLSEARCH_CONFIG=examples/configs/search_grpo_smollm2.yaml bash examples/run_search_grpo.sh
#                   # a real pretrained model, SmolLM2-135M-Instruct: its model.path is its own SFT warm start, which
#                   # scripts/prepare_default.sh builds once with the model and its toy data (docs/benchmarks.md)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/prepare_default.sh"

# the SFT warm start is the default config's (its model); another config trains the model it names
[[ -z "${RLSEARCH_CONFIG:-}" ]] && DEFAULT_WARM_START=sft || DEFAULT_WARM_START=none
case "${RLSEARCH_WARM_START:-$DEFAULT_WARM_START}" in
  none) ;;
  sft)
    SFT_DIR="${RLSEARCH_SFT_DIR:-outputs/assets/sft-tiny}"
    if [[ ! -f "$SFT_DIR/hf/config.json" ]]; then
      echo "[rlsearch] warm start: SFT of the tiny model on the toy demonstrations (once, into $SFT_DIR) ..."
      rm -rf "$SFT_DIR"  # a run stopped half-way left no model: start it again
      quietly "$SFT_DIR/sft.log" "$PY" -m rlsearch sft --config examples/configs/sft_tiny.yaml output_dir="$SFT_DIR" \
        ${RLSEARCH_SFT_OVERRIDES:-}
      grep "^rlsearch sft:" "$SFT_DIR/sft.log" | sed 's/^rlsearch sft:/[rlsearch] warm start:/'
    fi
    # A fine-tuned model writes the tags itself: no prefilled tag, no logit bias. Eight samples a question: with four,
    # a warm start whose search calls are mostly malformed (one SFT seed of three) rarely has a well-formed search in
    # a group to learn from, and learns to answer without searching.
    set -- model.path="$SFT_DIR/hf" rollout.assistant_prefix= 'rollout.logit_bias={}' rollout.group_size=8 "$@"
    ;;
  *) echo "run_search_grpo.sh: RLSEARCH_WARM_START must be sft or none, got '$RLSEARCH_WARM_START'" >&2; exit 2 ;;
esac

exec "$PY" -m rlsearch train --config "${RLSEARCH_CONFIG:-examples/configs/search_grpo_tiny.yaml}" "$@"
