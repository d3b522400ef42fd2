"""Which blocks the disk tier holds, in LRU order, within a budget of `capacity_blocks` records.

Every block's record has the same size (one engine, one layout), so the byte budget is a block count.
A cache key is in exactly one of:
- `_lru` (committed: every rank's record is complete; hit-able; oldest first),
- `_pinned` (committed and being read: not evictable until unpinned; count of reads),
- `_writing` (a write in flight: counts against the budget, not hit-able),
- `_deleting` (its files are being deleted: not hit-able, not writable, not counted),
or in none (not on disk). Writes and reads change state only through the calls below, each O(1) per key;
eviction takes the LRU head. `begin_writes` never exceeds the budget: when every slot is pinned or being
written, it accepts fewer keys. `check_integrity()` checks the invariants (tests, idle; never per step).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from scheduler_side.errors import SchedulerError


class DiskIndex:
    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"disk index of {capacity_blocks} blocks; need >= 1 (our bug: config checks it)")
        self.capacity_blocks = capacity_blocks
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        self._pinned: dict[bytes, int] = {}
        self._writing: set[bytes] = set()
        self._deleting: set[bytes] = set()

    # ---- reading the state ---------------------------------------------------------------------------
    def __contains__(self, key: bytes) -> bool:
        """Committed (hit-able)."""
        return key in self._lru or key in self._pinned

    @property
    def num_used(self) -> int:
        """Records counted against the budget: committed or being written."""
        return len(self._lru) + len(self._pinned) + len(self._writing)

    @property
    def num_committed(self) -> int:
        return len(self._lru) + len(self._pinned)

    def hit_run(self, keys: Iterable[bytes]) -> int:
        """How many of `keys`, from the first, are committed."""
        n = 0
        for key in keys:
            if key not in self._lru and key not in self._pinned:
                break
            n += 1
        return n

    # ---- reads ---------------------------------------------------------------------------------------
    def pin(self, keys: Sequence[bytes]) -> None:
        """A read of these committed keys starts: not evictable until `unpin`."""
        for key in keys:
            if key in self._lru:
                del self._lru[key]
                self._pinned[key] = 1
            elif key in self._pinned:
                self._pinned[key] += 1
            else:
                raise SchedulerError(f"disk index: pin of key {key.hex()}, which is not committed (our bug)")

    def unpin(self, keys: Sequence[bytes]) -> None:
        """The read ended: the key becomes the most recently used (a dropped key stays gone)."""
        for key in keys:
            count = self._pinned.get(key)
            if count is None:
                continue  # dropped while pinned
            if count > 1:
                self._pinned[key] = count - 1
            else:
                del self._pinned[key]
                self._lru[key] = None

    def drop(self, key: bytes) -> bool:
        """A rank refused this key's record (corrupt, foreign, gone): it is no longer on disk. True when
        it was committed (the caller deletes its files)."""
        if key in self._lru:
            del self._lru[key]
        elif self._pinned.pop(key, None) is None:
            return False
        self._deleting.add(key)
        return True

    # ---- writes --------------------------------------------------------------------------------------
    def begin_writes(self, keys: Sequence[bytes]) -> tuple[list[bytes], list[bytes]]:
        """Make room for `keys` (skipping ones on disk, being written or deleted) by evicting LRU records.
        Returns (accepted keys, evicted keys: the caller deletes their files; they are now `_deleting`)."""
        accepted: list[bytes] = []
        evicted: list[bytes] = []
        for key in keys:
            if key in self._lru or key in self._pinned or key in self._writing or key in self._deleting:
                if key in self._lru:
                    self._lru.move_to_end(key)
                continue
            if self.num_used >= self.capacity_blocks:
                if not self._lru:
                    break  # every slot pinned or being written: no room this step
                old, _ = self._lru.popitem(last=False)
                self._deleting.add(old)
                evicted.append(old)
            self._writing.add(key)
            accepted.append(key)
        return accepted, evicted

    def end_write(self, key: bytes, ok: bool) -> None:
        """The write of `key` ended on every rank: committed (most recent) when `ok`, else the caller
        deletes what some ranks wrote (`_deleting`)."""
        if key not in self._writing:
            raise SchedulerError(f"disk index: end of a write of key {key.hex()} that was not begun (our bug)")
        self._writing.discard(key)
        if ok:
            self._lru[key] = None
        else:
            self._deleting.add(key)

    def touch(self, key: bytes) -> None:
        if key in self._lru:
            self._lru.move_to_end(key)

    # ---- deletions and the start-up scan -------------------------------------------------------------
    def end_delete(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self._deleting.discard(key)

    def add_found(self, keys_oldest_first: Sequence[bytes]) -> list[bytes]:
        """Records found by the start-up scan, older than anything written since: they go to the LRU end
        (oldest first), then the oldest are evicted down to the budget. Returns the evicted keys."""
        for key in reversed(keys_oldest_first):
            if key in self._lru or key in self._pinned or key in self._writing or key in self._deleting:
                continue
            self._lru[key] = None
            self._lru.move_to_end(key, last=False)
        evicted = []
        while self.num_used > self.capacity_blocks and self._lru:
            old, _ = self._lru.popitem(last=False)
            self._deleting.add(old)
            evicted.append(old)
        return evicted

    def clear(self) -> list[bytes]:
        """Forget every committed record (cache reset): returns their keys, now `_deleting`."""
        keys = list(self._lru) + list(self._pinned)
        self._lru.clear()
        self._pinned.clear()
        self._deleting.update(keys)
        return keys

    def check_integrity(self) -> None:
        sets = [set(self._lru), set(self._pinned), self._writing, self._deleting]
        total = sum(len(s) for s in sets)
        if len(set().union(*sets)) != total:
            raise SchedulerError("disk index: a key in two states (our bug)")
        if self.num_used > self.capacity_blocks:
            raise SchedulerError(f"disk index: {self.num_used} records over the budget of {self.capacity_blocks}")
        if any(c < 1 for c in self._pinned.values()):
            raise SchedulerError("disk index: a pin count below 1 (our bug)")
