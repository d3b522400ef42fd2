"""`Admissions`: feeding the admission filter and applying what it decides to the CPU tier.

A part of the scheduler that owns its `AdmissionFilter` (`filter`): a request's block keys go to it when it is
admitted (all of them) and when it finishes (those completed since), together with its hints, read once
per request from its `kv_transfer_params` (only once the filter is active: with `branch_filter`, or from
the first request with a hint on; an engine whose clients send no hints pays nothing per block) (a malformed one is counted in `num_bad_hints`, logged and
ignored); keys that die as a superseded branch lose their CPU copies (`BlockPool.discard`), keys of a
closed session have theirs moved to the eviction end (`BlockPool.demote`). Held CPU blocks (a transfer in
flight) are left alone either way. The filter judges content by group 0's keys; with several KV-cache
groups (a hybrid model) what it decides applies to the same block's copy in every group.

Mutates: the filter (keys, sessions, `active`), the request's `hints` and `num_admitted_keys`, CPU copies
(discarded or demoted, free ones only) and the admission counters of `SchedulerStats`. The store policy
reads the filter's `is_dead` through its view.
"""

from __future__ import annotations

import logging

from offload_connector.hashing import group_suffix, with_group_id
from scheduler_side.admission.filter import AdmissionFilter
from scheduler_side.admission.hints import parse_hints
from scheduler_side.pool.block_pool import BlockPool
from scheduler_side.request_state import RequestState
from scheduler_side.stats import SchedulerStats

logger = logging.getLogger("scheduler_side.scheduler")


class Admissions:
    def __init__(self, capacity: int, branch_filter: bool, cpu_pool: BlockPool, stats: SchedulerStats,
                 group_id: int, other_suffixes: tuple[bytes, ...]) -> None:
        """`capacity`: keys the filter remembers; `other_suffixes`: with several KV-cache groups, the key
        suffixes of every group but group 0 (`group_id`)."""
        self.filter = AdmissionFilter(capacity, branch_filter=branch_filter)
        self.cpu_pool, self.stats, self.group_id, self._other_suffixes = cpu_pool, stats, group_id, other_suffixes

    def _copies(self, key: bytes) -> list[bytes]:
        """`key` (a group-0 key) and, with several KV-cache groups, the same block's key in each other group."""
        if not self._other_suffixes:
            return [key]
        base = key[:-len(group_suffix(self.group_id))]
        return [key] + [base + suffix for suffix in self._other_suffixes]

    def admit_keys(self, state: RequestState, extends: bool, first_new: int = 0) -> None:
        """Tell the admission filter the request's block keys (all of them when admitted, with `extends`;
        those completed since, without; `first_new`: its first computed block); drop the CPU copies of keys
        that died. O(blocks walked)."""
        if state.hints is None:
            state.hints, problem = parse_hints(getattr(state.request, "kv_transfer_params", None))
            if problem is not None:
                self.stats.num_bad_hints += 1
                logger.warning("request %s: ignoring its hints: %s", state.request_id, problem)
        hints, hashes, group = state.hints, state.request.block_hashes, self.group_id
        if not self.filter.active:
            if hints.session is None and hints.store:
                return  # no hint seen yet and no branch filter: nothing needs the tree (hot path, no cost)
            self.filter.active = True
        start = 0 if extends else state.num_admitted_keys
        base = max(0, start - 1)  # the parent of the first new key
        keys = [with_group_id(hashes[i], group) for i in range(base, len(hashes))]
        died = self.filter.admit_request(keys, hints.session, hints.store, max(0, first_new - base),
                                            start - base, extends)
        state.num_admitted_keys = len(hashes)
        cpu_pool = self.cpu_pool
        for key in died:
            for copy in self._copies(key):
                block = cpu_pool.lookup(copy)
                if block is not None and cpu_pool.discard(block):
                    self.stats.num_dropped_blocks += 1

    def admit_finished(self, state: RequestState) -> None:
        """A finishing request: the blocks it completed since admission (its output) join the tree, and its
        session closes if its hints say so."""
        if not state.num_admitted_keys:
            return  # never admitted: nothing of it in the tree
        self.admit_keys(state, extends=False)
        if state.hints is not None and state.hints.close_session and state.hints.session is not None:
            self.close_session(state.hints.session)

    def close_session(self, session: str) -> int:
        """The client's session ended: the CPU copies of blocks only it used go to the eviction end (oldest
        use nearest the head) and those blocks are not stored again unless requested again. Returns how
        many CPU copies moved. O(blocks the session used)."""
        keys = self.filter.close_session(session)
        self.stats.num_closed_sessions += 1
        cpu_pool, demoted = self.cpu_pool, 0
        for key in reversed(keys):  # each goes to the head: the oldest ends nearest it
            for copy in self._copies(key):
                block = cpu_pool.lookup(copy)
                if block is not None and cpu_pool.demote(block):
                    demoted += 1
        self.stats.num_demoted_blocks += demoted
        return demoted
