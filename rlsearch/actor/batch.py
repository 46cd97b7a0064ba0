"""What the actor trains on (plain data) and how it becomes packed micro-batch tensors.

A micro-batch is one row of sequences concatenated back to back (Megatron's `thd` packed format) up to
`max_tokens` tokens, with no padding. Only response positions need logits: a micro-batch carries the flat
index of the positions whose next token is a response token, and every per-token tensor is 1-D over them.
A training step needs even fewer: with `trained_only` only the positions predicting a loss-masked token are
selected (not the tool observations, which carry zero weight), since the vocabulary projection dominates the
cost of a small model and observations are most of a search trajectory's response.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

from ..devices import local_device


@dataclass
class TrainSample:
    """One trajectory as the actor sees it. Per-token lists cover the response (token_ids[response_start:])."""

    token_ids: list[int]
    response_start: int
    loss_mask: list[int]
    advantage: float = 0.0
    token_weights: list[float] | None = None  # loss aggregation weights (algo.loss_token_weights)
    old_logprobs: list[float] | None = None  # None: on-policy, the current logprobs (ratio 1)
    ref_logprobs: list[float] | None = None
    rollout_logprobs: list[float] | None = None  # the engine's, only for the drift metric

    def __post_init__(self) -> None:
        if self.response_start < 1 or self.response_start > len(self.token_ids):
            raise ValueError(f"response_start={self.response_start} outside a sequence of {len(self.token_ids)}")
        for name in ("loss_mask", "token_weights", "old_logprobs", "ref_logprobs", "rollout_logprobs"):
            values = getattr(self, name)
            if values is not None and len(values) != self.response_len:
                raise ValueError(f"{name} has {len(values)} entries for {self.response_len} response tokens")

    @property
    def response_len(self) -> int:
        return len(self.token_ids) - self.response_start


@dataclass
class MicroBatch:
    sample_indices: list[int]  # positions of the packed samples in the caller's list, in packing order
    tokens: torch.Tensor  # [1, total_tokens]: the samples back to back
    position_ids: torch.Tensor  # [1, total_tokens]: restarting at 0 for every sample
    cu_seqlens: torch.Tensor  # [num_samples + 1] int32 sequence boundaries
    max_seqlen: int
    logit_index: torch.Tensor  # [n] packed positions whose next token is a (with trained_only: trained) response token
    labels: torch.Tensor  # [n] the response token predicted at each selected position
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    token_weights: torch.Tensor
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    rollout_logprobs: torch.Tensor | None
    response_lens: list[int]  # selected positions per sample

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[1]

    def to(self, device: torch.device) -> MicroBatch:
        """This micro-batch with every tensor on `device`."""
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(self, **{k: v.to(device) for k, v in moved.items() if isinstance(v, torch.Tensor)})

    def packed_seq_params(self):
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
            max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen,
        )


def _flat(samples: Sequence[TrainSample], name: str, kept: Sequence[Sequence[int]]) -> torch.Tensor | None:
    values = [getattr(s, name) for s in samples]
    if any(v is None for v in values):
        return None
    return torch.tensor([v[r] for v, rows in zip(values, kept) for r in rows], dtype=torch.float)


def _flat_or_zeros(samples: Sequence[TrainSample], name: str, kept: Sequence[Sequence[int]]) -> torch.Tensor:
    values = _flat(samples, name, kept)
    return values if values is not None else torch.zeros(sum(len(rows) for rows in kept))


def _kept_positions(samples: Sequence[TrainSample], trained_only: bool) -> list[list[int]]:
    """Per sample the response offsets that get logits: all of them, or with `trained_only` those whose loss mask is
    set. A micro-batch without a trained token (an empty data-parallel shard's zero-weight stand-in) keeps all, so
    the output layer still sees its input and takes part in the backward pass."""
    every = [list(range(s.response_len)) for s in samples]
    if not trained_only:
        return every
    trained = [[r for r in rows if s.loss_mask[r]] for s, rows in zip(samples, every)]
    return trained if any(trained) else every


def pack_indices(lengths: Sequence[int], max_tokens: int, min_bins: int = 1) -> list[list[int]]:
    """Group sample indices into bins of at most `max_tokens` tokens (first-fit decreasing; a longer sample gets
    a bin of its own). At least `min_bins` bins when there are that many samples, so every pipeline stage has
    work. Each bin lists its indices in ascending order; bins are ordered by their first index."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    capacity = min(max_tokens, max(-(-sum(lengths) // max(min_bins, 1)), max(lengths, default=0)))
    bins: list[list[int]] = []
    loads: list[int] = []
    for index in order:
        for b, load in enumerate(loads):
            if load + lengths[index] <= capacity:
                bins[b].append(index)
                loads[b] += lengths[index]
                break
        else:
            bins.append([index])
            loads.append(lengths[index])
    while len(bins) < min(min_bins, len(lengths)):
        largest = max(range(len(bins)), key=lambda b: (len(bins[b]), loads[b]))
        moved = sorted(bins[largest])[-1]
        bins[largest].remove(moved)
        loads[largest] -= lengths[moved]
        bins.append([moved])
        loads.append(lengths[moved])
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def collate(samples: Sequence[TrainSample], sample_indices: Sequence[int], trained_only: bool = False) -> MicroBatch:
    """Pack `samples` into one row (thd); logits at every response position, or only at trained ones."""
    kept = _kept_positions(samples, trained_only)
    tokens, positions, index, labels, boundaries = [], [], [], [], [0]
    for sample, rows in zip(samples, kept):
        offset = boundaries[-1]
        tokens.extend(sample.token_ids)
        positions.extend(range(len(sample.token_ids)))
        # position t predicts token t + 1
        index.extend(offset + sample.response_start - 1 + r for r in rows)
        labels.extend(sample.token_ids[sample.response_start + r] for r in rows)
        boundaries.append(offset + len(sample.token_ids))
    return MicroBatch(
        sample_indices=list(sample_indices),
        tokens=torch.tensor(tokens, dtype=torch.long).unsqueeze(0),
        position_ids=torch.tensor(positions, dtype=torch.long).unsqueeze(0),
        cu_seqlens=torch.tensor(boundaries, dtype=torch.int32),
        max_seqlen=max(len(s.token_ids) for s in samples),
        logit_index=torch.tensor(index, dtype=torch.long),
        labels=torch.tensor(labels, dtype=torch.long),
        loss_mask=_flat(samples, "loss_mask", kept),
        advantages=torch.tensor([s.advantage for s, rows in zip(samples, kept) for _ in rows], dtype=torch.float),
        token_weights=_flat_or_zeros(samples, "token_weights", kept),
        old_logprobs=_flat(samples, "old_logprobs", kept),
        ref_logprobs=_flat(samples, "ref_logprobs", kept),
        rollout_logprobs=_flat(samples, "rollout_logprobs", kept),
        response_lens=[len(rows) for rows in kept],
    )


def pack_micro_batches(
    samples: Sequence[TrainSample], max_tokens: int, min_micro_batches: int = 1, trained_only: bool = False
) -> list[MicroBatch]:
    """Packed micro-batches on the rank's device (where its model is): its GPU when it has one, else CPU.
    `trained_only`: logits only where the loss mask is set (a training step)."""
    device = local_device()
    bins = pack_indices([len(s.token_ids) for s in samples], max_tokens, min_micro_batches)
    return [collate([samples[i] for i in indices], indices, trained_only).to(device) for indices in bins]
