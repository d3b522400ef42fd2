"""The CPU tier's content changes for routers (vLLM's BlockStored / BlockRemoved), kept until taken.

`KVEventLog` owns the list: the CPU pool's evictions append "removed" (`on_cpu_evict`, the pool's
`on_evict` callback), completed stores and fetches append "stored" (completions.py), and the adapter takes
them once per step (`take`). With `enabled` False (no router listens) nothing is kept, so the list never
grows with traffic. O(1) per event.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True)
class KVEvent:
    """A change of the CPU tier's contents, for routers (vLLM's BlockStored/BlockRemoved, medium CPU)."""

    kind: str  # "stored" | "removed"
    block_hash: bytes  # the cache key (block hash + group id)
    medium: str = "CPU"  # "CPU": our tier; "REMOTE": the shared server (stored only: it evicts silently)


class KVEventLog:
    __slots__ = ("enabled", "_events")

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._events: list[KVEvent] = []

    def on_cpu_evict(self, key: bytes, evicted: bool) -> None:
        """The CPU pool dropped `key` (evicted by allocation or forgotten)."""
        if self.enabled:
            self._events.append(KVEvent("removed", key))

    def stored(self, keys: Iterable[bytes], medium: str = "CPU") -> None:
        if self.enabled:
            self._events.extend(KVEvent("stored", key, medium) for key in keys)

    def take(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events
