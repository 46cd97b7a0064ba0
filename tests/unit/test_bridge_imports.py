"""A rank imports only its architecture's mbridge bridge (`make_bridge` through `_registered_bridge`), not every
bridge mbridge has (its vision models' with transformers' vision code, scipy and sklearn: 1.1 of the ~8 CPU-seconds
of a rank's start), and the mbridge packages are still whole for any code that asks for more."""

from __future__ import annotations

import json
import subprocess
import sys

from rlsearch.megatron.model import SUPPORTED_ARCHITECTURES
from tests.constants import REPO_ROOT

IN_A_FRESH_PROCESS = """
import json, sys
from rlsearch.megatron.model import _registered_bridge
bridge = _registered_bridge("qwen3_moe")
from mbridge.core.bridge import _MODEL_REGISTRY
lean = {"bridge": bridge.__name__, "registered": sorted(_MODEL_REGISTRY),
        "heavy imports": sorted(name for name in ("scipy", "sklearn", "mbridge.models.glm4_vl") if name in sys.modules)}
from mbridge import AutoBridge
import mbridge.models
whole = {"AutoBridge": AutoBridge.__name__, "registered": sorted(_MODEL_REGISTRY),
         "bridges": sorted(name for name in vars(mbridge.models) if name.endswith("Bridge"))}
print(json.dumps([lean, whole]))
"""


def test_a_rank_imports_only_its_architectures_bridge_and_mbridge_stays_whole():
    result = subprocess.run([sys.executable, "-c", IN_A_FRESH_PROCESS], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    lean, whole = json.loads(result.stdout.splitlines()[-1])
    # Qwen3-MoE's bridge module imports Qwen2-MoE's, which it derives from
    assert lean == {"bridge": "Qwen3MoEBridge", "registered": ["qwen2_moe", "qwen3_moe"], "heavy imports": []}
    assert whole["AutoBridge"] == "AutoBridge"
    assert set(SUPPORTED_ARCHITECTURES) < set(whole["registered"])
    assert {"Qwen2Bridge", "Qwen3MoEBridge", "LLaMABridge", "InternVL3Bridge"} <= set(whole["bridges"])
