"""bench/memory.py --smoke: every configuration gets a row with the plan's prediction, and either its measured peak
and seconds or the reason it did not run; PPO's actor rank, critic rank and device total (--critic) are measured
beside the plan's figures."""

from __future__ import annotations

import math
import re
import subprocess
import sys

from bench.memory import CONFIGURATIONS, PPO
from tests.constants import REPO_ROOT

ROW = re.compile(r"^tiny\s+256\s+(?P<name>.+?)\s{2,}(?P<rest>.*)$")
PPO_LINE = re.compile(r"^ppo (?P<part>actor rank|critic rank|device total)\s+(?P<measured>\S+) / +(?P<plan>\S+) GB = "
                      r"(?P<ratio>\S+)$")


def test_bench_memory_smoke_has_a_row_with_a_prediction_per_configuration(tmp_path):
    result = subprocess.run([sys.executable, "bench/memory.py", "--smoke", "--out", str(tmp_path)], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=420)  # 1-2 min; 4 with a busy machine's load
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {}
    for line in result.stdout.splitlines():
        match = ROW.match(line)
        if match:
            rows[match.group("name").strip()] = match.group("rest").split()
    assert set(rows) == set(CONFIGURATIONS) | set(PPO), result.stdout
    for name, fields in rows.items():
        if fields[0] == "-":  # refused: "- - PLAN - - refused: why"
            assert float(fields[2]) > 0 and fields[5] == "refused:" and len(fields) > 6, (name, fields)
        else:  # seconds (to 0.001: a tiny critic step takes ms on a fast CPU), peak GB, plan GB, plan/peak, idle GB
            seconds, peak, plan, ratio, idle = map(float, fields[:5])
            # the ratio is of the unrounded figures: each GB figure is printed to 0.005, the ratio to 0.005
            rounding = plan / peak * (0.005 / peak + 0.005 / plan) + 0.005
            assert min(seconds, peak, plan, idle) > 0 and abs(ratio - plan / peak) <= rounding, (name, fields)
    for name in ("none", "selective", "full", "lora", "lora attention", *PPO):
        assert rows[name][0] != "-", (name, rows[name])
    # the smoke runs float32 on CPU, where `rlsearch train` refuses both offloads at start-up: the bench says so too
    assert "ConfigError: 'actor.optimizer_offload_fraction' is 1.0 with float32" in " ".join(
        rows["full + optimizer offload"]), rows
    assert "ConfigError: 'actor.activation_offload' is fine_grained but the cluster has no GPU" in " ".join(
        rows["activation offload"]), rows
    # PPO: measured / plan of its actor rank, its critic rank and their device's total, each printed to 0.001
    ppo = {match["part"]: (float(match["measured"]), float(match["plan"]), float(match["ratio"]))
           for match in map(PPO_LINE.match, result.stdout.splitlines()) if match}
    assert set(ppo) == {"actor rank", "critic rank", "device total"}, result.stdout
    for part, (measured, plan, ratio) in ppo.items():
        rounding = measured / plan * (0.0005 / measured + 0.0005 / plan) + 0.0005
        assert all(map(math.isfinite, (measured, plan, ratio))) and min(measured, plan) > 0, (part, ppo[part])
        assert abs(ratio - measured / plan) <= rounding, (part, ppo[part])
    # the critic's model has a value head where the actor's has its output layer, and no logits chunk: its rank's
    # peak is below the actor rank's (at 16,384 vocabulary rows by ~47 MB of the tensors: 0.20 against 0.27 GB)
    assert ppo["critic rank"][0] < ppo["actor rank"][0], ppo
    assert ppo["device total"][0] > ppo["actor rank"][0] + ppo["critic rank"][0], ppo  # with the idle processes
