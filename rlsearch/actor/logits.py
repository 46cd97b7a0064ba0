"""Token logprobs (and entropy) from hidden states, a chunk of positions at a time.

Scoring a trajectory through the output layer in one piece holds its logits for every position at once: a
32768-token trajectory over Qwen's 151936-token vocabulary is 32768 x 151936 x 4 B = 19.9 GB of float32 logits (over
the tensor-parallel ranks together), before the copies the softmax and its gradient make. Here each chunk of
`chunk_tokens` positions runs output layer -> float32 scaled, biased logits -> vocab-parallel cross entropy under a
non-reentrant activation checkpoint: the forward keeps only the chunk's logprobs, and the backward recomputes one
chunk's logits at a time, so peak memory is about 3 x chunk x vocab/tp x 4 B (the float32 logits and, at most, two
temporaries of the same size) however long the trajectory.

The numbers are those of scoring the full logits: log_softmax((logits + logit_bias) / temperature) at the label
(`rlsearch.actor.distribution`), vocab-parallel, never gathering the vocabulary.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from .distribution import SamplingDistribution


def token_logprobs(
    hidden: torch.Tensor,
    output_layer: torch.nn.Module,
    weight: torch.Tensor | None,
    labels: torch.Tensor,
    distribution: SamplingDistribution,
    chunk_tokens: int,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(label) at each of the n positions of `hidden` [n, h] (float32, differentiable w.r.t. `hidden` and the
    output layer's weight, or the tied `weight` when one is given), and with `with_entropy` the distribution's
    entropy there (float32, detached; else None).

    `output_layer` is Megatron's ColumnParallelLinear (vocab-parallel logits, called as
    `output_layer(x, weight=weight)`); `labels` [n] are global token ids. `chunk_tokens` positions go through the
    output layer at a time, checkpointed when grad is enabled and there is more than one chunk; 0 scores all n in one
    piece."""
    if chunk_tokens < 0:
        raise ValueError(f"chunk_tokens must be >= 0 (0: one chunk); got {chunk_tokens}")
    size = chunk_tokens or max(hidden.shape[0], 1)
    # one chunk gains nothing from recomputation: its logits would live through the backward either way
    checkpointed = hidden.shape[0] > size and torch.is_grad_enabled()
    logprobs: list[torch.Tensor] = []
    entropies: list[torch.Tensor] = []
    for hidden_chunk, label_chunk in zip(hidden.split(size), labels.split(size)):
        entropy_out: list[torch.Tensor] | None = [] if with_entropy else None
        args = (hidden_chunk, label_chunk, output_layer, weight, distribution, entropy_out)
        if checkpointed:
            logprobs.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False))
        else:
            logprobs.append(_chunk_logprobs(*args))
        if entropy_out is not None:
            entropies.extend(entropy_out)
    entropy = torch.cat(entropies) if with_entropy else None
    return torch.cat(logprobs), entropy


def _chunk_logprobs(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    output_layer: torch.nn.Module,
    weight: torch.Tensor | None,
    distribution: SamplingDistribution,
    entropy_out: list[torch.Tensor] | None,
) -> torch.Tensor:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    scaled = output_layer(hidden.unsqueeze(1), weight=weight)[0].squeeze(1).float()
    partition = scaled.shape[-1]
    vocab_start = ps.get_tensor_model_parallel_rank() * partition
    bias = distribution.bias_shard(vocab_start, vocab_start + partition, scaled.device)
    if bias is not None:
        scaled = scaled + bias
    if distribution.temperature != 1.0:  # a division by 1 would be a full pass over the logits, and one more back
        scaled = scaled / distribution.temperature
    # entropy before the cross entropy, which overwrites its input with the softmax; only on the first call: the
    # checkpoint's recompute in backward would otherwise redo it (and its all-reduces) for nothing
    if entropy_out is not None and not entropy_out:
        with torch.no_grad():
            entropy_out.append(_vocab_parallel_entropy(scaled))
    return -vocab_parallel_cross_entropy(scaled, labels)


def _vocab_parallel_entropy(scaled: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(scaled) per row, the vocabulary split over the tensor-parallel group:
    H = log S - sum(e * z) / S with z = scaled - max, e = exp(z), S = sum(e)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None
    row_max = scaled.max(dim=-1).values
    if group is not None:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    shifted = scaled - row_max.unsqueeze(-1)
    exp = shifted.exp()
    sums = torch.stack([exp.sum(dim=-1), exp.mul_(shifted).sum(dim=-1)])
    if group is not None:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    sum_exp, sum_exp_z = sums
    return sum_exp.log() - sum_exp_z / sum_exp
