#!/usr/bin/env bash
# The GPU tier (tests/gpu): the actor against HF transformers (Transformer Engine's layer spec when it imports), a CUDA
# vLLM engine against HF, weight syncs with the probe check, and a 3-step training run, printing their figures
# (sync seconds, actor tokens/s against HF's, rollout tokens/s) as "[gpu] ..." lines. The sync over nccl and the
# training run need two GPUs and are skipped on one. Runs in the GPU stack's venv (RLSEARCH_STACK=gpu bash
# scripts/setup.sh) when there is one, else with PYTHON (default python3). Extra arguments go to pytest, e.g. -k actor.
#   bash scripts/gpu_check.sh
#   RLSEARCH_GPU_SHAPE=0.5b bash scripts/gpu_check.sh     # the benches on a Qwen2.5-0.5B-shaped random model
set -euo pipefail
export RLSEARCH_STACK="${RLSEARCH_STACK:-gpu}"
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$RLSEARCH_ROOT"
PY="${PYTHON:-python3}"
if [[ -z "${PYTHON:-}" && -x "$VENV/bin/python" ]]; then
  PY="$VENV/bin/python"
fi
export HF_HUB_OFFLINE=1
exec "$PY" -m pytest -m gpu tests/gpu -s -q -rs "$@"
