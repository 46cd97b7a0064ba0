"""Which samples a step trains on and how its updates split them: GRPO groups with a learning signal, and
contiguous mini-batches. Plain data in, indices out."""

from __future__ import annotations

from collections.abc import Hashable, Sequence


def groups_with_signal(outcomes: Sequence[float], group_ids: Sequence[Hashable]) -> list[Hashable]:
    """The groups (in order of first appearance) whose samples do not all have the same outcome. A group where every
    sample is right, or every one wrong, has zero advantages (nothing to learn from) when the outcome is the reward,
    and only noise (a format bonus, say) when the reward is shaped: DAPO's dynamic sampling drops both."""
    if len(outcomes) != len(group_ids):
        raise ValueError("one group id per outcome")
    seen: dict[Hashable, set[float]] = {}
    for outcome, group in zip(outcomes, group_ids):
        seen.setdefault(group, set()).add(outcome)
    return [group for group, values in seen.items() if len(values) > 1]


def minibatch_bounds(num_samples: int, num_minibatches: int) -> list[tuple[int, int]]:
    """[start, end) of `num_minibatches` contiguous parts of near-equal sample counts (the first ones one longer),
    never empty: fewer parts when there are fewer samples. Counts rather than tokens: the loss of each part is
    normalised over its own tokens, and equal counts keep every data-parallel shard of every part filled."""
    if num_minibatches < 1:
        raise ValueError(f"num_minibatches must be >= 1, got {num_minibatches}")
    parts = min(num_minibatches, num_samples)
    if parts == 0:
        return []
    base, extra = divmod(num_samples, parts)
    bounds, start = [], 0
    for index in range(parts):
        end = start + base + (1 if index < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds
