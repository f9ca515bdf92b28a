"""StalenessManager capacities, computed by hand (docs/design.md#staleness-gate).

capacity = min(max(1, max_concurrent) - running, (eta + v + 1) * B - (accepted + running))
"""

from __future__ import annotations

import pytest

from areal.infra.staleness_manager import StalenessManager


class Version:
    def __init__(self) -> None:
        self.value = 0

    def __call__(self) -> int:
        return self.value


def manager(eta: int, batch: int, concurrent: int | None, version: Version) -> StalenessManager:
    return StalenessManager(version, concurrent, batch, eta)


def test_synchronous_training_eta_0():
    v = Version()
    m = manager(eta=0, batch=4, concurrent=8, version=v)
    assert m.get_capacity() == 4  # min(8 - 0, 1 * 4 - 0)
    for _ in range(4):
        m.on_enqueue()
        m.on_submit()
    assert m.get_capacity() == 0  # min(8 - 4, 4 - (0 + 4))
    m.on_accept()
    m.on_accept()
    assert m.get_capacity() == 0  # min(8 - 2, 4 - (2 + 2))
    m.on_reject()  # a rejected rollout frees its slot
    assert m.get_capacity() == 1  # min(8 - 1, 4 - (2 + 1))
    v.value = 1
    assert m.get_capacity() == 5  # min(8 - 1, 2 * 4 - 3)
    assert m.pending_limit == 4  # (0 + 1) * 4


def test_concurrency_limit_binds_first():
    v = Version()
    m = manager(eta=2, batch=2, concurrent=3, version=v)
    assert m.get_capacity() == 3  # min(3 - 0, 3 * 2 - 0 = 6)
    for _ in range(3):
        m.on_enqueue()
        m.on_submit()
    assert m.get_capacity() == 0  # min(3 - 3, 6 - 3)
    assert m.pending_limit == 6  # (2 + 1) * 2


def test_staleness_bound_binds_after_accepting():
    v = Version()
    m = manager(eta=1, batch=4, concurrent=100, version=v)
    for _ in range(8):
        m.on_enqueue()
        m.on_submit()
        m.on_accept()
    assert m.get_capacity() == 0  # min(100, (1 + 0 + 1) * 4 - 8)
    v.value = 2
    assert m.get_capacity() == 8  # min(100, (1 + 2 + 1) * 4 - 8)


def test_default_concurrency_is_the_batch_size():
    m = manager(eta=5, batch=3, concurrent=None, version=Version())
    assert m.max_concurrent == 3 and m.get_capacity() == 3  # min(3, 6 * 3)


def test_after_recovery():
    v = Version()
    v.value = 5
    m = manager(eta=1, batch=4, concurrent=64, version=v)
    m.on_version_recovered(5)  # 5 batches of 4 were consumed before the restart
    assert m.get_stats().accepted == 20
    assert m.get_capacity() == 8  # min(64, (1 + 5 + 1) * 4 - 20)
    for _ in range(3):
        m.on_enqueue()
        m.on_submit()
    assert m.get_capacity() == 5  # min(61, 28 - 23)


def test_counts_and_validation():
    m = manager(eta=0, batch=1, concurrent=2, version=Version())
    m.on_enqueue()
    m.on_enqueue()
    m.on_submit()
    stats = m.get_stats()
    assert (stats.enqueued, stats.running, stats.accepted, stats.rejected) == (1, 1, 0, 0)
    with pytest.raises(ValueError, match="max_staleness"):
        manager(eta=-1, batch=1, concurrent=1, version=Version())
