"""A CUDA vLLM engine (rlsearch's `VLLMEngine`, in this process) against HF transformers, and rollout throughput."""

from __future__ import annotations

import pytest

from tests.gpu.helpers import BENCH_SHAPE, run_bench

pytestmark = pytest.mark.gpu


def test_cuda_engine_scores_like_hf_with_cuda_graphs_and_a_sized_kv_cache(tiny_model_dir):
    """The GPU defaults (rollout.enforce_eager=auto: CUDA graphs) and rollout.kv_cache_gib=1 (vLLM's
    kv_cache_memory_bytes): the engine's prompt logprobs match HF's within 1e-3 in fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlsearch.loop_thread import LoopThread
    from rlsearch.rollout import EngineSpec, VLLMEngine
    from rlsearch.weights import logprob_mismatch

    ids = list(range(1000, 1160))
    events = LoopThread("gpu-engine")

    async def start() -> VLLMEngine:
        return VLLMEngine(EngineSpec(str(tiny_model_dir), max_model_len=512, kv_cache_gib=1.0))

    engine = events.run(start())
    try:
        config = engine.llm.vllm_config
        engine_logprobs = events.run(engine.score(ids))
    finally:
        events.run(engine.shutdown())
        events.stop()
    print(f"[gpu] engine: enforce_eager={config.model_config.enforce_eager}, kv_cache_memory_bytes="
          f"{config.cache_config.kv_cache_memory_bytes}", flush=True)
    assert (config.model_config.enforce_eager, config.cache_config.kv_cache_memory_bytes) == (False, 2**30)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        reference = torch.log_softmax(hf(torch.tensor([ids], device="cuda")).logits[0].double(), -1)
    hf_logprobs = [reference[i - 1, ids[i]].item() for i in range(1, len(ids))]
    worst, mean = logprob_mismatch(engine_logprobs, hf_logprobs)
    print(f"[gpu] CUDA vLLM vs HF prompt logprobs (fp32, {len(hf_logprobs)} tokens): max |diff| {worst:.2e}, "
          f"mean {mean:.2e}", flush=True)
    assert worst < 1e-3


def test_rollout_tokens_per_second():
    """bench/rollout.py: the agent loop against bare generation of the same tokens on one CUDA engine."""
    output = run_bench("rollout.py", "--shape", BENCH_SHAPE, "--prompts", "8", "--repeats", "1")
    assert "agent-loop tokens/s / bare generate tokens/s" in output.splitlines()[-1]
