"""A FIFO ring of int64 kernel arguments in registered host memory (the block-copy kernel's id lists).

The block-copy kernel reads its block ids when it runs, not when it is launched, so they must stay intact
until the job's completion event has fired. One ring per copy stream: jobs on a stream complete in
submission order, so space is released in the order it was written. `write` never wraps an argument list
around the end (it skips the tail, and the skipped entries count as used until released); it returns None
when the ring lacks room, and the caller copies that job another way. A write whose launch failed (CUDA
enqueued nothing, so nothing will read it) is given back at once with `unwrite`, which only undoes the most
recent write: the ring is again as it was before it. O(1) Python calls per job.
"""

from __future__ import annotations

import numpy as np

from worker_side.errors import WorkerInvariantError


class ArgRing:
    def __init__(self, entries: np.ndarray) -> None:
        if entries.ndim != 1 or entries.dtype != np.int64:
            raise WorkerInvariantError(f"argument ring needs a flat int64 array, got {entries.shape} {entries.dtype} "
                                       "(our bug)")
        self._table = entries
        self._address = entries.ctypes.data  # of entry 0 (numpy's `.ctypes` costs microseconds a call)
        self.capacity = len(entries)
        self._head = 0  # next entry to write
        self._used = 0  # entries written (or skipped) and not yet released
        self._last = 0  # entries taken by the most recent write, while it may still be undone

    @property
    def num_free(self) -> int:
        return self.capacity - self._used

    def write(self, *arrays: np.ndarray) -> tuple[int, int] | None:
        """Write the arrays back to back; return (their address, entries to release when the job completes),
        or None when the ring lacks room."""
        n = sum(map(len, arrays))
        start, skip = self._head, 0
        if start + n > self.capacity:
            start, skip = 0, self.capacity - start
        if n == 0 or self._used + skip + n > self.capacity:
            return None
        at = start
        for a in arrays:
            self._table[at:at + len(a)] = a
            at += len(a)
        self._head = (start + n) % self.capacity
        self._used += skip + n
        self._last = skip + n
        return self._address + 8 * start, skip + n

    def unwrite(self, num_entries: int) -> None:
        """Undo the most recent write (`num_entries` as it returned): its launch failed, nothing reads it."""
        if num_entries <= 0 or num_entries != self._last:
            raise WorkerInvariantError(f"argument ring: undoing {num_entries} entries, but the most recent write "
                                       f"that may be undone took {self._last} (our bug)")
        self._head = (self._head - num_entries) % self.capacity
        self._used -= num_entries
        self._last = 0

    def release(self, num_entries: int) -> None:
        if num_entries > self._used:
            raise WorkerInvariantError(f"argument ring: releasing {num_entries} entries, {self._used} in use (our bug)")
        self._used -= num_entries
        if self._used < self._last:  # the most recent write's own entries were released: it ran
            self._last = 0
