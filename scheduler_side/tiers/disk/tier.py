"""`DiskTier`: a local directory behind the lower-tier interface (tiers/base.py).

What is on disk is the `DiskIndex` (index.py), kept on this thread: a lookup is a dict probe, no I/O.
Flow for one request (at most once per request; `_waits` holds its `DiskWait` until `forget`):
1. its CPU lookup misses at block i: `start` counts the run of blocks i.. that the index holds (stopping at
   one the CPU tier has or receives), allocates CPU blocks for them (evicting; the request's own CPU hits
   stay pinned meanwhile), reserves them under their keys, pins the keys in the index and adds them to this
   step's read event. The request waits (its lookup answers None) until every rank reported the event, or
   until `timeout_ms` (then it computes what it did not get).
2. every rank reports the event (`on_report`): blocks no rank failed are committed to the CPU tier
   (hit-able, most recently used), failed ones aborted and their keys dropped from the index and deleted
   (a rank could not read them: corrupt, foreign, gone, an I/O error). The request's next lookup hits them
   on the CPU like any block and the normal CPU -> GPU load follows.
Writes (`write: on_store`: every stored block; `on_cpu_evict`: each block the CPU pool evicts that the
index lacks) hold nothing; a key is committed to the index once every rank reported it written, evicting
least recently used records (deleted by the file thread, files.py). The start-up scan (files.py) runs on
that thread too; its records join the index, as the oldest, once it is done.
Holds: one reference on each CPU block of an outstanding read event, released at its completion; one on
each CPU hit before a waiting request's run, released when it stops waiting (or is forgotten); the
directory's lock (directory.py) until `close`. Per step O(1) per waiting request plus O(blocks) moved.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from offload_connector.disk.config import DiskConfig, read_auth_key
from offload_connector.disk.counters import DiskIndexCounters
from offload_connector.disk.directory import DirectoryLock, open_private_dir
from offload_connector.disk.format import Verifier, rank_dir_name, rank_fingerprint, record_bytes
from offload_connector.hashing import with_group_id
from offload_connector.metadata import TierOps, TierReport, TransferMetadata
from scheduler_side.errors import SchedulerError
from scheduler_side.pool.free_queue import Block
from scheduler_side.request_state import RequestState
from scheduler_side.tiers.base import LowerTier, TierContext
from scheduler_side.tiers.disk.files import FileWorker
from scheduler_side.tiers.disk.index import DiskIndex
from scheduler_side.tiers.disk.stats import DESCRIPTIONS, DISK_COUNTERS, GAUGES

logger = logging.getLogger("scheduler_side.scheduler")
UNKNOWN_CAPACITY = 1 << 62  # until the first record's size is known (scan or report): evict nothing


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


@dataclass(slots=True)
class ReadEvent:
    """One step's reads. Holds one reference on each CPU block; their keys are reservations until done."""

    event_id: int
    cpu_blocks: list[Block] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)
    reported_ranks: set[int] = field(default_factory=set)
    failed_cpu_ids: set[int] = field(default_factory=set)
    failed: bool = False  # every block fails (reset_cache)


class DiskTier(LowerTier):
    name, medium = "disk", "DISK"
    COUNTERS, GAUGES, DESCRIPTIONS = DISK_COUNTERS, GAUGES, DESCRIPTIONS

    def __init__(self, disk: DiskConfig, context: TierContext, files: FileWorker, lock: DirectoryLock | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.disk, self.context, self.files, self._lock = disk, context, files, lock
        self.cpu_pool, self.world_size, self.group_id = context.cpu_pool, context.world_size, context.group_id
        self.clock = clock
        self.index = DiskIndex(UNKNOWN_CAPACITY)
        self.record_bytes: int | None = None  # all ranks' records of one block
        self.counters = DiskIndexCounters()
        self.worker_counters: dict[str, int] = {}
        self._waits: dict[str, DiskWait] = {}
        self._waiting: set[str] = set()
        self._events: dict[int, ReadEvent] = {}
        self._to_send: ReadEvent | None = None
        self._next_event = 0
        self._evicted: list[tuple[int, bytes]] = []  # write-back: (CPU block id, key) evicted this step
        self._written_ranks: dict[bytes, set[int]] = {}  # keys some ranks wrote (bounded, oldest dropped)
        self._max_written_pending = 4 * self.cpu_pool.num_blocks
        self._written: list[bytes] = []  # committed since take_written
        self._reading_blocks = 0  # blocks of waits with a read issued, until each wait ends
        self._max_reading_blocks = max(1, (self.cpu_pool.num_blocks - 1) // 4)
        self.enabled = True
        self.wants_cpu_evictions = disk.write == "on_cpu_evict"

    @classmethod
    def create(cls, section: DiskConfig, context: TierContext) -> DiskTier:
        """Checks and locks the directory (`DiskDirError` naming `disk.path` when it cannot), starts the
        file thread (the scan first). No block is read or written here."""
        root = open_private_dir(section.path)
        lock = DirectoryLock(root, section.path)
        auth = read_auth_key(section.auth_key_file) if section.auth_key_file else None
        fingerprints = [rank_fingerprint(context.identity, r, context.world_size) for r in range(context.world_size)]
        files = FileWorker([os.path.join(root, rank_dir_name(f)) for f in fingerprints],
                           [Verifier(f, auth) for f in fingerprints], None)
        return cls(section, context, files, lock)

    @staticmethod
    def describe(section: DiskConfig) -> str:
        from offload_connector.sizing import format_bytes
        return f"disk tier {section.path} ({format_bytes(int(section.bytes))}, write {section.write})"

    # ---- sizes and files -----------------------------------------------------------------------------
    def _learn_record_bytes(self, rank_record_bytes: int) -> None:
        if self.record_bytes is None and rank_record_bytes > 0:
            self.record_bytes = rank_record_bytes * self.world_size
            self.index.capacity_blocks = max(1, int(self.disk.bytes) // self.record_bytes)
            self._delete(self.index.add_found([]), evicted=True)

    def _delete(self, keys: list[bytes], evicted: bool = False) -> None:
        if keys:
            if evicted:
                self.counters.evicted_blocks += len(keys)
            self.files.delete(keys)

    def _poll_files(self) -> None:
        scan, deleted = self.files.poll()
        self.index.end_delete(deleted)
        if scan is not None:
            self.counters.scanned_blocks = len(scan.keys)
            self.counters.scan_refused_files = scan.refused_files
            self.counters.scan_us = int(scan.seconds * 1e6)
            if scan.payload_bytes is not None:
                self._learn_record_bytes(record_bytes(scan.payload_bytes))
            self._delete(self.index.add_found(scan.keys), evicted=True)
            logger.info("disk tier: %d blocks found in %s in %.2f s (%.0f blocks/s)", len(scan.keys),
                        self.disk.path, scan.seconds, scan.blocks_per_second)

    def wait_scan(self, timeout: float | None = None) -> bool:
        """Block until the start-up scan is done and its records are in the index (replays and tests that
        want the same result every run; an engine never waits: older blocks miss until the scan is done)."""
        if not self.files.wait_scan(timeout):
            return False
        self._poll_files()
        return True

    def counter_values(self) -> tuple[int, ...]:
        mine, theirs = self.counters.snapshot(), self.worker_counters
        return tuple(mine.get(k, 0) + theirs.get(k, 0) for k in DISK_COUNTERS)

    def gauges(self) -> dict[str, float]:
        per = self.record_bytes or 0
        return {"capacity_bytes": int(self.disk.bytes), "used_bytes": self.index.num_committed * per,
                "records": self.index.num_committed, "waiting_requests": len(self._waiting),
                "scan_done": int(self.files.scan_done)}

    # ---- lookups -------------------------------------------------------------------------------------
    def start(self, state: RequestState, hashes: Sequence[bytes], first: int, last: int) -> bool:
        if state.request_id in self._waits or first >= last or not self.enabled:
            return False
        if not self.files.scan_done:  # the first lookups may come before the first emit: take the scan now
            self._poll_files()
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
        blocks = self.context.allocate_cpu(len(keys))
        if not blocks:
            pool.free(own)
            return False
        keys = keys[:len(blocks)]
        pool.reserve(blocks, keys)
        self.index.pin(keys)
        event = self._to_send
        if event is None:
            event = self._to_send = ReadEvent(self._next_event)
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

    # ---- the step ------------------------------------------------------------------------------------
    def writes_stored(self) -> bool:
        return self.enabled and self.disk.write == "on_store"

    def on_cpu_evict(self, block: Block) -> None:
        """Write-back: write the evicted block unless the disk holds it (its key taken now: the block is
        reused at once; its bytes stay valid until this step's copies start)."""
        key = block.block_hash
        if self.enabled and key is not None and key not in self.index:
            self._evicted.append((block.block_id, key))

    def emit(self, meta: TransferMetadata) -> None:
        self._poll_files()
        stored = bool(meta.store_keys) and self.writes_stored()
        event = self._to_send
        if event is None and not self._evicted and not stored:
            return
        ops = TierOps(tier=self.name, write_stored=stored)
        if self._evicted:
            ops.write_cpu_blocks = [cpu_block_id for cpu_block_id, _ in self._evicted]
            ops.write_keys = [key for _, key in self._evicted]
            self._evicted = []
        if event is not None:
            self._to_send = None
            self._events[event.event_id] = event
            ops.fetch_event = event.event_id
            ops.fetch_cpu_blocks = [b.block_id for b in event.cpu_blocks]
            ops.fetch_keys = list(event.keys)
        meta.tiers.append(ops)

    def on_report(self, report: TierReport, rank: int) -> list[bytes]:
        for name, delta in report.counters.items():
            self.worker_counters[name] = self.worker_counters.get(name, 0) + delta
        if report.counters.get("record_bytes"):
            self._learn_record_bytes(report.counters["record_bytes"])
        if report.written_keys and self.enabled:
            self._note_written(report.written_keys, rank)
        committed: list[bytes] = []
        failed = set(report.failed_fetch_cpu_blocks)
        for event_id in report.completed_fetch_events:
            event = self._events.get(event_id)
            if event is None:
                if not 0 <= event_id < self._next_event:
                    raise SchedulerError(f"completion for disk read event {event_id}, which was never issued")
                logger.warning("ignoring a late completion of disk read event %d", event_id)
                continue
            if rank in event.reported_ranks:
                logger.warning("ignoring a repeated completion of disk read event %d from rank %d", event_id, rank)
                continue
            event.reported_ranks.add(rank)
            event.failed_cpu_ids.update(b.block_id for b in event.cpu_blocks if b.block_id in failed)
            if len(event.reported_ranks) == self.world_size:
                committed += self._complete(event)
        return committed

    def _note_written(self, keys: Sequence[bytes], rank: int) -> None:
        """A key is on disk once every rank wrote it; a key some rank never reports is given up (its
        records deleted) once `_max_written_pending` newer ones wait."""
        done = list(keys) if self.world_size == 1 else []
        if self.world_size > 1:
            pending = self._written_ranks
            for key in keys:
                ranks = pending.setdefault(key, set())
                ranks.add(rank)
                if len(ranks) == self.world_size:
                    del pending[key]
                    done.append(key)
                elif len(pending) > self._max_written_pending:
                    stale = next(iter(pending))
                    del pending[stale]
                    if stale not in self.index:
                        self.index.begin_delete(stale)
                        self._delete([stale])
        for key in done:
            ok, evicted = self.index.commit(key)
            self._delete(evicted, evicted=True)
            if ok:
                self._written.append(key)
            elif key not in evicted:  # its deletion was under way: that may take the new records too
                self._delete([key])

    def take_written(self) -> list[bytes]:
        keys, self._written = self._written, []
        return keys

    def _complete(self, event: ReadEvent) -> list[bytes]:
        del self._events[event.event_id]
        pool = self.cpu_pool
        bad = [b for b in event.cpu_blocks if event.failed or b.block_id in event.failed_cpu_ids]
        good = [b for b in event.cpu_blocks if not (event.failed or b.block_id in event.failed_cpu_ids)]
        self.index.unpin(event.keys)
        for block, key in zip(event.cpu_blocks, event.keys, strict=True):
            if block.block_id in event.failed_cpu_ids and self.index.drop(key):
                self.counters.dropped_blocks += 1
                self._delete([key])
        pool.abort(bad)
        pool.free(bad, front=True)
        keys = pool.commit(good)
        pool.free(good)
        self.counters.lookup_hit_blocks += len(keys)
        return keys

    def fail_in_flight(self) -> None:
        """reset_cache: reads in flight fail, and the tier is off for this process (neither read nor
        written): the weights may have changed and the records are of the old ones. The files stay: they
        match the model this process started with, which is what a restart loads."""
        if self.enabled:
            logger.warning("disk tier turned off for this process after a cache reset (weights may have changed)")
        self.enabled = False
        for event in self._events.values():
            event.failed = True
        if self._to_send is not None:
            self._to_send.failed = True
        self._evicted = []

    # ---- introspection -------------------------------------------------------------------------------
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

    def close(self) -> None:
        self.files.close()
        if self._lock is not None:
            self._lock.release()
            self._lock = None
