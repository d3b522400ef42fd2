"""A FIFO ring of `(dst, src, nbytes)` int64 triples in registered host memory: the kernel's segment tables.

The segment-copy kernel reads its table when it runs, not when it is launched, so a table must stay intact
until the job's completion event has fired. One ring per copy stream: jobs on a stream complete in
submission order, so space is released in the order it was written. `write` never wraps a table around
the end (it skips the tail, and the skipped entries count as used until released); it returns None when
the ring lacks room, and the caller copies those segments another way. O(1) Python calls per table.
"""

from __future__ import annotations

import numpy as np

from worker_side.errors import WorkerInvariantError


class SegmentRing:
    def __init__(self, entries: np.ndarray) -> None:
        if entries.ndim != 2 or entries.shape[1] != 3 or entries.dtype != np.int64:
            raise WorkerInvariantError(f"segment ring needs an (n, 3) int64 table, got {entries.shape} "
                                       f"{entries.dtype} (our bug)")
        self._table = entries
        self.capacity = len(entries)
        self._head = 0  # next entry to write
        self._used = 0  # entries written (or skipped) and not yet released

    @property
    def num_free(self) -> int:
        return self.capacity - self._used

    def write(self, dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray) -> tuple[int, int] | None:
        """Write one table; return (its address, entries to release when its job completes), or None."""
        n = len(nbytes)
        start, skip = self._head, 0
        if start + n > self.capacity:
            start, skip = 0, self.capacity - start
        if n == 0 or self._used + skip + n > self.capacity:
            return None
        rows = self._table[start:start + n]
        rows[:, 0], rows[:, 1], rows[:, 2] = dst, src, nbytes
        self._head = (start + n) % self.capacity
        self._used += skip + n
        return rows.ctypes.data, skip + n

    def release(self, num_entries: int) -> None:
        if num_entries > self._used:
            raise WorkerInvariantError(f"segment ring: releasing {num_entries} entries, {self._used} in use (our bug)")
        self._used -= num_entries
