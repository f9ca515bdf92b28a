"""A resumable dataloader over a list-like dataset: batches are lists of rows.

Each epoch visits the rows in an order fixed by ``(seed, epoch)`` (shuffled or not);
iterating again starts the next epoch. ``state_dict()`` records the epoch and how many
batches of it were handed out, so a run resumed from a checkpoint sees exactly the rows
an uninterrupted run would have seen next. State is plain JSON (no pickle).
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["StatefulDataLoader"]


class StatefulDataLoader:
    def __init__(
        self,
        dataset: Sequence[Any],
        batch_size: int,
        shuffle: bool = True,
        drop_last: bool = True,
        seed: int = 0,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if len(dataset) < batch_size and drop_last:
            raise ValueError(
                f"the dataset has {len(dataset)} rows, fewer than one batch of {batch_size}"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = seed
        self.epoch = 0
        self.position = 0  # batches already handed out in this epoch

    def __len__(self) -> int:
        full, rest = divmod(len(self.dataset), self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def __iter__(self) -> Iterator[list[Any]]:
        order = self._order(self.epoch)
        while self.position < len(self):
            start = self.position * self.batch_size
            indices = order[start : start + self.batch_size]
            self.position += 1
            yield [self.dataset[i] for i in indices]
        self.epoch += 1
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(
                f"the checkpoint's dataloader seed {state['seed']} differs from {self.seed}"
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
