#!/usr/bin/env bash
# HuggingFace model dir -> Megatron distributed checkpoint for a TP x PP layout (default 1 x 1).
set -euo pipefail

if [[ $# -lt 2 || $# -gt 4 ]]; then
    echo "usage: $0 HF_DIR OUT [TP] [PP]" >&2
    echo "  e.g. $0 outputs/assets/tiny-qwen2 outputs/tiny-qwen2-tp2pp2 2 2" >&2
    exit 2
fi

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
python=python3
[[ -x "$repo/.venv/bin/python" ]] && python="$repo/.venv/bin/python"
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"  # paths stay relative to the caller's dir
exec "$python" -m rlsearch convert hf-to-mcore --hf-dir "$1" --out "$2" --tp "${3:-1}" --pp "${4:-1}"
