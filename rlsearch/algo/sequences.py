"""Sequences laid back to back over a micro-batch's selected positions: which sequence each position is of, and
per-sequence sums. A sequence is one trained sample (a trajectory, or one segment of it)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def sequence_index(response_lens: Sequence[int], positions: int, device: torch.device) -> torch.Tensor:
    """Each position's sequence (0, 1, ...) for sequences of `response_lens` positions laid back to back. All of a
    sequence's positions must be there: with context parallelism a rank holds only some of them."""
    if sum(response_lens) != positions:
        raise ValueError(f"{positions} positions for sequences of {sum(response_lens)}: sequence-level ratios "
                         "(seq_tis, seq_mis, seq_rs, gspo) need every position of a sequence in one micro-batch (not "
                         "with context parallelism)")
    return torch.repeat_interleave(torch.arange(len(response_lens), device=device),
                                   torch.tensor(list(response_lens), dtype=torch.long, device=device))


def sequence_sums(values: torch.Tensor, sequence: torch.Tensor, num_sequences: int) -> torch.Tensor:
    """Per sequence, the sum of its positions' `values`."""
    return values.new_zeros(num_sequences).index_add_(0, sequence, values)
