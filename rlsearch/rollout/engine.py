"""A vLLM engine for rollouts: token-in/token-out generation, prompt scoring and in-place weight updates.

The engine is vLLM's AsyncLLM (the EngineCore runs in a subprocess): every method is a coroutine and must run on
the event loop the engine was created on (`RolloutWorker` owns that loop). Requests submitted together are
batched by vLLM's scheduler, and a request submitted while others run joins the running batch.

A weight update may land while requests are in flight: the scheduler is paused with the requests kept, the
weights are loaded, every running request is preempted so that its KV cache is recomputed with the new weights,
and the scheduler resumes. Tokens sampled after the update come from the new weights (their logprobs too), so a
trajectory may hold tokens of two policy versions; ``weight_version`` counts the updates.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import os
from dataclasses import dataclass

import torch

from ..bridge.bucket import WeightBucket
from ..config import ModelConfig, RolloutConfig
from .weight_loader import stage_bucket


@dataclass
class EngineSpec:
    model_path: str
    dtype: str = "float32"
    seed: int = 0
    max_model_len: int = 2048
    kv_cache_gib: float = 1.0
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool = True

    @classmethod
    def from_config(cls, model: ModelConfig, rollout: RolloutConfig, seed: int) -> EngineSpec:
        return cls(
            model_path=model.path, dtype=model.dtype, seed=seed,
            max_model_len=rollout.max_prompt_tokens + rollout.max_response_tokens, kv_cache_gib=rollout.kv_cache_gib,
            gpu_memory_utilization=rollout.gpu_memory_utilization, enforce_eager=rollout.enforce_eager,
        )


def configure_vllm_environment(kv_cache_gib: float) -> None:
    """Settings vLLM reads at import. With V1 multiprocessing off, vLLM on CPU keeps the uni executor: the model
    runs inside the EngineCore process (which AsyncLLM always starts) instead of one more worker process."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(kv_cache_gib))))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


class VLLMEngine:
    """Owns one AsyncLLM; create it on the event loop that will call it."""

    def __init__(self, spec: EngineSpec) -> None:
        configure_vllm_environment(spec.kv_cache_gib)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        if torch.cuda.is_available():
            extra = {"gpu_memory_utilization": spec.gpu_memory_utilization}
        else:
            # after a partial (chunked) prefill vLLM rewinds the request's seeded generator, which a CPU generator
            # cannot do (the EngineCore dies): prefills are scheduled whole instead
            extra = {"enable_chunked_prefill": False, "max_num_batched_tokens": max(2048, spec.max_model_len)}
        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
            model=spec.model_path,
            dtype=spec.dtype,
            seed=spec.seed,
            max_model_len=spec.max_model_len,
            enforce_eager=spec.enforce_eager,
            enable_prefix_caching=True,
            distributed_executor_backend="uni",
            worker_extension_cls="rlsearch.rollout.weight_loader.WeightLoaderExtension",
            disable_log_stats=True,
            **extra,
        ))
        self.tokenizer = self.llm.get_tokenizer()
        self._request_ids = itertools.count()
        self.weight_version = 0  # weight updates finished on this engine

    async def generate(self, prompts: list[list[int]], sampling_params: list) -> list:
        """One finished `RequestOutput` per prompt (in order); the requests run concurrently."""
        return list(await asyncio.gather(*(self._generate_one(ids, p) for ids, p in zip(prompts, sampling_params))))

    async def _generate_one(self, prompt_ids: list[int], sampling_params):
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if sampling_params.output_kind != RequestOutputKind.FINAL_ONLY:
            sampling_params = sampling_params.clone()
            sampling_params.output_kind = RequestOutputKind.FINAL_ONLY
        final = None
        # vLLM keeps a reference to the id list it is given: hand it a copy
        request = TokensPrompt(prompt_token_ids=list(prompt_ids))
        async for output in self.llm.generate(request, sampling_params, request_id=f"r{next(self._request_ids)}"):
            final = output
        return final

    async def score(self, token_ids: list[int]) -> list[float]:
        """Teacher-forced logprob of every token after the first (the engine's own forward pass)."""
        from vllm import SamplingParams

        output = await self._generate_one(token_ids, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0))
        return [entry[token].logprob for token, entry in zip(token_ids[1:], output.prompt_logprobs[1:])]

    async def begin_weight_update(self) -> None:
        """Pause scheduling (requests in flight are kept, not aborted) and open a reload session."""
        await self.llm.pause_generation(mode="keep", clear_cache=False)
        await self.llm.collective_rpc("rlsearch_begin_weight_update")

    async def load_weight_bucket(self, bucket: WeightBucket) -> tuple[int, int]:
        """Load one bucket (its checksum is verified inside the engine worker); returns (tensors, bytes)."""
        staged = stage_bucket(bucket)
        try:
            (loaded,) = await self.llm.collective_rpc("rlsearch_load_weight_bucket", args=(staged,))
        finally:
            os.unlink(staged["path"])
        return tuple(loaded)

    async def finish_weight_update(self) -> None:
        """Close the reload session; requests in flight continue with the new weights. A failed update leaves the
        engine paused: nothing samples from half-loaded weights."""
        (missing,) = await self.llm.collective_rpc("rlsearch_finish_weight_update")
        if missing:
            raise RuntimeError(f"weight update left {len(missing)} engine parameters unset, e.g. {missing[:3]}")
        # KV blocks computed with the old weights, cached or held by running requests, would silently mix old and
        # new weights: running requests are preempted (recomputed on resume) and the prefix cache is emptied
        await self.llm.reset_prefix_cache(reset_running_requests=True)
        self.weight_version += 1
        await self.llm.resume_generation()

    async def reset_prefix_cache(self) -> None:
        await self.llm.reset_prefix_cache()

    async def shutdown(self) -> None:
        """Stop the EngineCore process. The engine is unusable afterwards."""
        llm, self.llm = self.llm, None
        llm.shutdown()
        # dropped now, not at interpreter exit, where AsyncLLM.__del__ fails on torn-down module globals
        del llm
        gc.collect()
