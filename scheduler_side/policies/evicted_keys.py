"""`EvictedKeys`: the keys the tiers dropped most recently (the CPU tier's evictions, or a write-back lower
tier's that keeps them; the lazy policy's test of pressure).

A bounded FIFO of content keys: at most `capacity`, the oldest forgotten first; a key evicted again moves to
the newest end. A lookup that misses on a key still listed asks for content the tier dropped within its last
`capacity` evictions. O(1) per eviction and per query; it holds nothing but the keys.
"""

from __future__ import annotations

from collections import OrderedDict


class EvictedKeys:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"EvictedKeys capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def add(self, key: bytes) -> None:
        """The tier evicted `key`'s copy."""
        keys = self._keys
        keys[key] = None
        keys.move_to_end(key)
        if len(keys) > self.capacity:
            keys.popitem(last=False)

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)
