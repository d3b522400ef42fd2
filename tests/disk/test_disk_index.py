"""The disk tier's index: LRU order within a budget of records, reads pin, a write counts once every rank
finished it, deletions keep a key out until done. Scenario tests, then a state machine over every call."""

from __future__ import annotations

import pytest
from disk_helpers import key
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from scheduler_side.errors import SchedulerError
from scheduler_side.tiers.disk.index import DiskIndex

K = [key(i) for i in range(10)]


def committed(index: DiskIndex, keys) -> list[bytes]:  # noqa: ANN001
    evicted = []
    for k in keys:
        evicted += index.commit(k)[1]
    return evicted


def test_eviction_takes_the_least_recently_used_and_skips_pinned():
    index = DiskIndex(3)
    assert committed(index, K[1:4]) == []
    index.touch(K[1])  # order now 2, 3, 1
    index.pin([K[2]])  # being read
    assert committed(index, [K[4], K[5]]) == [K[3], K[1]]
    assert index.hit_run([K[2], K[4], K[5], K[6]]) == 3
    # 2. every other record being read: a new one has no room and is evicted at once
    index.pin([K[4], K[5]])
    assert index.commit(K[6]) == (False, [K[6]])
    index.check_integrity()
    index.unpin([K[2]])
    assert committed(index, [K[7]]) == [K[2]]
    index.check_integrity()


def test_a_write_that_ends_while_its_key_is_being_deleted_is_not_committed():
    index = DiskIndex(1)
    committed(index, [K[1]])
    assert committed(index, [K[2]]) == [K[1]]  # 1 is being deleted
    assert index.commit(K[1]) == (False, [])  # its new record may be removed by that deletion
    index.end_delete([K[1]])
    assert index.commit(K[1]) == (True, [K[2]])


def test_a_dropped_key_stays_gone_after_its_read_ends():
    index = DiskIndex(3)
    committed(index, [K[1]])
    index.pin([K[1]])
    assert index.drop(K[1]) is True
    index.unpin([K[1]])
    assert K[1] not in index and index.drop(K[1]) is False
    with pytest.raises(SchedulerError, match="not committed"):
        index.pin([K[1]])


def test_found_records_are_older_than_new_writes_and_fit_the_budget():
    index = DiskIndex(3)
    committed(index, [K[9]])  # written since the start
    assert index.add_found([K[1], K[2], K[3]]) == [K[1]]
    assert committed(index, [K[4]]) == [K[2]]  # the oldest found record goes first
    index.check_integrity()


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = DiskIndex(4)
        self.pins: list[bytes] = []
        self.deleting: set[bytes] = set()

    @rule(k=st.sampled_from(K))
    def commit(self, k):
        was_deleting = k in self.deleting
        ok, evicted = self.index.commit(k)
        assert (k in self.index) == ok and not (was_deleting and ok)
        self.deleting.update(evicted)

    @rule(k=st.sampled_from(K))
    def pin(self, k):
        if k in self.index:
            self.index.pin([k])
            self.pins.append(k)

    @rule()
    def unpin(self):
        if self.pins:
            self.index.unpin([self.pins.pop()])

    @rule(k=st.sampled_from(K))
    def drop(self, k):
        if self.index.drop(k):
            self.deleting.add(k)

    @rule()
    def deleted(self):
        self.index.end_delete(self.deleting)
        self.deleting.clear()

    @rule(keys=st.lists(st.sampled_from(K), max_size=6, unique=True))
    def found(self, keys):
        self.deleting.update(self.index.add_found(keys))

    @invariant()
    def consistent(self):
        self.index.check_integrity()
        assert not any(k in self.index for k in self.deleting)
        assert self.index.num_committed <= max(4, len(set(self.pins)))


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
