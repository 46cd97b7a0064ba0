"""Rank-local export: each pipeline stage sends its own layers, gathered over its tensor-parallel group only.

mbridge's `export_weights` broadcasts every parameter of every stage to all stages and all-gathers TP on every
rank, so every rank materialises the whole model once per sync. Here only the data-parallel rank 0 replica takes
part: within each stage the TP shards of a parameter are gathered to TP rank 0 (the stage's sender), which merges
them and converts the names to HF (through shared memory where the ranks share a host, gather.py). Other TP ranks
only send their shard; DP > 0 ranks do nothing. A tied embedding
matrix, held by the first and the last stage, is sent by the first one only.

With expert parallelism (MoE), the routed experts of a layer are split over the sender's expert-parallel group
(data-parallel ranks): each rank sends its own experts, gathered to the sender (EP rank 0) over that group, so every
expert moves once and no rank materialises the others' experts but the sender, one tensor at a time.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from ..megatron.lora import adapted_layers, is_adapter, merged_weight, named_adapters, peft_factors
from .gather import ShardGather, ShardGathers

# a routed expert's weight under mbridge's global names (`...mlp.experts.linear_fc1.weight<expert>`)
_EXPERT_NAME = re.compile(r"\.mlp\.experts\.(linear_fc[12])\.weight(\d+)$")


def export_stage_weights(mbridge, chunks: list[torch.nn.Module], gathers: ShardGathers
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named full tensors of this rank's pipeline stage, yielded on its TP rank 0 (nothing elsewhere). A collective
    over the stage's TP group: every TP rank of the stage iterates it. `gathers`: the rank's own, kept across syncs."""
    from mbridge.core.util import unwrap_model
    from megatron.core import parallel_state as ps

    tp_size = ps.get_tensor_model_parallel_world_size()
    ep_size = ps.get_expert_model_parallel_world_size()
    # an expert-parallel peer (DP rank > 0) takes part in the gathers of experts only
    in_sender_replica = ps.get_data_parallel_rank() == 0
    is_sender = ps.get_tensor_model_parallel_rank() == 0 and in_sender_replica
    chunks = unwrap_model(list(chunks))
    # LoRA: an adapted layer sends its merged weight shard (no other rank's factors needed), its adapter nothing
    adapted = {id(linear.weight): linear for linear in adapted_layers(chunks)}
    parameters = [p for chunk in chunks for p in chunk.parameters() if not is_adapter(p)]
    # megatron marks an expert parameter allreduce=False; with expert parallelism experts gather over their own group
    experts = {id(p): p for p in parameters if ep_size > 1 and not getattr(p, "allreduce", True)}
    sharded = [p for p in parameters if getattr(p, "tensor_model_parallel", False) and id(p) not in experts]
    tp_gather = ep_gather = None
    if tp_size > 1 and in_sender_replica and sharded:
        tp_gather = gathers.of("tp", ps.get_tensor_model_parallel_group(), max(p.nbytes for p in sharded))
    if ep_size > 1 and experts:
        ep_gather = gathers.of("ep", ps.get_expert_model_parallel_group(), max(p.nbytes for p in experts.values()))
    for chunk in chunks:
        local_to_global = mbridge._weight_name_mapping_mcore_local_to_global(chunk, consider_ep=False)
        tied_copy = getattr(chunk, "share_embeddings_and_output_weights", False) and not chunk.pre_process
        for name, parameter in chunk.named_parameters():
            if tied_copy and name == "output_layer.weight":
                continue  # the first stage sends the shared matrix as the embedding
            if is_adapter(parameter):
                continue
            global_name = local_to_global[name]
            tensor = merged_weight(adapted[id(parameter)]) if id(parameter) in adapted else parameter.detach()
            if id(parameter) in experts:
                yield from _gathered_experts(mbridge, global_name, tensor, ep_gather, is_sender)
                continue
            if not in_sender_replica:
                continue
            if tp_size > 1 and getattr(parameter, "tensor_model_parallel", False):
                shards = tp_gather.gather(tensor)
                if not is_sender:
                    continue
                # a merge copies: the merged tensor holds neither the gathered shards nor the other ranks' files
                tensor = _merge_tp_shards(mbridge, global_name, shards, parameter)
                del shards
            elif not is_sender:
                continue
            yield from zip(*mbridge._weight_to_hf_format(global_name, tensor))


def export_stage_adapters(mbridge, chunks: list[torch.nn.Module], gathers: ShardGathers) -> dict[str, torch.Tensor]:
    """actor.lora.sync=adapter: the adapters of this rank's pipeline stage, whole, under PEFT's names for the HF model
    (`peft_factors`), on the stage's TP rank 0 ({} on its TP peers, which send their shards). A collective over the
    stage's TP group, called on the ranks of data-parallel replica 0: B of a column-parallel layer is split over TP
    on its rows like the layer's weight, A of a row-parallel one on its columns; each merges as the weight does."""
    from mbridge.core.util import unwrap_model
    from megatron.core import parallel_state as ps

    is_sender = ps.get_tensor_model_parallel_rank() == 0
    adapters = list(named_adapters(mbridge, unwrap_model(list(chunks))))
    gather = None
    if ps.get_tensor_model_parallel_world_size() > 1 and adapters:
        largest = max(max(adapter.a.nbytes, adapter.b.nbytes) for _, adapter in adapters)
        gather = gathers.of("tp-adapters", ps.get_tensor_model_parallel_group(), largest)
    named: dict[str, torch.Tensor] = {}
    for weight_name, adapter in adapters:
        a, b = adapter.a.detach(), adapter.b.detach()
        if gather is not None:
            shards = gather.gather(b if adapter.column else a)
            if not is_sender:
                continue
            merged = _merge_tp_shards(mbridge, weight_name, shards, adapter.b if adapter.column else adapter.a)
            a, b = (a, merged) if adapter.column else (merged, b)
        named.update((peft_name, tensor.clone()) for peft_name, tensor in peft_factors(mbridge, weight_name, a, b))
    return named if is_sender else {}


def _merge_tp_shards(mbridge, global_name: str, shards: list[torch.Tensor], parameter) -> torch.Tensor:
    """mbridge's merge of a parameter's TP shards, in one copy where mbridge makes two: the first layer of a gated
    MLP, whose shards each hold a gate half and an up half (mbridge joins the gate halves, the up halves, then the
    two: every byte twice)."""
    if ("linear_fc1.weight" in global_name or "linear_fc1.bias" in global_name) \
            and mbridge._get_mcore_config_by_name(global_name).gated_linear_unit:
        halves = [shard.chunk(2) for shard in shards]
        return torch.cat([gate for gate, _ in halves] + [up for _, up in halves], dim=0)
    return mbridge._weight_merge_across_tp(global_name, shards, parameter)


def _gathered_experts(
    mbridge, global_name: str, tensor: torch.Tensor, ep_gather: ShardGather, is_sender: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """One local expert weight of every rank of the expert-parallel group, gathered to its rank 0 (the sender) and
    yielded there under each one's global HF names."""
    shards = ep_gather.gather(tensor, keep=is_sender)  # each shard is yielded as it is, and waits in a bucket
    if not is_sender:
        return
    experts_per_rank = mbridge.config.num_moe_experts // ep_gather.size
    for ep_rank, shard in enumerate(shards):
        yield from zip(*mbridge._weight_to_hf_format(shift_expert_name(global_name, ep_rank * experts_per_rank), shard))


def shift_expert_name(name: str, first_expert: int) -> str:
    """The global name of expert weight `name` (a rank's local expert i, named as on expert-parallel rank 0) on the
    rank whose first expert is `first_expert`."""
    match = _EXPERT_NAME.search(name)
    if not match:
        raise ValueError(f"not an expert weight name: {name}")
    return f"{name[:match.start()]}.mlp.experts.{match.group(1)}.weight{int(match.group(2)) + first_expert}"
