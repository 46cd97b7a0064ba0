#!/usr/bin/env bash
# Megatron checkpoint (RUN/checkpoints/step_N, any TP/PP) -> HuggingFace model dir.
# Extra options after the positional arguments go to `rlsearch convert mcore-to-hf` (--dtype bf16, --verify, and
# --peft-adapter DIR for a LoRA run: its adapters as a PEFT adapter beside the merged model).
set -euo pipefail

if [[ $# -lt 2 || "$1" == -* || "$2" == -* ]]; then
    echo "usage: $0 CKPT OUT [BASE_HF_DIR] [--dtype bf16|fp32] [--verify] [--peft-adapter DIR]" >&2
    echo "  e.g. $0 outputs/search_grpo_tiny/checkpoints/step_000003 outputs/hf_step_3 --verify" >&2
    exit 2
fi
ckpt=$1 out=$2
shift 2
args=(--ckpt "$ckpt" --out "$out")
if [[ $# -gt 0 && "$1" != -* ]]; then
    args+=(--base-hf-dir "$1")
    shift
fi

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
python=python3
[[ -x "$repo/.venv/bin/python" ]] && python="$repo/.venv/bin/python"
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"  # paths stay relative to the caller's dir
exec "$python" -m rlsearch convert mcore-to-hf "${args[@]}" "$@"
