"""What the actor trains on (plain data) and how it becomes micro-batch tensors.

Only response positions need logits: a micro-batch carries the padded [batch, seq] inputs plus a flat index of
the positions whose next token is a response token. Every per-token tensor is 1-D over those positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


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
    tokens: torch.Tensor  # [batch, seq], right-padded
    position_ids: torch.Tensor
    logit_index: torch.Tensor  # [n] flat indices into the [seq, batch] hidden states (megatron's layout)
    labels: torch.Tensor  # [n] the response token predicted at each selected position
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    token_weights: torch.Tensor
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    rollout_logprobs: torch.Tensor | None
    response_lens: list[int]


def _flat(samples: Sequence[TrainSample], name: str) -> torch.Tensor | None:
    values = [getattr(s, name) for s in samples]
    if any(v is None for v in values):
        return None
    return torch.tensor([x for v in values for x in v], dtype=torch.float)


def _flat_or_zeros(samples: Sequence[TrainSample], name: str, length: int) -> torch.Tensor:
    values = _flat(samples, name)
    return values if values is not None else torch.zeros(length)


def collate(samples: Sequence[TrainSample]) -> MicroBatch:
    seq_len = max(len(s.token_ids) for s in samples)
    batch = len(samples)
    tokens = torch.zeros(batch, seq_len, dtype=torch.long)
    index, labels = [], []
    for row, sample in enumerate(samples):
        tokens[row, : len(sample.token_ids)] = torch.tensor(sample.token_ids, dtype=torch.long)
        # position t predicts token t + 1
        for position in range(sample.response_start - 1, len(sample.token_ids) - 1):
            index.append(position * batch + row)
        labels.extend(sample.token_ids[sample.response_start :])
    return MicroBatch(
        tokens=tokens,
        position_ids=torch.arange(seq_len).unsqueeze(0).expand(batch, -1).contiguous(),
        logit_index=torch.tensor(index, dtype=torch.long),
        labels=torch.tensor(labels, dtype=torch.long),
        loss_mask=torch.tensor([m for s in samples for m in s.loss_mask], dtype=torch.float),
        advantages=torch.tensor([s.advantage for s in samples for _ in range(s.response_len)], dtype=torch.float),
        token_weights=_flat_or_zeros(samples, "token_weights", len(labels)),
        old_logprobs=_flat(samples, "old_logprobs"),
        ref_logprobs=_flat(samples, "ref_logprobs"),
        rollout_logprobs=_flat(samples, "rollout_logprobs"),
        response_lens=[s.response_len for s in samples],
    )


def split_micro_batches(samples: Sequence[TrainSample], micro_batch_size: int) -> list[list[TrainSample]]:
    return [list(samples[i : i + micro_batch_size]) for i in range(0, len(samples), micro_batch_size)]
