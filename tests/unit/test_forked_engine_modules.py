"""A forked vLLM process drops the modules vLLM's CPU kernel registration cannot scan (rlsearch.rollout.engine): the
registration reads vars() of every value of every module in sys.modules, and fails on llvmlite's library wrappers,
which numba brings in with bm25s (the BM25 retriever's package), when the process it was forked from imported them
(a test session's, where test_moe_sync's in-process engine failed so)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.constants import REPO_ROOT

IN_A_FRESH_PROCESS = """
import json, sys
import bm25s  # noqa: F401  (numba, llvmlite)
from vllm.triton_utils.dispatcher import _rebind_kernels
from rlsearch.rollout.engine import _drop_modules_vllm_cannot_scan

def scan():
    try:
        _rebind_kernels([])  # vLLM's scan of every module, with no kernel to rebind
        return "ok"
    except Exception as error:
        return type(error).__name__

before = scan()
_drop_modules_vllm_cannot_scan()
kept = [name for name in ("vllm", "torch", "bm25s", "rlsearch.rollout.engine") if name in sys.modules]
print(json.dumps({"before": before, "after": scan(), "kept": kept}))
"""


def test_a_forked_vllm_process_drops_the_modules_vllms_kernel_registration_cannot_scan():
    result = subprocess.run([sys.executable, "-c", IN_A_FRESH_PROCESS], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["before"] == "AttributeError"  # what failed test_moe_sync's engine
    assert report["after"] == "ok"
    assert report["kept"] == ["vllm", "torch", "bm25s", "rlsearch.rollout.engine"]
