"""Rank-local export: each pipeline stage sends its own layers, gathered over its tensor-parallel group only.

mbridge's `export_weights` broadcasts every parameter of every stage to all stages and all-gathers TP on every
rank, so every rank materialises the whole model once per sync. Here only the data-parallel rank 0 replica takes
part: within each stage the TP shards of a parameter are gathered to TP rank 0 (the stage's sender), which merges
them and converts the names to HF. Other TP ranks only send their shard; DP > 0 ranks do nothing. A tied embedding
matrix, held by the first and the last stage, is sent by the first one only.

With expert parallelism (MoE), the routed experts of a layer are split over the sender's expert-parallel group
(data-parallel ranks): each rank sends its own experts, gathered to the sender (EP rank 0) over that group, so every
expert moves once and no rank materialises the others' experts but the sender, one tensor at a time.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
import torch.distributed as dist

# a routed expert's weight under mbridge's global names (`...mlp.experts.linear_fc1.weight<expert>`)
_EXPERT_NAME = re.compile(r"\.mlp\.experts\.(linear_fc[12])\.weight(\d+)$")


def export_stage_weights(mbridge, chunks: list[torch.nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named full tensors of this rank's pipeline stage, yielded on its TP rank 0 (nothing elsewhere). A collective
    over the stage's TP group: every TP rank of the stage iterates it."""
    from mbridge.core.util import unwrap_model
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    tp_size = ps.get_tensor_model_parallel_world_size()
    ep_size = ps.get_expert_model_parallel_world_size()
    # an expert-parallel peer (DP rank > 0) takes part in the gathers of experts only
    in_sender_replica = ps.get_data_parallel_rank() == 0
    is_sender = ps.get_tensor_model_parallel_rank() == 0 and in_sender_replica
    for chunk in unwrap_model(list(chunks)):
        local_to_global = mbridge._weight_name_mapping_mcore_local_to_global(chunk, consider_ep=False)
        tied_copy = getattr(chunk, "share_embeddings_and_output_weights", False) and not chunk.pre_process
        for name, parameter in chunk.named_parameters():
            if tied_copy and name == "output_layer.weight":
                continue  # the first stage sends the shared matrix as the embedding
            global_name = local_to_global[name]
            tensor = parameter.detach()
            if ep_size > 1 and not getattr(parameter, "allreduce", True):  # megatron's mark of an expert parameter
                yield from _gathered_experts(mbridge, global_name, tensor, is_sender)
                continue
            if not in_sender_replica:
                continue
            if tp_size > 1 and getattr(parameter, "tensor_model_parallel", False):
                shards = [torch.empty_like(tensor) for _ in range(tp_size)] if is_sender else None
                dist.gather(tensor.contiguous(), shards, group_dst=0, group=tp_group)
                if not is_sender:
                    continue
                tensor = mbridge._weight_merge_across_tp(global_name, shards, parameter)
                del shards  # not held while the merged tensor waits in a bucket
            elif not is_sender:
                continue
            yield from zip(*mbridge._weight_to_hf_format(global_name, tensor))


def _gathered_experts(
    mbridge, global_name: str, tensor: torch.Tensor, is_sender: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """One local expert weight of every rank of the expert-parallel group, gathered to its rank 0 (the sender) and
    yielded there under each one's global HF names."""
    from megatron.core import parallel_state as ps

    ep_size = ps.get_expert_model_parallel_world_size()
    shards = [torch.empty_like(tensor) for _ in range(ep_size)] if is_sender else None
    dist.gather(tensor.contiguous(), shards, group_dst=0, group=ps.get_expert_model_parallel_group())
    if not is_sender:
        return
    experts_per_rank = mbridge.config.num_moe_experts // ep_size
    for ep_rank, shard in enumerate(shards):
        yield from zip(*mbridge._weight_to_hf_format(shift_expert_name(global_name, ep_rank * experts_per_rank), shard))


def shift_expert_name(name: str, first_expert: int) -> str:
    """The global name of expert weight `name` (a rank's local expert i, named as on expert-parallel rank 0) on the
    rank whose first expert is `first_expert`."""
    match = _EXPERT_NAME.search(name)
    if not match:
        raise ValueError(f"not an expert weight name: {name}")
    return f"{name[:match.start()]}.mlp.experts.{match.group(1)}.weight{int(match.group(2)) + first_expert}"
