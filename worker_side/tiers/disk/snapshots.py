"""Copies of host-pool blocks waiting to be written to disk: slots in one lazily touched, page-aligned buffer.

A write must copy its blocks before it returns (the scheduler reuses them right after), so every written
block passes through a slot here: `take(n)` hands out up to n free slots (fewer when `capacity_bytes`, the
config's `max_inflight_bytes`, is used up: the caller drops the rest, counted), `gather` fills them in one
batched copy, and each slot comes back with `give` once its record is on disk or has failed. Slots are
`align_up(bytes_per_block)` long, zero-padded past the block, page aligned (O_DIRECT can write them).
The buffer is an anonymous mapping: pages are touched (and count as memory) only as slots are first used,
and reused after. Thread-safe.
"""

from __future__ import annotations

import ctypes
import mmap
import threading

from offload_connector.disk.format import align_up


class Snapshots:
    def __init__(self, bytes_per_block: int, capacity_bytes: int) -> None:
        self.slot_bytes = align_up(bytes_per_block)
        self.num_slots = max(1, capacity_bytes // self.slot_bytes)
        self._buf = mmap.mmap(-1, self.num_slots * self.slot_bytes)
        self._view = memoryview(self._buf)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._buf))
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._lock = threading.Lock()

    def take(self, n: int) -> list[int]:
        with self._lock:
            k = min(n, len(self._free))
            out = self._free[len(self._free) - k:]
            del self._free[len(self._free) - k:]
        return out

    def give(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    def address(self, slot: int) -> int:
        return self._base + slot * self.slot_bytes

    def view(self, slot: int) -> memoryview:
        return self._view[slot * self.slot_bytes:(slot + 1) * self.slot_bytes]

    @property
    def num_free(self) -> int:
        return len(self._free)
