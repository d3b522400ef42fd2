"""Which blocks the disk tier holds, in LRU order, within a budget of `capacity_blocks` records.

Every block's record has the same size (one engine, one layout), so the byte budget is a block count.
A cache key is in at most one of:
- `_lru` (committed: every rank's record is complete; hit-able; oldest first),
- `_pinned` (committed and being read: not evictable until unpinned; count of reads),
- `_deleting` (its files are being deleted: not hit-able; a write of it that ends meanwhile is not
  committed, since the deletion may remove the new file: the caller deletes it again),
or in none (not on disk, as far as the index knows).
Writes hold nothing before they end (the tier interface: a write copies its rows and owns no CPU block):
a key enters the index only once every rank has written it (`commit`), which evicts least recently used
records down to the budget. So the directory exceeds the budget by at most the writes in flight, which
`disk.max_inflight_bytes` bounds per rank. Every call is O(1) per key. `check_integrity()` checks the
invariants (tests, idle; never per step).
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
        self._deleting: set[bytes] = set()

    # ---- reading the state ---------------------------------------------------------------------------
    def __contains__(self, key: bytes) -> bool:
        """Committed (hit-able)."""
        return key in self._lru or key in self._pinned

    @property
    def num_committed(self) -> int:
        return len(self._lru) + len(self._pinned)

    @property
    def num_deleting(self) -> int:
        return len(self._deleting)

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
        """A rank could not read this key's record (corrupt, foreign, gone, an I/O error): it is no longer
        on disk. True when it was committed (it is now `_deleting`: the caller deletes its files)."""
        if key in self._lru:
            del self._lru[key]
        elif self._pinned.pop(key, None) is None:
            return False
        self._deleting.add(key)
        return True

    # ---- writes --------------------------------------------------------------------------------------
    def commit(self, key: bytes) -> tuple[bool, list[bytes]]:
        """Every rank wrote `key`. Returns (committed, evicted keys). Not committed when its deletion is
        still under way (the caller deletes it again), or when every other record is being read (then it
        is evicted at once). Evicted keys (least recently used, never pinned) are now `_deleting`: the
        caller deletes their files."""
        if key in self._deleting:
            return False, []
        if key in self._pinned:
            return True, []
        self._lru[key] = None
        self._lru.move_to_end(key)
        evicted = self._evict_over_budget()
        return key in self, evicted

    def _evict_over_budget(self) -> list[bytes]:
        evicted = []
        while self.num_committed > self.capacity_blocks and self._lru:
            old, _ = self._lru.popitem(last=False)
            self._deleting.add(old)
            evicted.append(old)
        return evicted

    def touch(self, key: bytes) -> None:
        if key in self._lru:
            self._lru.move_to_end(key)

    # ---- deletions and the start-up scan -------------------------------------------------------------
    def begin_delete(self, key: bytes) -> None:
        """Files of a key not committed are being deleted (a write some ranks never finished)."""
        if key in self:
            raise SchedulerError(f"disk index: deleting committed key {key.hex()} without drop (our bug)")
        self._deleting.add(key)

    def end_delete(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self._deleting.discard(key)

    def add_found(self, keys_oldest_first: Sequence[bytes]) -> list[bytes]:
        """Records found by the start-up scan, older than anything written since: they go to the LRU end
        (oldest first), then the oldest are evicted down to the budget. Returns the evicted keys."""
        for key in reversed(keys_oldest_first):
            if key in self._lru or key in self._pinned or key in self._deleting:
                continue
            self._lru[key] = None
            self._lru.move_to_end(key, last=False)
        return self._evict_over_budget()

    def clear(self) -> list[bytes]:
        """Forget every record not being read (cache reset): returns their keys, now `_deleting`."""
        keys = list(self._lru)
        self._lru.clear()
        self._deleting.update(keys)
        return keys

    def check_integrity(self) -> None:
        sets = [set(self._lru), set(self._pinned), self._deleting]
        if len(set().union(*sets)) != sum(len(s) for s in sets):
            raise SchedulerError("disk index: a key in two states (our bug)")
        if len(self._lru) and self.num_committed > self.capacity_blocks:
            raise SchedulerError(f"disk index: {self.num_committed} records over the budget of "
                                 f"{self.capacity_blocks} with evictable ones left (our bug)")
        if any(c < 1 for c in self._pinned.values()):
            raise SchedulerError("disk index: a pin count below 1 (our bug)")
