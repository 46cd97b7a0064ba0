"""Rank-local export: each pipeline stage sends its own layers, gathered over its tensor-parallel group only.

mbridge's `export_weights` broadcasts every parameter of every stage to all stages and all-gathers TP on every
rank, so every rank materialises the whole model once per sync. Here only the data-parallel rank 0 replica takes
part: within each stage the TP shards of a parameter are gathered to TP rank 0 (the stage's sender), which merges
them and converts the names to HF. Other TP ranks only send their shard; DP > 0 ranks do nothing. A tied embedding
matrix, held by the first and the last stage, is sent by the first one only.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist


def export_stage_weights(mbridge, chunks: list[torch.nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named full tensors of this rank's pipeline stage, yielded on its TP rank 0 (nothing elsewhere). A collective
    over the stage's TP group: every TP rank of the stage iterates it."""
    from mbridge.core.util import unwrap_model
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    tp_size = ps.get_tensor_model_parallel_world_size()
    is_sender = ps.get_tensor_model_parallel_rank() == 0
    for chunk in unwrap_model(list(chunks)):
        local_to_global = mbridge._weight_name_mapping_mcore_local_to_global(chunk, consider_ep=False)
        tied_copy = getattr(chunk, "share_embeddings_and_output_weights", False) and not chunk.pre_process
        for name, parameter in chunk.named_parameters():
            if tied_copy and name == "output_layer.weight":
                continue  # the first stage sends the shared matrix as the embedding
            global_name = local_to_global[name]
            tensor = parameter.detach()
            if tp_size > 1 and getattr(parameter, "tensor_model_parallel", False):
                shards = [torch.empty_like(tensor) for _ in range(tp_size)] if is_sender else None
                dist.gather(tensor.contiguous(), shards, group_dst=0, group=tp_group)
                if not is_sender:
                    continue
                tensor = mbridge._weight_merge_across_tp(global_name, shards, parameter)
            elif not is_sender:
                continue
            yield from zip(*mbridge._weight_to_hf_format(global_name, tensor))
