"""The Megatron actor on one GPU (no Ray): bench/gpu_actor_check.py with the layer spec actor.transformer_impl=auto
picks (Transformer Engine when transformer_engine.pytorch imports, else the local spec)."""

from __future__ import annotations

import pytest

from tests.gpu.helpers import BENCH_SHAPE, run_bench

pytestmark = pytest.mark.gpu


def test_actor_matches_hf_logprobs_in_float32_and_trains():
    """The bench fails unless policy and reference logprobs match HF transformers within 1e-4 (fp32), and GRPO steps
    are finite and move the policy; it prints actor tokens/s against HF's in the same process."""
    from rlsearch.devices import transformer_engine_status

    output = run_bench("gpu_actor_check.py", "--shape", BENCH_SHAPE, "--time-steps", "2")
    spec = "transformer_engine" if transformer_engine_status().state == "ok" else "local"
    assert f"backend nccl, layer spec {spec}," in output
    assert output.splitlines()[-1] == "PASS"


def test_actor_trains_in_bfloat16():
    """bf16, the GPU default (model.dtype=auto): parity is printed (not checked: bf16 kernels differ by ~1e-2)."""
    output = run_bench("gpu_actor_check.py", "--shape", BENCH_SHAPE, "--dtype", "bfloat16", "--time-steps", "2")
    assert "parity policy    : max |logprob diff| vs HF" in output
    assert output.splitlines()[-1] == "PASS"
