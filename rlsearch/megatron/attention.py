"""Core attention for the local (non Transformer Engine) layer spec: packed sequences, prefix trees and context
parallelism, all from the micro-batch's `RowLayout` (rlsearch.megatron.layout).

Megatron's local `DotProductAttention` takes neither packed (thd) micro-batches nor context parallelism. This
subclass attends block by block with torch's scaled-dot-product attention: causally within a block, fully to
its prefix. It also applies the rotary embeddings itself, from each row's position, because Megatron's thd path
restarts positions at every sequence boundary and a branch of a prefix tree must continue its ancestors'
positions: `take_over_rotary` makes the model hand it the un-rotated query and key. With context parallelism each
rank rotates its own rows, then gathers every rank's keys and values (one collective per layer) and attends
with its own queries.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import tensor_parallel
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
        if packed_seq_params is None:  # an unpacked batch (the converter's check): Megatron's own attention
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        layout: RowLayout | None = getattr(packed_seq_params, "layout", None)
        if layout is None or packed_seq_params.qkv_format != "thd":
            raise ValueError("packed micro-batches for the local layer spec's attention are the actor's (thd with a "
                             "RowLayout, rlsearch.actor.batch)")
        # query [rows, heads, dim]; key and value [rows, groups, dim] (grouped-query attention)
        query, key = (self._rotate(x, layout.rotary) for x in (query, key))
        if layout.gather_order is not None:
            from megatron.core import parallel_state as ps

            gathered = _GatherRows.apply(torch.cat([key, value], dim=-1), ps.get_context_parallel_group())
            key, value = gathered[layout.gather_order].split(key.shape[-1], dim=-1)
        # with query-key layer scaling the parent splits the scale between the scores and the softmax
        scale = self.softmax_scale * (self.scale_mask_softmax.scale or 1.0)
        dropout = self.attention_dropout.p if self.training else 0.0
        # as Megatron's attention draws its dropout without sequence parallelism: from the tensor-parallel rank's own
        # stream (its heads), which recomputation saves and restores with the others
        with tensor_parallel.get_cuda_rng_tracker().fork() if dropout else contextlib.nullcontext():
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
        if q.device.type == "cpu" and dropout == 0.0:
            outputs.append(_prefix_then_causal(q, visible_key, visible_value, key[own], value[own], scale))
        else:
            outputs.append(_masked_prefix_then_causal(q, visible_key, visible_value, key[own], value[own], scale,
                                                      dropout))
    return torch.cat(outputs)


def _heads_first(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[rows, groups, dim] -> [1, heads, rows, dim], key groups repeated per head (grouped-query attention)."""
    if x.shape[1] != heads:
        x = x.repeat_interleave(heads // x.shape[1], dim=1)
    return x.transpose(0, 1).unsqueeze(0)


def _prefix_then_causal(q, prefix_key, prefix_value, own_key, own_value, scale: float) -> torch.Tensor:
    """Queries attending to a fully visible prefix and causally to their own keys, as two mask-free flash-attention
    calls merged by their log-sum-exp (memory O(rows), where a mask would be O(rows x keys))."""
    heads = q.shape[1]
    parts = [_heads_first(x, heads) for x in (q, prefix_key, prefix_value, own_key, own_value)]
    return _PrefixThenCausal.apply(*parts, scale)[0].transpose(0, 1)


class _PrefixThenCausal(torch.autograd.Function):
    """CPU flash attention over [prefix ; own keys] without a mask: the prefix block unmasked, the own block causal,
    outputs merged by log-sum-exp. The backward runs each block's flash backward with the merged output and
    log-sum-exp, which gives the gradients of attention over the union (the identity ring attention relies on)."""

    @staticmethod
    def forward(ctx, q, prefix_key, prefix_value, own_key, own_value, scale):
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        prefix_out, prefix_lse = flash(q, prefix_key, prefix_value, 0.0, False, scale=scale)
        own_out, own_lse = flash(q, own_key, own_value, 0.0, True, scale=scale)
        lse = torch.logaddexp(prefix_lse, own_lse)
        merge = torch.promote_types(q.dtype, torch.float32)  # bf16 outputs merged in fp32
        out = (prefix_out.to(merge) * (prefix_lse - lse).exp().unsqueeze(-1)
               + own_out.to(merge) * (own_lse - lse).exp().unsqueeze(-1)).to(q.dtype)
        ctx.save_for_backward(q, prefix_key, prefix_value, own_key, own_value, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, prefix_key, prefix_value, own_key, own_value, out, lse = ctx.saved_tensors
        flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        grad = grad.contiguous()
        dq_prefix, dk_prefix, dv_prefix = flash_backward(
            grad, q, prefix_key, prefix_value, out, lse, 0.0, False, scale=ctx.scale)
        dq_own, dk_own, dv_own = flash_backward(grad, q, own_key, own_value, out, lse, 0.0, True, scale=ctx.scale)
        return dq_prefix + dq_own, dk_prefix, dv_prefix, dk_own, dv_own, None


def _masked_prefix_then_causal(q, prefix_key, prefix_value, own_key, own_value, scale: float, dropout: float):
    """The same with a boolean mask (any device, dropout): O(rows x keys) memory, so in blocks of query rows."""
    prefix = prefix_key.shape[0]
    outputs = []
    for first in range(0, q.shape[0], MASKED_QUERY_ROWS):
        last = min(first + MASKED_QUERY_ROWS, q.shape[0])
        keys = torch.cat([prefix_key, own_key[:last]])
        values = torch.cat([prefix_value, own_value[:last]])
        mask = torch.ones(last - first, prefix + last, dtype=torch.bool, device=q.device)
        mask[:, prefix:] = torch.ones(last - first, last, dtype=torch.bool, device=q.device).tril(first)
        outputs.append(_attend(q[first:last], keys, values, scale, dropout, mask=mask))
    return torch.cat(outputs)


def _attend(q, k, v, scale: float, dropout: float, causal: bool = False, mask: torch.Tensor | None = None):
    """torch SDPA on [rows, heads, dim] tensors. Its fused kernels take 4-D inputs only (3-D ones fall back to the
    math kernel), and with a mask grouped-query attention is fastest with the key groups repeated per head. On CUDA
    in float32 the key groups are repeated too: there only the memory-efficient kernel takes float32, and it has no
    grouped-query mode, so `enable_gqa` would pick the math kernel, whose rows x keys scores (kept for the backward)
    ran an H100 out of memory at 16k tokens."""
    heads = q.shape[1]
    repeat_groups = mask is not None or (q.is_cuda and q.dtype == torch.float32)
    if repeat_groups:
        q, k, v = (_heads_first(x, heads) for x in (q, k, v))
    else:
        q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=scale, enable_gqa=not repeat_groups,
    )
    return out[0].transpose(0, 1)
