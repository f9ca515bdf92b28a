"""A resumable dataloader over a list-like dataset: batches are lists of rows.

Each epoch visits the rows in an order fixed by ``(seed, epoch)`` (shuffled or not);
iterating again starts the next epoch. ``state_dict()`` records the epoch and how many
batches of it were handed out, so a run resumed from a checkpoint sees exactly the rows
an uninterrupted run would have seen next. State is plain JSON (no pickle).

Asynchronous training draws rows ahead of training. Rows handed out by :meth:`tracked`
stay *outstanding* until the consumer calls :meth:`settle` on them (their group was
trained, or rejected); the state lists outstanding rows by key ``(epoch, dataset
index)``, and a loader restored from it hands those rows out again first, so rows drawn
ahead of a checkpoint are trained after a resume, once each.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

__all__ = ["RowKey", "StatefulDataLoader"]

RowKey = tuple[int, int]  # (epoch the row was drawn in, index into the dataset)


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
        self._lock = threading.Lock()  # the consumer settles rows from other threads
        self._outstanding: dict[RowKey, None] = {}  # handed out by tracked(), in order
        self._requeued: list[RowKey] = []  # outstanding at the checkpoint; handed out first

    def __len__(self) -> int:
        full, rest = divmod(len(self.dataset), self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def __iter__(self) -> Iterator[list[Any]]:
        """One epoch of batches; rows count as consumed when handed out."""
        for batch in self._keyed_batches(track=False):
            yield [row for _, row in batch]

    def tracked(self) -> Iterator[list[tuple[RowKey, Any]]]:
        """One epoch of batches of ``(key, row)``; each row is outstanding until settled."""
        return self._keyed_batches(track=True)

    def settle(self, keys: Iterable[RowKey]) -> None:
        """These rows are done with (trained or rejected): a resume does not repeat them."""
        with self._lock:
            for key in keys:
                self._outstanding.pop(tuple(key), None)

    def _keyed_batches(self, track: bool) -> Iterator[list[tuple[RowKey, Any]]]:
        while True:
            with self._lock:
                keys = self._requeued[: self.batch_size]
                del self._requeued[: len(keys)]
                if track:
                    self._outstanding.update(dict.fromkeys(keys))
            if not keys:
                break
            yield [(key, self.dataset[key[1]]) for key in keys]
        order = self._order(self.epoch)
        while True:
            with self._lock:
                if self.position >= len(self):
                    self.epoch += 1
                    self.position = 0
                    return
                start = self.position * self.batch_size
                keys = [(self.epoch, i) for i in order[start : start + self.batch_size]]
                self.position += 1
                if track:
                    self._outstanding.update(dict.fromkeys(keys))
            yield [(key, self.dataset[key[1]]) for key in keys]

    def outstanding(self) -> list[RowKey]:
        """Rows handed out (or due again) and not settled, in the order they were drawn."""
        with self._lock:
            return [*self._requeued, *self._outstanding]

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            outstanding = [list(key) for key in [*self._requeued, *self._outstanding]]
            return {
                "epoch": self.epoch,
                "position": self.position,
                "seed": self.seed,
                "outstanding": outstanding,
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(
                f"the checkpoint's dataloader seed {state['seed']} differs from {self.seed}"
            )
        outstanding = [(int(e), int(i)) for e, i in state.get("outstanding", [])]
        if any(not 0 <= i < len(self.dataset) for _, i in outstanding):
            raise ValueError(
                "the checkpoint's outstanding rows do not fit this dataset "
                f"({len(self.dataset)} rows); was the dataset changed?"
            )
        with self._lock:
            self.epoch = int(state["epoch"])
            self.position = int(state["position"])
            self._outstanding = {}
            self._requeued = outstanding
