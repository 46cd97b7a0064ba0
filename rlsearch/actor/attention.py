"""Core attention for packed sequences on the local (non Transformer Engine) layer spec.

Packed micro-batches use Megatron's `thd` format: one row holding several sequences back to back, described by
`PackedSeqParams.cu_seqlens`. Transformer Engine's attention understands that format natively; Megatron's local
`DotProductAttention` refuses it. This subclass attends causally within each sequence (never across them) with
torch's scaled-dot-product attention, so the CPU path trains on exactly the packed layout the GPU path uses.
Rotary embeddings restart per sequence in Megatron's attention module before this is called.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention


class PackedDotProductAttention(DotProductAttention):
    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed attention supports the 'thd' format, not '{packed_seq_params.qkv_format}'")
        # query [t, heads, dim]; key and value [t, groups, dim] (grouped-query attention)
        boundaries = packed_seq_params.cu_seqlens_q.tolist()
        dropout = self.attention_dropout.p if self.training else 0.0
        # with query-key layer scaling the parent splits the scale between the scores and the softmax
        scale = self.softmax_scale * (self.scale_mask_softmax.scale or 1.0)
        outputs = []
        for start, end in zip(boundaries[:-1], boundaries[1:]):
            # [1, heads, s, dim]: torch's fused SDPA kernels (flash, memory-efficient) take 4-D inputs only; 3-D
            # ones always fall back to the math kernel (bmm + softmax, upcast to fp32)
            q, k, v = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
            outputs.append(
                F.scaled_dot_product_attention(
                    q, k, v, dropout_p=dropout, is_causal=True, scale=scale, enable_gqa=True
                )[0].transpose(0, 1)
            )
        context = torch.cat(outputs, dim=0)
        return context.reshape(context.shape[0], self.hidden_size_per_partition)
