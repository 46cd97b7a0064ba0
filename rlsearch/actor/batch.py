"""What the actor trains on (plain data) and how it becomes padded micro-batch tensors."""

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
    old_logprobs: list[float] | None = None
    ref_logprobs: list[float] | None = None

    def __post_init__(self) -> None:
        response_len = len(self.token_ids) - self.response_start
        if self.response_start < 1 or response_len < 0:
            raise ValueError(f"response_start={self.response_start} outside a sequence of {len(self.token_ids)}")
        for name in ("loss_mask", "token_weights", "old_logprobs", "ref_logprobs"):
            values = getattr(self, name)
            if values is not None and len(values) != response_len:
                raise ValueError(f"{name} has {len(values)} entries for {response_len} response tokens")


@dataclass
class MicroBatch:
    """Padded [batch, seq] tensors. Position t holds what predicts token t+1 (labels = next token)."""

    tokens: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    response_positions: torch.Tensor  # 1.0 where labels[b, t] is a response token
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    token_weights: torch.Tensor
    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    response_spans: list[tuple[int, int]]  # per sample: [start, end) in label positions


def collate(samples: Sequence[TrainSample]) -> MicroBatch:
    seq_len = max(len(s.token_ids) for s in samples)
    batch = len(samples)
    tokens = torch.zeros(batch, seq_len, dtype=torch.long)
    labels = torch.zeros(batch, seq_len, dtype=torch.long)
    per_token = {name: torch.zeros(batch, seq_len) for name in (
        "response_positions", "loss_mask", "advantages", "token_weights", "old_logprobs", "ref_logprobs")}
    spans = []
    for row, sample in enumerate(samples):
        ids = torch.tensor(sample.token_ids, dtype=torch.long)
        tokens[row, : len(ids)] = ids
        labels[row, : len(ids) - 1] = ids[1:]
        start, end = sample.response_start - 1, len(ids) - 1
        spans.append((start, end))
        per_token["response_positions"][row, start:end] = 1.0
        per_token["loss_mask"][row, start:end] = torch.tensor(sample.loss_mask, dtype=torch.float)
        per_token["advantages"][row, start:end] = sample.advantage
        for name in ("token_weights", "old_logprobs", "ref_logprobs"):
            values = getattr(sample, name)
            if values is not None:
                per_token[name][row, start:end] = torch.tensor(values, dtype=torch.float)
    position_ids = torch.arange(seq_len).unsqueeze(0).expand(batch, -1).contiguous()
    return MicroBatch(tokens=tokens, position_ids=position_ids, labels=labels, response_spans=spans, **per_token)


def split_micro_batches(samples: Sequence[TrainSample], micro_batch_size: int) -> list[list[TrainSample]]:
    return [list(samples[i : i + micro_batch_size]) for i in range(0, len(samples), micro_batch_size)]
