"""The drill consumers' commit pacing (chaos.clients.paced.PendingCommit)."""

from __future__ import annotations

import pytest

from chaos.clients.paced import PendingCommit

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_offsets_are_committed_at_most_every_interval_latest_per_partition_and_all_on_stop():
    clock = Clock()
    pending = PendingCommit(0.5, clock)
    assert pending.take() == {}  # nothing consumed
    pending.add({0: 11, 1: 5})
    clock.now += 0.2
    pending.add({0: 12})
    assert pending.take() == {}  # not due: 0.2 s since the last commit
    clock.now += 0.3
    assert pending.take() == {0: 12, 1: 5}  # due: the latest offset of each partition
    assert pending.take() == {}  # taken: nothing pending
    pending.add({1: 6})
    clock.now += 0.1
    assert pending.take() == {}
    assert pending.take(final=True) == {1: 6}  # on stop: whatever is pending, due or not
    assert pending.take(final=True) == {}
