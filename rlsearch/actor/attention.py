"""Core attention for the local (non Transformer Engine) layer spec: packed sequences, prefix trees and context
parallelism, all from the micro-batch's `RowLayout` (rlsearch.actor.layout).

Megatron's local `DotProductAttention` takes neither packed (thd) micro-batches nor context parallelism. This
subclass attends block by block with torch's scaled-dot-product attention: causally within a block, fully to
its prefix. It also applies the rotary embeddings itself, from each row's position, because Megatron's thd path
restarts positions at every sequence boundary and a branch of a prefix tree must continue its ancestors'
positions: `take_over_rotary` makes the model hand it the un-rotated query and key. With context parallelism each
rank rotates its own rows, then gathers every rank's keys and values (one collective per layer) and attends
with its own queries.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
from megatron.core.transformer.dot_product_attention import DotProductAttention

from .layout import AttentionBlock, RowLayout

# query rows per masked attention call: bounds the boolean mask of a block with a long prefix
MASKED_QUERY_ROWS = 2048


def take_over_rotary(chunk: torch.nn.Module) -> None:
    """The model stops rotating queries and keys (its rotary module returns nothing); `PackedDotProductAttention`
    rotates them from the layout's positions instead."""
    chunk.rotary_pos_emb.forward = lambda *args, **kwargs: None


def rotary_table(chunk: torch.nn.Module, positions: torch.Tensor) -> torch.Tensor:
    """[rows, 1, 1, dim] rotary angles of `positions` from the model's own rotary module (its scaling included)."""
    return chunk.rotary_pos_emb.get_emb(int(positions.max()) + 1)[positions]


class _GatherRows(torch.autograd.Function):
    """All-gather along rows over the context-parallel group (equal row counts). Backward: the summed gradient of
    this rank's rows (an all-reduce and a slice, since gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(rows) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, rows.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        count = grad.shape[0] // dist.get_world_size(ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad[rank * count:(rank + 1) * count], None


class PackedDotProductAttention(DotProductAttention):
    def __init__(self, config, *args, **kwargs) -> None:
        # the parent refuses context parallelism (only its assertion reads the size): this module does it itself
        local = copy.copy(config)
        local.context_parallel_size = 1
        super().__init__(local, *args, **kwargs)
        self.rotary_interleaved = config.rotary_interleaved

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        layout: RowLayout | None = getattr(packed_seq_params, "layout", None)
        if layout is None or packed_seq_params.qkv_format != "thd":
            raise ValueError("the local layer spec's attention takes the actor's packed micro-batches (thd with a "
                             "RowLayout, rlsearch.actor.batch) only")
        # query [rows, heads, dim]; key and value [rows, groups, dim] (grouped-query attention)
        query, key = (self._rotate(x, layout.rotary) for x in (query, key))
        if layout.gather_order is not None:
            from megatron.core import parallel_state as ps

            gathered = _GatherRows.apply(torch.cat([key, value], dim=-1), ps.get_context_parallel_group())
            key, value = gathered[layout.gather_order].split(key.shape[-1], dim=-1)
        # with query-key layer scaling the parent splits the scale between the scores and the softmax
        scale = self.softmax_scale * (self.scale_mask_softmax.scale or 1.0)
        dropout = self.attention_dropout.p if self.training else 0.0
        context = blocked_attention(query, key, value, layout.blocks, scale, dropout)
        return context.reshape(context.shape[0], self.hidden_size_per_partition)

    def _rotate(self, rows: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return _apply_rotary_pos_emb_bshd(rows.unsqueeze(1), table, rotary_interleaved=self.rotary_interleaved)[:, 0]


def blocked_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, blocks: list[AttentionBlock], scale: float,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Attention of query rows [rows, heads, dim] over keys and values [whole row, groups, dim], block by block
    (the blocks cover the query rows in order)."""
    outputs = []
    for block in blocks:
        q = query[block.query_start:block.query_end]
        own = slice(block.own_start, block.own_start + block.length)
        if not block.prefix:
            outputs.append(_attend(q, key[own], value[own], scale, dropout, causal=True))
            continue
        visible_key = torch.cat([key[start:end] for start, end in block.prefix])
        visible_value = torch.cat([value[start:end] for start, end in block.prefix])
        prefix = visible_key.shape[0]
        for first in range(0, block.length, MASKED_QUERY_ROWS):
            last = min(first + MASKED_QUERY_ROWS, block.length)
            keys = torch.cat([visible_key, key[own][:last]])
            values = torch.cat([visible_value, value[own][:last]])
            mask = torch.ones(last - first, prefix + last, dtype=torch.bool, device=q.device)
            mask[:, prefix:] = torch.ones(last - first, last, dtype=torch.bool, device=q.device).tril(first)
            outputs.append(_attend(q[first:last], keys, values, scale, dropout, mask=mask))
    return torch.cat(outputs)


def _attend(q, k, v, scale: float, dropout: float, causal: bool = False, mask: torch.Tensor | None = None):
    """torch SDPA on [rows, heads, dim] tensors. Its fused kernels take 4-D inputs only (3-D ones fall back to the
    math kernel), and with a mask grouped-query attention is fastest with the key groups repeated per head."""
    heads, groups = q.shape[1], k.shape[1]
    if mask is not None and groups != heads:
        k, v = (x.repeat_interleave(heads // groups, dim=1) for x in (k, v))
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=scale, enable_gqa=mask is None,
    )
    return out[0].transpose(0, 1)
