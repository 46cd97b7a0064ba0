"""Low-rank adapters (LoRA, actor.lora) on the tensor-parallel linear layers of Megatron's local layer spec.

An adapted layer computes W x + s B A x (s = alpha / rank) with W frozen. The factors are laid out as Megatron-Bridge
lays them, so that neither W's shard nor the adapters ever need another rank's shard to merge:
- column-parallel W (linear_qkv, linear_fc1; each rank holds rows of W, its input is whole on every rank): A [r, in]
  whole on every rank, B [out/tp, r] split on the output like W's rows. The r-wide product A x is the same on every
  rank; its gradient is summed over the TP group (every rank's B shard feeds from it).
- row-parallel W (linear_proj, linear_fc2; each rank holds columns of W and its slice of the input): A [r, in/tp]
  split on the input like W's columns, its partial products summed over the TP group (r numbers a position), B [out, r]
  whole on every rank.
B starts at zero (step 0 is the base model exactly) and A from a generator seeded by the run's seed, the layer and the
target, cut to the rank's slice: every layout starts from the same adapters. The merged weight of a rank's shard is
its own W shard + s B A of its own factors (`merged_weight`).

The adapter is a child module `lora` of the linear layer it adapts (parameters `lora.a`, `lora.b`), added to the
layer's output by a forward hook, so the base weights keep their names (mbridge's mapping, checkpoints)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from ..config.schema import LoRAConfig

# actor.lora.targets -> (the transformer layer's submodule, its linear layer)
TARGET_MODULES = {"qkv": ("self_attention", "linear_qkv"), "proj": ("self_attention", "linear_proj"),
                  "fc1": ("mlp", "linear_fc1"), "fc2": ("mlp", "linear_fc2")}
_ADAPTER = "lora"  # the adapter's name under its linear layer
_MARK = "is_lora_adapter"  # set on the adapters' parameters


def is_adapter(parameter: torch.nn.Parameter) -> bool:
    """Whether `parameter` is an adapter's factor (trained, never exported as a weight of its own)."""
    return getattr(parameter, _MARK, False)


class LoRAAdapter(torch.nn.Module):
    """s B A x for the tensor-parallel linear layer `base` (column- or row-parallel, see the module's docstring)."""

    def __init__(self, base: torch.nn.Module, rank: int, alpha: float, dropout: float, generator: torch.Generator
                 ) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, set_tensor_model_parallel_attributes

        super().__init__()
        self.column = isinstance(base, ColumnParallelLinear)
        self.scale = alpha / rank
        self.dropout = dropout
        self.enabled = True
        weight = base.weight
        in_features = base.input_size
        # A as PEFT initialises it (Kaiming-uniform, a = sqrt(5)): U(-1/sqrt(in), 1/sqrt(in)), drawn whole
        bound = 1.0 / math.sqrt(in_features)
        a = (torch.rand((rank, in_features), generator=generator, dtype=torch.float32) * 2 - 1) * bound
        if not self.column:
            width = base.input_size_per_partition
            start = ps.get_tensor_model_parallel_rank() * width
            a = a[:, start:start + width]
        self.a = torch.nn.Parameter(a.to(device=weight.device, dtype=weight.dtype).contiguous())
        self.b = torch.nn.Parameter(torch.zeros((weight.shape[0], rank), device=weight.device, dtype=weight.dtype))
        sharded, whole = (self.b, self.a) if self.column else (self.a, self.b)
        set_tensor_model_parallel_attributes(sharded, True, 0 if self.column else 1, 1)
        set_tensor_model_parallel_attributes(whole, False, -1, 1)
        for parameter in (self.a, self.b):
            setattr(parameter, _MARK, True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            get_cuda_rng_tracker,
            reduce_from_tensor_model_parallel_region,
        )

        if self.column:
            # the input is whole on every TP rank: the same mask on each (the default generator, seeded alike)
            h = copy_to_tensor_model_parallel_region(F.linear(self._dropped(x), self.a))
        else:
            with get_cuda_rng_tracker().fork():  # each rank's own slice of the input: a mask of its own
                dropped = self._dropped(x)
            h = reduce_from_tensor_model_parallel_region(F.linear(dropped, self.a))
        return F.linear(h, self.b) * self.scale

    def _dropped(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.dropout, self.training) if self.dropout else x


def _add_adapter_output(linear: torch.nn.Module, args: tuple, kwargs: dict, output: tuple) -> tuple:
    adapter = linear._modules.get(_ADAPTER)  # none while `merged_adapters` holds it
    if adapter is None or not adapter.enabled:
        return output
    x = args[0] if args else kwargs["input_"]
    result, bias = output
    return result + adapter(x), bias


def install_adapters(chunk: torch.nn.Module, lora: LoRAConfig, seed: int) -> None:
    """Adapters of actor.lora on every target layer of `chunk` (a bare GPTModel, its weights loaded), its other
    parameters frozen. Call before the chunk is wrapped for training: Megatron's DDP
    and optimizer leave frozen parameters out (no gradient buffers, no Adam state)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    chunk.requires_grad_(False)
    for layer in chunk.decoder.layers:
        for index, (target, (parent, name)) in enumerate(TARGET_MODULES.items()):
            if target not in lora.targets:
                continue
            linear = getattr(getattr(layer, parent), name, None)
            kind = type(linear)
            if kind not in (ColumnParallelLinear, RowParallelLinear) or getattr(linear, "is_expert", False):
                raise ValueError(
                    f"actor.lora.targets has {target}: layer {layer.layer_number}'s {parent}.{name} is a "
                    f"{kind.__name__}, and the adapters wrap the local layer spec's dense ColumnParallelLinear and "
                    "RowParallelLinear only (actor.transformer_impl=local, no experts)")
            if (linear.gather_output if kind is ColumnParallelLinear else not linear.input_is_parallel) \
                    or linear.sequence_parallel:
                raise ValueError(f"actor.lora: {name} of layer {layer.layer_number} gathers its output or splits its "
                                 "input itself (or runs sequence parallel), which the adapters' layout does not cover")
            # the layer's global number (its pipeline stage's offset included) and the target seed A alike in any
            # layout
            generator = torch.Generator().manual_seed(seed * 1_000_003 + layer.layer_number * len(TARGET_MODULES)
                                                      + index)
            linear.add_module(_ADAPTER, LoRAAdapter(linear, lora.rank, lora.alpha, lora.dropout, generator))
            linear.register_forward_hook(_add_adapter_output, with_kwargs=True)
            linear.sharded_state_dict = _sharded_state_dict_with_adapter(linear, gated=(
                name == "linear_fc1" and linear.config.gated_linear_unit))


def _sharded_state_dict_with_adapter(linear: torch.nn.Module, gated: bool):
    """The linear layer's sharded state dict (Megatron's own for its weight and bias) with the adapter's factors split
    as they are over the TP group: a checkpoint saved in one layout loads into another. A gated fc1's B holds, like its
    weight, a gate and an up half per rank (Megatron's swiglu factory keeps the halves apart)."""
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    own = type(linear).sharded_state_dict

    def sharded_state_dict(prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        state = own(linear, prefix, sharded_offsets, metadata)
        adapter = linear._modules[_ADAPTER]
        factors = make_sharded_tensors_for_checkpoint(
            {"a": adapter.a, "b": adapter.b}, f"{prefix}{_ADAPTER}.", {"b": 0} if adapter.column else {"a": 1},
            sharded_offsets, tp_group=linear.tp_group, dp_cp_group=metadata["dp_cp_group"])
        if gated:
            key = f"{prefix}{_ADAPTER}.b"
            factors[key] = apply_swiglu_sharded_factory(factors[key], sharded_offsets,
                                                        (metadata or {}).get("singleton_local_shards", False))
        state.update(factors)
        return state

    return sharded_state_dict


def adapted_layers(chunks: list[torch.nn.Module]) -> Iterator[torch.nn.Module]:
    """The linear layers of `chunks` (bare or DDP-wrapped) that carry an adapter."""
    for chunk in chunks:
        for module in chunk.modules():
            if _ADAPTER in module._modules and isinstance(module._modules[_ADAPTER], LoRAAdapter):
                yield module


def merged_weight(linear: torch.nn.Module) -> torch.Tensor:
    """The adapted layer's weight shard with its adapter folded in: W + s B A, computed in fp32, in W's dtype."""
    adapter = linear._modules[_ADAPTER]
    with torch.no_grad():
        return (linear.weight.float() + adapter.scale * (adapter.b.float() @ adapter.a.float())).to(linear.weight.dtype)


@contextlib.contextmanager
def merged_adapters(chunks: list[torch.nn.Module]):
    """Within the block every adapted layer of `chunks` holds its merged weight (`merged_weight`) and no adapter, so
    exports that walk the parameters (mbridge's) see the model as the engines run it. Each weight comes back as it was,
    bit for bit (the merge is a new tensor, not an update in place). Holds one merged copy of each adapted weight."""
    layers = list(adapted_layers(chunks))
    kept = []
    try:
        for linear in layers:
            merged = merged_weight(linear)
            kept.append((linear, linear.weight.data, linear._modules.pop(_ADAPTER)))
            linear.weight.data = merged
        yield
    finally:
        for linear, weight, adapter in kept:
            linear.weight.data = weight
            linear.add_module(_ADAPTER, adapter)


@contextlib.contextmanager
def adapters_off(chunks: list[torch.nn.Module]):
    """Within the block `chunks` compute their base model: every adapter adds nothing (the reference policy of a LoRA
    actor, without a second copy of the model)."""
    adapters = [linear._modules[_ADAPTER] for linear in adapted_layers(chunks)]
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in adapters:
            adapter.enabled = True


PEFT_PREFIX = "base_model.model."  # PEFT's prefix of the HF model's names in a saved adapter


def peft_factors(bridge, weight_name: str, a: torch.Tensor, b: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The whole factors `a` [r, in] and `b` [out, r] of the adapter on Megatron weight `weight_name` (global, as
    mbridge names it) under PEFT's names for the HF model: `base_model.model.<HF module>.lora_A.weight` and
    `.lora_B.weight`. A fused layer's adapter becomes one per HF module it fuses, its rows of B split as mbridge splits
    the weight's: linear_qkv's are, per query group, its query heads, then its key head, then its value head;
    linear_fc1's the gate's, then the up projection's. A acts on the input, which the fused modules share: each gets
    the same A and its own rows of B, so s B_i A is the module's rows of s B A."""
    hf_names = bridge._weight_name_mapping_mcore_to_hf(weight_name)
    if len(hf_names) == 3:  # linear_qkv: q, k, v
        config = bridge.hf_config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        query_rows = head_dim * config.num_attention_heads // config.num_key_value_heads
        groups = b.reshape(config.num_key_value_heads, -1, b.shape[1])
        b_parts = [part.reshape(-1, b.shape[1]) for part in (
            groups[:, :query_rows], groups[:, query_rows:query_rows + head_dim], groups[:, query_rows + head_dim:])]
    else:  # linear_fc1 of a gated MLP: gate, up; the other layers one module
        b_parts = list(b.chunk(len(hf_names)))
    named = []
    for hf_name, b_part in zip(hf_names, b_parts, strict=True):
        module = PEFT_PREFIX + hf_name.removesuffix(".weight")
        named += [(f"{module}.lora_A.weight", a), (f"{module}.lora_B.weight", b_part.contiguous())]
    return named


def named_adapters(bridge, chunks: list[torch.nn.Module]) -> Iterator[tuple[str, LoRAAdapter]]:
    """Each adapter of `chunks` (bare GPTModels) with the global name, as mbridge names it, of the weight it adapts."""
    for chunk in chunks:
        local_to_global = bridge._weight_name_mapping_mcore_local_to_global(chunk, consider_ep=False)
        for name, linear in chunk.named_modules():
            adapter = linear._modules.get(_ADAPTER)
            if isinstance(adapter, LoRAAdapter):
                yield local_to_global[f"{name}.weight"], adapter


def peft_config(rank: int, alpha: float, peft_names, dropout: float = 0.0) -> dict:
    """adapter_config.json's fields for the adapter whose factors are named `peft_names` (`peft_factors`' names):
    PEFT's LoRA of rank `rank` and scale alpha / rank on the HF modules they name, as PEFT and vLLM read it."""
    modules = sorted({name.split(".lora_")[0].rpartition(".")[2] for name in peft_names})
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank,
        # PEFT types lora_alpha an int; the scale is lora_alpha / r either way
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "lora_dropout": dropout, "target_modules": modules, "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "modules_to_save": None, "inference_mode": True,
    }


def peft_named_factors(bridge, chunk: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapters of a model held whole by one rank (TP1 PP1, as the conversion loads it) under PEFT's names for
    the HF model (`peft_factors`)."""
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() * ps.get_pipeline_model_parallel_world_size() > 1:
        raise ValueError("peft_named_factors needs every layer's whole adapters on this rank (TP1 PP1)")
    for weight_name, adapter in named_adapters(bridge, [chunk]):
        yield from peft_factors(bridge, weight_name, adapter.a.detach(), adapter.b.detach())
