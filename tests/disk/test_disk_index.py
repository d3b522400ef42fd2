"""The disk tier's index: LRU order within a budget of records, reads pin, writes count before they are
visible, deletions block rewrites until done. Scenario tests, then a state machine over every call."""

from __future__ import annotations

import pytest
from disk_helpers import key
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from scheduler_side.errors import SchedulerError
from scheduler_side.tiers.disk.index import DiskIndex

K = [key(i) for i in range(10)]


def committed(index: DiskIndex, keys) -> None:  # noqa: ANN001
    accepted, _ = index.begin_writes(keys)
    for k in accepted:
        index.end_write(k, ok=True)


def test_a_write_is_visible_only_once_every_rank_finished():
    index = DiskIndex(4)
    # 1. begun: counted against the budget, not hit-able
    assert index.begin_writes([K[1], K[2]]) == ([K[1], K[2]], [])
    assert index.hit_run([K[1], K[2]]) == 0 and index.num_used == 2
    # 2. one ends well, one fails: the failed one is being deleted, not hit-able, not writable yet
    index.end_write(K[1], ok=True)
    index.end_write(K[2], ok=False)
    assert index.hit_run([K[1], K[2]]) == 1
    assert index.begin_writes([K[2]]) == ([], [])
    index.end_delete([K[2]])
    assert index.begin_writes([K[2]]) == ([K[2]], [])
    index.check_integrity()


def test_eviction_takes_the_least_recently_used_and_skips_pinned():
    index = DiskIndex(3)
    committed(index, K[1:4])
    index.touch(K[1])  # order now 2, 3, 1
    index.pin([K[2]])  # being read
    accepted, evicted = index.begin_writes([K[4], K[5]])
    assert accepted == [K[4], K[5]] and evicted == [K[3], K[1]]
    # 2 is pinned and 4, 5 are being written: no room for 6 this time
    assert index.begin_writes([K[6]]) == ([], [])
    index.unpin([K[2]])
    assert index.begin_writes([K[6]]) == ([K[6]], [K[2]])
    index.check_integrity()


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
    evicted = index.add_found([K[1], K[2], K[3]])  # the scan: oldest first
    assert evicted == [K[1]]
    assert index.begin_writes([K[4]]) == ([K[4]], [K[2]])  # the oldest found record goes first
    index.check_integrity()


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = DiskIndex(4)
        self.writing: set[bytes] = set()
        self.pins: list[bytes] = []
        self.deleting: set[bytes] = set()

    @rule(keys=st.lists(st.sampled_from(K), max_size=4))
    def write(self, keys):
        accepted, evicted = self.index.begin_writes(keys)
        self.writing.update(accepted)
        self.deleting.update(evicted)

    @rule(data=st.data(), ok=st.booleans())
    def end_write(self, data, ok):
        if self.writing:
            k = data.draw(st.sampled_from(sorted(self.writing)))
            self.writing.discard(k)
            self.index.end_write(k, ok)
            if not ok:
                self.deleting.add(k)
            else:
                assert k in self.index

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
        assert not any(k in self.index for k in self.writing | self.deleting)


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
