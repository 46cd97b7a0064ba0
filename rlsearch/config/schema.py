"""The training config: one dataclass per section. Field comments are the config reference."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    path: str = "outputs/assets/tiny-qwen2"  # HuggingFace model dir (config.json, safetensors, tokenizer)
    dtype: str = "float32"  # float32 | bfloat16: parameter and engine dtype


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=lambda: ["outputs/assets/toy/train.jsonl"])
    batch_size: int = 4  # prompts per step; each is sampled rollout.group_size times
    shuffle: bool = True  # reshuffled every epoch from trainer.seed


@dataclass
class ActorConfig:
    tp: int = 1  # tensor-parallel size
    pp: int = 1  # pipeline-parallel size
    dp: int = 1  # data-parallel size; ranks = tp * pp * dp
    backend: str = "auto"  # auto | gloo | nccl: auto picks nccl when CUDA is available
    transformer_impl: str = "auto"  # auto | local | transformer_engine
    lr: float = 1e-5
    min_lr: float = 0.0
    lr_warmup_steps: int = 0
    lr_decay_style: str = "constant"  # constant | linear | cosine
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    clip_grad: float = 1.0  # global grad-norm clip; 0 disables
    micro_batch_size: int = 4  # sequences per micro-batch
    num_threads: int = 0  # torch intra-op threads per rank; 0 = cores / ranks


@dataclass
class AlgoConfig:
    clip_ratio_low: float = 0.2  # PPO clip: ratio >= 1 - clip_ratio_low
    clip_ratio_high: float = 0.2  # PPO clip: ratio <= 1 + clip_ratio_high
    kl_coef: float = 0.0  # KL penalty to the frozen reference (0 disables the reference model)
    kl_estimator: str = "k3"  # k1 | k2 | k3
    loss_agg: str = "token_mean"  # token_mean | seq_mean_token_mean
    norm_adv_by_std: bool = True  # GRPO: (r - mean) / (std + eps); false gives Dr. GRPO's r - mean
    adv_eps: float = 1e-6


@dataclass
class RolloutConfig:
    protocol: str = "search_r1"  # tool-call format (search_r1)
    group_size: int = 4  # samples per prompt (the GRPO group)
    temperature: float = 1.0
    top_p: float = 1.0
    max_turns: int = 4  # model turns per trajectory (tool calls + final answer)
    max_prompt_tokens: int = 512  # longer prompts are an error naming the row
    max_response_tokens: int = 512  # budget for everything after the prompt: model + observation tokens
    max_tokens_per_turn: int = 128
    # text -> bias added to the logits of that text's tokens (alone and after a space); lets a random-init
    # model reach the tool path, e.g. {"</search>": 12.0}. Leave empty for a real model.
    logit_bias: dict[str, float] = field(default_factory=dict)
    assistant_prefix: str = ""  # text prefilled at the start of the assistant turn (part of the prompt)
    kv_cache_gib: float = 1.0  # vLLM KV cache size on CPU (VLLM_CPU_KVCACHE_SPACE)
    gpu_memory_utilization: float = 0.5  # vLLM KV cache share of GPU memory (GPU only)
    enforce_eager: bool = True


@dataclass
class RewardConfig:
    format_score: float = 0.0  # reward for a well-formed but wrong <answer>


@dataclass
class RetrieverConfig:
    url: str = ""  # an external Search-R1 /retrieve server; empty = start the local BM25 server
    corpus: str = "outputs/assets/toy/corpus.jsonl"  # JSONL {"id", "contents"} for the local server
    index_cache_dir: str = "outputs/assets/bm25_cache"
    topk: int = 3
    timeout_s: float = 10.0
    max_retries: int = 3
    backoff_s: float = 0.5


@dataclass
class ToolsConfig:
    retriever: RetrieverConfig = field(default_factory=RetrieverConfig)


@dataclass
class BridgeConfig:
    bucket_mb: int = 256  # weight-sync bucket size
    max_logprob_mismatch: float = 1e-4  # abort when engine vs actor logprobs differ more (fp32); 0 disables


@dataclass
class TrainerConfig:
    total_steps: int = 10
    output_dir: str = "outputs/search_grpo_tiny"
    save_interval: int = 0  # checkpoint every N steps (0: only at the end)
    seed: int = 1
    log_trajectories: bool = True  # JSONL of every step's trajectories under output_dir/trajectories
    ray_address: str = ""  # empty: start a local Ray instance on 127.0.0.1


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    bridge: BridgeConfig = field(default_factory=BridgeConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
