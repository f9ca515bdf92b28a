"""Bounds how far rollouts may run ahead of the trainer (``max_head_offpolicyness``).

Counts rollouts as enqueued -> running -> accepted | rejected. With current weight
version ``v``, staleness bound ``eta`` and train batch size ``B`` (prompts)::

    capacity = min(max(1, max_concurrent) - running,
                   (eta + v + 1) * max(1, B) - (accepted + running))

so ``accepted + running <= (eta + v + 1) * B`` always holds: every batch consumed at
version ``v`` was started at version ``v - eta`` or later. Rejected rollouts free their
slot. ``running`` counts from dispatch to completion, not from enqueue.

``max_staleness=None`` means no staleness bound: only the concurrency limit applies. That
is the evaluation controller's gate (its rollouts are never trained, so none can be stale)
and the gate of rollouts run without a trainer.

A run has one gate, the rollout controller's; rollout workers run what it dispatches.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from areal.api.io_struct import RolloutStat

if TYPE_CHECKING:
    from areal.api.cli_args import InferenceEngineConfig

__all__ = ["StalenessManager"]


class StalenessManager:
    """The gate on starting rollouts: the staleness bound and the concurrency limit."""

    def __init__(
        self,
        version_provider: Callable[[], int],
        max_concurrent_rollouts: int | None,
        consumer_batch_size: int,
        max_staleness: int | None,
    ):
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None, got {max_staleness}")
        self._version = version_provider
        self.consumer_batch_size = max(1, consumer_batch_size)
        self.max_concurrent = max(1, max_concurrent_rollouts or consumer_batch_size)
        self.max_staleness = max_staleness
        self._lock = threading.Lock()
        self._stat = RolloutStat()

    @classmethod
    def from_config(
        cls, config: InferenceEngineConfig, version_provider: Callable[[], int]
    ) -> StalenessManager:
        """The gate ``rollout.max_concurrent_rollouts``, ``consumer_batch_size`` and
        ``max_head_offpolicyness`` describe."""
        consumer = config.consumer_batch_size
        return cls(
            version_provider,
            config.max_concurrent_rollouts or consumer,
            consumer,
            config.max_head_offpolicyness,
        )

    @property
    def pending_limit(self) -> int | None:
        """How many rollouts may wait to be dispatched: ``(eta + 1) * B``; None without a
        staleness bound."""
        if self.max_staleness is None:
            return None
        return (self.max_staleness + 1) * self.consumer_batch_size

    def get_capacity(self) -> int:
        """Rollouts that may be dispatched now (may be negative after a version drop)."""
        with self._lock:
            s = self._stat
            concurrency = self.max_concurrent - s.running
            if self.max_staleness is None:
                return concurrency
            bound = (self.max_staleness + self._version() + 1) * self.consumer_batch_size
            return min(concurrency, bound - (s.accepted + s.running))

    def on_enqueue(self) -> None:
        with self._lock:
            self._stat.enqueued += 1

    def on_submit(self) -> None:
        """A queued rollout starts running."""
        with self._lock:
            self._stat.enqueued -= 1
            self._stat.running += 1

    def on_accept(self) -> None:
        with self._lock:
            self._stat.running -= 1
            self._stat.accepted += 1

    def on_reject(self) -> None:
        with self._lock:
            self._stat.running -= 1
            self._stat.rejected += 1

    def on_version_recovered(self, version: int) -> None:
        """After resuming from a checkpoint at ``version``: ``version * B`` were consumed."""
        with self._lock:
            self._stat.accepted = version * self.consumer_batch_size

    def get_stats(self) -> RolloutStat:
        with self._lock:
            s = self._stat
            return RolloutStat(s.enqueued, s.running, s.accepted, s.rejected)
