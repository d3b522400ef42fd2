"""The disk tier's reads: which requests wait on it, and the read events that bring their runs into the CPU tier.

Flow for one request (at most once per request; `_waits` holds its `DiskWait` until `forget`):
1. its CPU lookup misses at block i: `start` takes the run of blocks i.. that the index holds (stopping at
   one the CPU tier has or receives) and, when the reads in flight leave room (a quarter of the CPU pool:
   concurrent reads of long prompts must not evict each other's blocks before their requests take them),
   allocates CPU blocks for it (evicting), reserves them under their keys, pins the keys in the index and
   adds them to this step's read event; without room the request waits queued, and `waiting` issues its
   read once there is. Its own CPU hits before the run stay pinned until the wait ends.
2. every rank reports the event (`on_report`): blocks no rank failed are committed to the CPU tier
   (hit-able, most recently used), failed ones aborted and their keys dropped from the index (`on_dropped`
   deletes their records). The request's next lookup ends its wait and hits them on the CPU like any block.
   A request stops waiting at `timeout_ms` (then it computes what it did not get).
Holds: one reference on each CPU block of an outstanding read event, released at its completion, and one
on each CPU hit before a waiting request's run, released when the wait ends (or the request is forgotten).
Per step O(1) per waiting request plus O(blocks) when a read is issued or completes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from offload_connector.disk.config import DiskConfig
from offload_connector.disk.counters import DiskIndexCounters
from offload_connector.hashing import with_group_id
from offload_connector.metadata import TierReport
from scheduler_side.pool.block_pool import BlockPool
from scheduler_side.pool.free_queue import Block
from scheduler_side.request_state import RequestState
from scheduler_side.tiers.disk.index import DiskIndex
from scheduler_side.tiers.fetch_reports import FetchEvent, apply_fetch_report, settle_fetch

logger = logging.getLogger("scheduler_side.scheduler")


@dataclass(slots=True)
class DiskWait:
    """A request's one look at the disk tier: queued for room, then reading its run, then done."""

    deadline: float  # time.monotonic() after which the request stops waiting
    first: int  # the request's block index of its first CPU miss: the run starts there ...
    last: int  # ... and ends before this one (the lookup keeps one token to compute)
    read_event: int | None = None  # None: queued (the reads in flight fill the share of the CPU pool)
    num_blocks: int = 0  # blocks of its read, counted in `_reading_blocks` until the wait ends
    own: list[Block] = field(default_factory=list)  # its CPU hits before the run: one reference each, held
    done: bool = False  # ... until the wait ends, so the run read from disk still follows a cached prefix


class DiskReads:
    def __init__(self, disk: DiskConfig, cpu_pool: BlockPool, allocate_cpu: Callable[[int], list[Block]],
                 index: DiskIndex, counters: DiskIndexCounters, world_size: int, group_id: int,
                 clock: Callable[[], float], on_dropped: Callable[[bytes], None]) -> None:
        self.disk, self.cpu_pool, self.index, self.counters = disk, cpu_pool, index, counters
        self._allocate_cpu, self.world_size, self.group_id = allocate_cpu, world_size, group_id
        self.clock, self._on_dropped = clock, on_dropped
        self._waits: dict[str, DiskWait] = {}
        self._waiting: set[str] = set()
        self._events: dict[int, FetchEvent] = {}
        self._to_send: FetchEvent | None = None
        self._next_event = 0
        self._reading_blocks = 0  # blocks of waits with a read issued, until each wait ends
        self._max_reading_blocks = max(1, (cpu_pool.num_blocks - 1) // 4)

    def start(self, state: RequestState, first: int, last: int) -> bool:
        """The request's CPU lookup missed at block `first`: True when it now waits on the disk."""
        if state.request_id in self._waits or first >= last:
            return False
        if not self._run(state, first, last):
            return False
        if len(self._waiting) >= self.disk.max_waiting_requests:
            self.counters.lookups_skipped += 1
            return False
        wait = self._waits[state.request_id] = DiskWait(self.clock() + self.disk.timeout_ms / 1000, first, last)
        self._waiting.add(state.request_id)
        if not self._issue(state, wait) and wait.read_event is None and self._reading_blocks == 0:
            self._stop(state.request_id, wait)  # nothing left to read
            return False
        return True

    def _run(self, state: RequestState, first: int, last: int) -> list[bytes]:
        """Keys of the request's blocks first.. that the index holds, up to the first the CPU tier has or
        receives, and at most `last` - `first` (the lookup keeps one token to compute)."""
        pool, index, group = self.cpu_pool, self.index, self.group_id
        keys = []
        for h in state.request.block_hashes[first:last]:
            key = with_group_id(h, group)
            if key not in index or key in pool.cached or key in pool.reserved:
                break
            keys.append(key)
        return keys

    def _issue(self, state: RequestState, wait: DiskWait) -> bool:
        """Start the request's read when the reads in flight (or not yet looked up) leave room: at most a
        quarter of the CPU pool, so concurrent reads never evict each other's blocks before their requests
        take them. False: not issued (no room, or nothing left to read)."""
        room = self._max_reading_blocks - self._reading_blocks
        if room <= 0:
            return False
        keys = self._run(state, wait.first, wait.last)[:room]
        if not keys:
            return False
        pool, group = self.cpu_pool, self.group_id
        # the request's own CPU hits before the run stay pinned while it waits: evicted meanwhile, the run
        # read from disk would follow a gap and never be hit
        own = [b for b in (pool.cached.get(with_group_id(h, group)) for h in state.request.block_hashes[:wait.first])
               if b]
        pool.touch(own)
        blocks = self._allocate_cpu(len(keys))
        if not blocks:
            pool.free(own)
            return False
        keys = keys[:len(blocks)]
        pool.reserve(blocks, keys)
        self.index.pin(keys)
        event = self._to_send
        if event is None:
            event = self._to_send = FetchEvent(self._next_event)
            self._next_event += 1
        event.cpu_blocks.extend(blocks)
        event.keys.extend(keys)
        wait.read_event, wait.num_blocks, wait.own = event.event_id, len(blocks), own
        self._reading_blocks += len(blocks)
        return True

    def waiting(self, state: RequestState) -> bool:
        wait = self._waits.get(state.request_id)
        if wait is None or wait.done:
            return False
        if self.clock() >= wait.deadline:
            self._stop(state.request_id, wait)
            return False
        if wait.read_event is None:
            if self._issue(state, wait) or self._reading_blocks > 0:
                return True  # reading now, or queued for room
            self._stop(state.request_id, wait)
            return False
        if wait.read_event in self._events or (self._to_send is not None
                                               and self._to_send.event_id == wait.read_event):
            return True
        self._stop(state.request_id, wait)
        return False

    def _stop(self, request_id: str, wait: DiskWait) -> None:
        if not wait.done:
            wait.done = True
            self.cpu_pool.free(wait.own)
            wait.own = []
            self._reading_blocks -= wait.num_blocks
        self._waiting.discard(request_id)

    def forget(self, state: RequestState) -> None:
        wait = self._waits.pop(state.request_id, None)
        if wait is not None:
            self._stop(state.request_id, wait)

    def take_event(self) -> FetchEvent | None:
        """This step's read event (None: none), now in flight; call once per step after every allocation."""
        event, self._to_send = self._to_send, None
        if event is not None:
            self._events[event.event_id] = event
        return event

    def on_report(self, report: TierReport, rank: int) -> list[bytes]:
        """Apply one rank's read completions; returns the keys that became hit-able on the CPU tier."""
        return apply_fetch_report(self._events, self._next_event, report, rank, self.world_size, self._complete,
                                  "disk read event", logger)

    def _complete(self, event: FetchEvent) -> list[bytes]:
        del self._events[event.event_id]
        self.index.unpin(event.keys)
        for block, key in zip(event.cpu_blocks, event.keys, strict=True):
            if block.block_id in event.failed_cpu_ids and self.index.drop(key):
                self.counters.dropped_blocks += 1
                self._on_dropped(key)
        keys = settle_fetch(self.cpu_pool, event)
        self.counters.lookup_hit_blocks += len(keys)
        return keys

    def fail_in_flight(self) -> None:
        """Reads in flight complete as failed (reset_cache)."""
        for event in self._events.values():
            event.failed = True
        if self._to_send is not None:
            self._to_send.failed = True

    def held_block_ids(self) -> set[int]:
        """CPU blocks of read events in flight, and waiting requests' own CPU hits."""
        events = list(self._events.values()) + ([self._to_send] if self._to_send is not None else [])
        return {b.block_id for e in events for b in e.cpu_blocks} | {
            b.block_id for rid in self._waiting for b in self._waits[rid].own}

    @property
    def num_events(self) -> int:
        return len(self._events) + (self._to_send is not None)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)
