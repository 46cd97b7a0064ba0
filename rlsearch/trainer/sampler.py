"""Deterministic prompt order: a fresh permutation per epoch from (seed, epoch); its state is two ints."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass
class SamplerState:
    epoch: int = 0
    position: int = 0


class EpochSampler(Generic[T]):
    def __init__(self, items: Sequence[T], seed: int, shuffle: bool = True) -> None:
        if not items:
            raise ValueError("cannot sample batches from an empty dataset")
        self.items = list(items)
        self.seed = seed
        self.shuffle = shuffle
        self.state = SamplerState()
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.items)))
        if self.shuffle:
            random.Random(f"{self.seed}/{epoch}").shuffle(order)
        return order

    def restore(self, state: SamplerState) -> None:
        """Continue from a saved position: the same prompts in the same order as the run that saved it."""
        self.state = SamplerState(state.epoch, state.position)
        self._order = self._permutation(state.epoch)

    def next_batch(self, batch_size: int) -> list[T]:
        batch = []
        while len(batch) < batch_size:
            if self.state.position == len(self._order):
                self.state = SamplerState(self.state.epoch + 1, 0)
                self._order = self._permutation(self.state.epoch)
            batch.append(self.items[self._order[self.state.position]])
            self.state.position += 1
        return batch
