"""A model's shape as the memory plan needs it, read from its HuggingFace config.json, and the parameters each
pipeline stage of a Megatron layout holds on one rank."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..config import read_hf_config

# HF model types whose attention projections have biases (the others read `attention_bias`)
_QKV_BIAS_TYPES = ("qwen2", "qwen2_moe")
# HF model types with a norm on each head's query and key (Megatron's qk_layernorm)
_QK_NORM_TYPES = ("qwen3", "qwen3_moe")


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # a dense layer's FFN size
    vocab: int
    tied_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    experts: int = 0  # routed experts per layer (0: dense)
    experts_per_token: int = 0
    expert_ffn: int = 0
    shared_expert_ffn: int = 0  # Qwen2-MoE's shared expert (gated)
    # a critic's model (algo.advantage=gae): its output layer is a value head, Linear(hidden, 1) with a bias, whole on
    # every tensor-parallel rank and never tied to the embedding (rlsearch.megatron.model.ValueHead)
    value_head: bool = False

    @classmethod
    def from_hf_config(cls, config: dict) -> ModelShape:
        heads = config["num_attention_heads"]
        model_type = config.get("model_type", "")
        experts = config.get("num_experts") or config.get("num_local_experts") or 0
        return cls(
            hidden=config["hidden_size"], layers=config["num_hidden_layers"], heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            ffn=config.get("intermediate_size", 0), vocab=config["vocab_size"],
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=model_type in _QKV_BIAS_TYPES or bool(config.get("attention_bias", False)),
            qk_norm=model_type in _QK_NORM_TYPES,
            experts=experts, experts_per_token=config.get("num_experts_per_tok", 0) if experts else 0,
            expert_ffn=config.get("moe_intermediate_size", 0) if experts else 0,
            shared_expert_ffn=config.get("shared_expert_intermediate_size", 0) if experts else 0,
        )

    @classmethod
    def from_model_dir(cls, path: str | Path) -> ModelShape:
        return cls.from_hf_config(read_hf_config(path))

    def describe(self) -> str:
        experts = (f", {self.experts} experts ({self.experts_per_token} per token, FFN {self.expert_ffn})"
                   if self.experts else f", FFN {self.ffn}")
        head = ", a value head" if self.value_head else ""
        return (f"hidden {self.hidden}, {self.layers} layers, {self.heads} heads ({self.kv_heads} kv, dim "
                f"{self.head_dim}){experts}, vocabulary {self.vocab}{head}, {self.total_parameters() / 1e9:.2f}B "
                "parameters")

    def total_parameters(self) -> int:
        """Every parameter of the model once (tied embeddings once)."""
        stage = stage_parameters(self, tp=1, pp=1, ep=1, stage=0)
        return stage.dense + stage.expert


@dataclass(frozen=True)
class StageParameters:
    """The parameters one rank of a pipeline stage holds."""

    dense: int  # sharded over tensor-parallel ranks (norms and routers replicated), replicated over data-parallel
    # routed experts: split over expert-parallel ranks, each expert's FFN over the tensor-parallel ones, replicated over
    # the rest of data parallelism
    expert: int


def stage_parameters(shape: ModelShape, tp: int, pp: int, ep: int, stage: int) -> StageParameters:
    """Parameters on one rank of pipeline stage `stage` (of `pp`; each holds layers / pp layers, over all its virtual
    stages). Megatron's layout: the embedding on the first stage, the final norm and the output layer on the last
    (with tied embeddings and pp > 1 the last stage keeps its own copy of the embedding to project with; a critic's
    last stage holds its value head instead, `ModelShape.value_head`); routed experts over the `ep` expert-parallel
    ranks, and each expert's FFN over the expert-tensor-parallel ones, as many as `tp` (initialize_model_parallel's
    default, which rlsearch.megatron.parallel keeps)."""
    h, d = shape.hidden, shape.head_dim
    attention = (h * (shape.heads + 2 * shape.kv_heads) * d // tp + shape.heads * d * h // tp
                 + (shape.heads + 2 * shape.kv_heads) * d // tp * shape.qkv_bias + 2 * d * shape.qk_norm)
    norms = 2 * h
    dense_per_layer = attention + norms
    expert_per_layer = 0
    if shape.experts:
        dense_per_layer += shape.experts * h  # the router
        if shape.shared_expert_ffn:
            dense_per_layer += 3 * h * shape.shared_expert_ffn // tp + h  # the shared expert and its gate
        expert_per_layer = shape.experts // ep * 3 * h * shape.expert_ffn // tp
    else:
        dense_per_layer += 3 * h * shape.ffn // tp  # gate and up projections, then down
    layers = shape.layers // pp
    dense = layers * dense_per_layer
    embedding = shape.vocab // tp * h
    if stage == 0:
        dense += embedding
    if stage == pp - 1:
        dense += h  # the final norm
        if shape.value_head:
            dense += h + 1  # one value per position, whole on each tensor-parallel rank
        elif not shape.tied_embeddings or pp > 1:
            dense += embedding  # the output layer
    return StageParameters(dense=dense, expert=layers * expert_per_layer)


# actor.lora.targets, the linear layers of a transformer layer (Megatron's linear_qkv, linear_proj, linear_fc1,
# linear_fc2); a MoE model's MLPs are experts, which take no adapters
LORA_TARGETS = ("qkv", "proj", "fc1", "fc2")
DENSE_MLP_TARGETS = ("fc1", "fc2")


def lora_targets_of(shape: ModelShape) -> tuple[str, ...]:
    """The targets actor.lora can adapt in `shape`: all four, or a MoE model's attention only."""
    return tuple(t for t in LORA_TARGETS if not (shape.experts and t in DENSE_MLP_TARGETS))


def adapter_parameters(shape: ModelShape, tp: int, pp: int, rank: int, targets: tuple[str, ...]) -> int:
    """actor.lora's adapter parameters on one rank of a pipeline stage (each holds layers / pp layers): for every
    adapted linear layer A [rank, input] and B [output, rank], split over the tensor-parallel ranks as
    rlsearch.megatron.lora lays them out: a column-parallel layer's (qkv, fc1) B on its output like the weight, A
    whole; a row-parallel layer's (proj, fc2) A on its input like the weight, B whole."""
    if not rank:
        return 0
    h, query, key_value = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    per_target = {"qkv": h + (query + 2 * key_value) // tp, "proj": query // tp + h, "fc1": h + 2 * shape.ffn // tp,
                  "fc2": shape.ffn // tp + h}
    refused = set(targets) - set(lora_targets_of(shape))
    if refused:
        raise ValueError(f"actor.lora.targets has {', '.join(sorted(refused))}: the model's MLPs are "
                         "mixture-of-experts layers, which take no adapters; adapt the attention only "
                         "(actor.lora.targets=[qkv,proj])")
    return shape.layers // pp * rank * sum(per_target[target] for target in targets)
