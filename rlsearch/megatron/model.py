"""HF checkpoint <-> Megatron GPTModel through mbridge, with the layer spec chosen for the device.

mbridge's registered bridges map Transformer Engine names, where the layernorms are fused into the next
linear layer. The local spec (CPU) keeps them as separate modules, so `make_bridge` derives a subclass of the
registered bridge with those two names added, and its own mapping dicts (mbridge's tied-embedding
adjustment writes into the class dict, so sharing it across bridges would leak between models).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import torch

from ..devices import local_device, local_gpu_index, transformer_engine_status

# decoder-only models whose mbridge mapping is tested here: dense (tied and untied embeddings) and MoE
MOE_ARCHITECTURES = ("qwen3_moe", "qwen2_moe")
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", *MOE_ARCHITECTURES)
# the mbridge.models module that registers each one's bridge
_BRIDGE_MODULES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe",
                   "qwen2_moe": "qwen2moe"}

# a routed expert's weight in the local spec (SequentialMLP)
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


@dataclass(frozen=True)
class MoESettings:
    """The actor's MoE knobs (ActorConfig's moe_* keys and algo.routing_replay), for `make_bridge`."""

    dispatcher: str = "alltoall"  # alltoall | allgather
    aux_loss_coef: float = 0.0  # load-balancing loss (0: none)
    z_loss_coef: float = 0.0  # router z-loss (0: none)
    record_routing: bool = False  # build the routers with Megatron's RouterReplay (algo.routing_replay=old)


@dataclass(frozen=True)
class ActivationMemory:
    """How the model keeps what its backward pass needs (ActorConfig's recompute* and activation_offload keys, checked
    at start-up by rlsearch.config)."""

    recompute: str = "none"  # none | selective | full
    recompute_method: str = "uniform"  # full: uniform | block
    recompute_num_layers: int = 1  # full: layers per recomputed group (uniform) or per stage (block)
    recompute_modules: tuple[str, ...] = ("core_attn",)  # selective: Megatron's module names
    offload: str = "none"  # none | layer | fine_grained

    def megatron_args(self, num_layers: int, transformer_impl: str, is_moe: bool) -> dict:
        """Megatron TransformerConfig fields for these settings, for a model of `num_layers` layers."""
        args: dict = {}
        if self.recompute == "selective":
            args.update(recompute_granularity="selective", recompute_modules=list(self.recompute_modules))
        elif self.recompute == "full":
            args.update(recompute_granularity="full", recompute_method=self.recompute_method,
                        recompute_num_layers=self.recompute_num_layers)
        if self.offload == "layer":
            # every layer but the last, whose activations the backward pass needs first (Megatron's maximum)
            args.update(cpu_offloading=True, cpu_offloading_num_layers=num_layers - 1, cpu_offloading_activations=True,
                        cpu_offloading_weights=False)
        elif self.offload == "fine_grained":
            modules = ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"]
            if is_moe and transformer_impl == "transformer_engine":
                modules += ["expert_fc1", "moe_act"]  # Megatron offloads these in grouped-GEMM experts only
            args.update(fine_grained_activation_offloading=True, offload_modules=modules)
        return args


_LOCAL_SPEC_LAYERNORM_NAMES = {
    "input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"],
    "pre_mlp_layernorm.weight": ["model.layers.{layer_number}.post_attention_layernorm.weight"],
}


def resolve_transformer_impl(requested: str) -> str:
    """auto -> transformer_engine where this process has a GPU and Transformer Engine's torch part imports, else
    local. An explicit transformer_engine that cannot work here is a RuntimeError saying why."""
    if requested == "local":
        return requested
    on_gpu = local_gpu_index() is not None
    engine = transformer_engine_status()
    if requested == "auto":
        return "transformer_engine" if on_gpu and engine.state == "ok" else "local"
    problem = engine.problem() if on_gpu else "the Transformer Engine layer spec needs a GPU and this process has none"
    if problem:
        raise RuntimeError(f"transformer_impl=transformer_engine: {problem}; or use transformer_impl=local (auto picks "
                           "it without a GPU or a working Transformer Engine)")
    return requested


def check_architecture(model_type: str | None, hf_dir: str) -> None:
    """ValueError naming the supported architectures unless `model_type` (config.json's) is one of them."""
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture '{model_type}' in {hf_dir}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


def make_bridge(hf_dir: str, dtype: torch.dtype, transformer_impl: str, on_cpu: bool,
                moe: MoESettings = MoESettings(), activations: ActivationMemory = ActivationMemory(),
                value_model: bool = False, model_dropout: bool = False):
    """An mbridge Bridge for the HF model at `hf_dir`, configured for our runtime (call after parallel init).
    `value_model`: for a critic (`build_model_chunks(..., value_head_seed=...)`): its output layer is the value head,
    never tied to the embedding, exported under VALUE_HEAD's names. `model_dropout` (actor.dropout=model): the
    training passes apply config.json's attention_dropout and hidden_dropout, which mbridge maps; else none."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(hf_dir)
    _expose_rope_theta(hf_config)
    check_architecture(hf_config.model_type, hf_dir)
    base = _registered_bridge(hf_config.model_type)
    overrides = {"_DIRECT_MAPPING": dict(base._DIRECT_MAPPING)}
    if value_model:
        hf_config.tie_word_embeddings = False  # the head is no vocabulary projection: nothing to share
        overrides["_weight_name_mapping_mcore_to_hf"] = _value_head_names(base)
    is_moe = hf_config.model_type in MOE_ARCHITECTURES
    if transformer_impl == "local":
        overrides.update(
            _OTHER_MAPPING={**base._OTHER_MAPPING, "input_layernorm.weight": _LOCAL_SPEC_LAYERNORM_NAMES[
                "input_layernorm.weight"]},
            _MLP_MAPPING={**base._MLP_MAPPING, "pre_mlp_layernorm.weight": _LOCAL_SPEC_LAYERNORM_NAMES[
                "pre_mlp_layernorm.weight"]},
            _get_transformer_layer_spec=_local_layer_spec,
        )
        if is_moe:
            overrides["_weight_name_mapping_mcore_local_to_global"] = _sequential_expert_names(base)
    bridge_cls = type(f"{transformer_impl.title().replace('_', '')}{base.__name__}", (base,), overrides)
    bridge = bridge_cls(hf_config, dtype=dtype)
    runtime_args = dict(
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        batch_p2p_sync=False,
        # batched send/recv on gloo is matched out of order with interleaved stages (silently wrong losses), and
        # mbridge's overlapped p2p for virtual stages needs it off on nccl as well
        batch_p2p_comm=False,
        # packed micro-batches differ in length, so pipeline stages exchange tensor shapes first
        variable_seq_lengths=True,
        # the actor selects response positions from full-sequence hidden states before the output layer
        sequence_parallel=False,
    )
    if transformer_impl == "local":
        # the local spec has no fused kernels
        runtime_args.update(
            masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
            gradient_accumulation_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        )
    if on_cpu:
        runtime_args.update(use_cpu_initialization=True)
    if not model_dropout:
        runtime_args.update(attention_dropout=0.0, hidden_dropout=0.0)
    if is_moe:
        runtime_args.update(_moe_runtime_args(hf_config.model_type, transformer_impl, moe))
    runtime_args.update(activations.megatron_args(hf_config.num_hidden_layers, transformer_impl, is_moe))
    bridge.set_extra_args(**runtime_args)
    return bridge


def _moe_runtime_args(model_type: str, transformer_impl: str, moe: MoESettings) -> dict:
    args = dict(
        moe_token_dispatcher_type=moe.dispatcher,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss" if moe.aux_loss_coef > 0 else "none",
        moe_aux_loss_coeff=moe.aux_loss_coef,
        moe_z_loss_coeff=moe.z_loss_coef or None,
        moe_enable_routing_replay=moe.record_routing,
        # mbridge overlaps the shared expert with the dispatch, which needs the alltoall dispatcher and CUDA streams
        moe_shared_expert_overlap=False,
    )
    if model_type == "qwen2_moe":
        # HF Qwen2-MoE scales the shared expert by sigmoid(shared_expert_gate(x)); mbridge's config leaves it out
        args["moe_shared_expert_gate"] = True
    if transformer_impl == "local":
        # SequentialMLP (an expert after another), no fused permutation or router kernels
        args.update(moe_grouped_gemm=False, moe_permute_fusion=False, moe_router_fusion=False)
    if moe.record_routing:
        args["moe_router_fusion"] = False  # the fused top-k kernel bypasses Megatron's router replay
    return args


def _sequential_expert_names(base):
    """mbridge maps experts by TEGroupedMLP names (`mlp.experts.linear_fc1.weight<i>`); the local spec builds
    SequentialMLP (`mlp.experts.local_experts.<i>.linear_fc1.weight`). Renamed, then shifted to global expert ids
    on expert-parallel ranks as mbridge does for its own names."""

    def local_to_global(self, model, consider_ep: bool = True) -> dict[str, str]:
        names = base._weight_name_mapping_mcore_local_to_global(self, model, consider_ep=False)
        first_expert = self.config.num_moe_experts // self.mpu.ep_size * self.mpu.ep_rank if consider_ep else 0
        for local, name in names.items():
            match = _LOCAL_EXPERT.search(name)
            if match:
                names[local] = (f"{name[:match.start()]}.mlp.experts.{match.group(2)}.weight"
                                f"{int(match.group(1)) + first_expert}")
        return names

    return local_to_global


def _registered_bridge(model_type: str) -> type:
    """mbridge's registered bridge class of `model_type`, importing only the module that registers it where mbridge
    is not imported yet: the package's __init__ imports every bridge it has, the vision models' with transformers'
    vision code, scipy and sklearn, 1.1 of the ~8 CPU-seconds of each rank's start here. The packages stay
    importable as a whole: the first other name asked of them runs their __init__ (`_complete_mbridge`)."""
    import importlib
    import importlib.util
    import sys

    for name in ("mbridge", "mbridge.models"):
        if name not in sys.modules:
            package = importlib.util.module_from_spec(importlib.util.find_spec(name))
            package.__getattr__ = partial(_complete_mbridge, name)
            sys.modules[name] = package
    importlib.import_module(f"mbridge.models.{_BRIDGE_MODULES[model_type]}")
    from mbridge.core.bridge import _MODEL_REGISTRY

    return _MODEL_REGISTRY[model_type]


def _complete_mbridge(package_name: str, name: str):
    """Run the __init__ of the mbridge packages `_registered_bridge` left unrun, then give `name` of `package_name`."""
    import sys

    for package in (sys.modules["mbridge.models"], sys.modules["mbridge"]):
        if package.__dict__.pop("__getattr__", None) is not None:
            package.__spec__.loader.exec_module(package)
    return getattr(sys.modules[package_name], name)


def _expose_rope_theta(hf_config) -> None:
    """transformers 5 keeps rope_theta inside `rope_parameters`; mbridge 0.15 reads `config.rope_theta`."""
    if getattr(hf_config, "rope_theta", None) is None:
        rope = getattr(hf_config, "rope_parameters", None) or {}
        hf_config.rope_theta = rope.get("rope_theta", 10000.0)


def _local_layer_spec(self, vp_stage=None):
    """Megatron's local spec with core attention that accepts packed (thd) micro-batches."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from .attention import PackedDotProductAttention

    self.has_vp_stage = True  # read by mbridge's model provider; megatron 0.16 takes vp_stage in GPTModel
    spec = get_gpt_layer_local_spec(
        num_experts=self.config.num_moe_experts, moe_grouped_gemm=False, normalization="RMSNorm",
        qk_layernorm=self.config.qk_layernorm,
    )
    spec.submodules.self_attention.submodules.core_attention = PackedDotProductAttention
    return spec


VALUE_HEAD = "score"  # the value head's HF name, as transformers' *ForTokenClassification models call their head
VALUE_HEAD_INIT_STD = 0.02


class ValueHead(torch.nn.Linear):
    """A critic's head in place of the output layer: one value per position, in fp32. Each tensor-parallel rank holds
    it whole (its input, the final norm's output, is whole on each, so their gradients agree). Initialised N(0, 0.02)
    with a bias of 0 from its own seed, the same on every rank and layout."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, seed: int) -> None:
        super().__init__(hidden_size, 1, bias=True, dtype=dtype)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.weight.copy_(torch.randn(self.weight.shape, generator=generator) * VALUE_HEAD_INIT_STD)
            self.bias.zero_()

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None):
        return super().forward(hidden).float(), None


def _value_head_names(base):
    """The bridge's HF names, with the output layer (a value head) as VALUE_HEAD's weight and bias."""

    def mcore_to_hf(self, mcore_name: str) -> list[str]:
        if mcore_name.startswith("output_layer."):
            return [f"{VALUE_HEAD}.{mcore_name.rpartition('.')[2]}"]
        return base._weight_name_mapping_mcore_to_hf(self, mcore_name)

    return mcore_to_hf


def build_model_chunks(bridge, virtual_pipeline_stages: int | None = None, value_head_seed: int | None = None
                       ) -> list[torch.nn.Module]:
    """The GPTModel chunks this rank owns (one, or one per virtual pipeline stage), random-initialised; with
    `value_head_seed` a critic's, whose last stage ends in a `ValueHead` (made from that seed)."""
    from megatron.core import parallel_state as ps

    def value_head(model, pre_process, post_process, config, hf_config):
        if post_process:
            model.output_layer = ValueHead(config.hidden_size, config.params_dtype, value_head_seed)

    provider = bridge._model_provider([] if value_head_seed is None else [value_head])
    stages = [None] if not virtual_pipeline_stages else list(range(virtual_pipeline_stages))
    chunks = []
    for vp_stage in stages:
        pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        chunk = provider(pre, post, vp_stage) if vp_stage is not None else provider(pre, post)
        device = local_device()
        if device.type == "cuda":
            # megatron's parallel layers are built on the GPU, but not every module is (the local spec's torch
            # norms): move the whole chunk, as megatron's and mbridge's get_model do
            chunk.cuda(device)
        _cast_parameters(chunk, chunk.config.params_dtype)
        chunks.append(chunk)
    return chunks


def load_value_model(bridge, chunks: list[torch.nn.Module], hf_dir: str) -> bool:
    """A critic's weights from `hf_dir`: its transformer through mbridge, and its value head where the dir has one
    (VALUE_HEAD's weight and bias, as `rlsearch convert` writes a critic); returns whether it had one (else the head
    keeps its initialisation)."""
    heads = {}
    for chunk in chunks:  # mbridge loads every parameter the chunk has: the head waits outside meanwhile
        module = getattr(chunk, "module", chunk)
        if module.post_process:
            heads[id(chunk)] = module.output_layer
            module.output_layer = torch.nn.Identity()
    try:
        bridge.load_weights(chunks, hf_dir)
    finally:
        for chunk in chunks:
            if id(chunk) in heads:
                getattr(chunk, "module", chunk).output_layer = heads[id(chunk)]
    stored = _stored_value_head(hf_dir)
    if stored:
        with torch.no_grad():
            for head in heads.values():
                head.weight.copy_(stored["weight"].reshape(head.weight.shape))
                head.bias.copy_(stored.get("bias", torch.zeros(1)).reshape(head.bias.shape))
    return bool(stored)


def _stored_value_head(hf_dir: str) -> dict[str, torch.Tensor]:
    """VALUE_HEAD's tensors in the safetensors of `hf_dir` ("weight", "bias"), {} when it has none."""
    from pathlib import Path

    from safetensors import safe_open

    found = {}
    for path in sorted(Path(hf_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as file:
            for name in file.keys():
                if name.startswith(f"{VALUE_HEAD}."):
                    found[name.rpartition(".")[2]] = file.get_tensor(name)
    if found and found["weight"].dim() == 2 and found["weight"].shape[0] != 1:
        raise ValueError(f"{hf_dir}: '{VALUE_HEAD}.weight' has shape {tuple(found['weight'].shape)}; a critic's value "
                         "head has one label")
    return found


def _cast_parameters(chunk: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every parameter in the model's dtype. The local spec's torch norms are made in float32 whatever the config
    says; Megatron's bf16 optimizer assumes one dtype (its get_model wraps the model in Float16Module, which casts it)
    and mismatches fp32 parameters with the optimizer state at checkpoint time. vLLM runs the norms in the model dtype
    too."""
    for parameter in chunk.parameters():
        if parameter.dtype != dtype:
            parameter.data = parameter.data.to(dtype)


def export_hf_named(bridge, chunks: list[torch.nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named full tensors of a rank's chunks (PP gathered, TP merged), each name once. A collective: every rank
    must iterate it.

    With tied embeddings split over pipeline stages, mbridge exports the shared matrix from both the first stage
    (embedding) and the last (output layer) under the same HF name; the copies are identical (Megatron keeps them
    in sync), so the second is dropped instead of moving it twice. Layers with LoRA adapters (rlsearch.megatron.lora)
    export their merged weights, the adapters themselves nothing."""
    from .lora import merged_adapters

    exported: set[str] = set()
    with merged_adapters(chunks):
        for name, tensor in bridge.export_weights(chunks):
            if name not in exported:
                exported.add(name)
                yield name, tensor.detach()
