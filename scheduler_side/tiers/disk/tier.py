"""`DiskTier`: a local directory behind the lower-tier interface (tiers/base.py), made of three parts:
- the index of what is on disk (`index.py`: LRU within `disk.bytes`), on this thread: a lookup is a dict
  probe, no I/O;
- the reads (`reads.py`): requests that missed on the CPU wait while their run is read into the CPU tier;
- the file thread (`files.py`): the start-up scan (its records join the index as the oldest once it is
  done, or at the first lookup after) and the deletions of evicted or refused records.
Writes (`write: on_cpu_evict`: each block the CPU pool evicts that the index lacks; `on_store`: every
stored block) hold nothing; a key is committed to the index once every rank reported it written, evicting
least recently used records. The record size (all ranks) is learned from the scan or from the ranks'
first report (`record_bytes`): until then nothing is evicted.
Holds: what the reads hold (reads.py), and the directory's lock (directory.py) until `close`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence

from offload_connector.auth_key import load_auth_key
from offload_connector.disk.config import DiskConfig
from offload_connector.disk.counters import DiskIndexCounters
from offload_connector.disk.directory import DirectoryLock, open_private_dir
from offload_connector.disk.format import Verifier, rank_dir_name, rank_fingerprint, record_bytes
from offload_connector.metadata import TierOps, TierReport, TransferMetadata
from scheduler_side.pool.free_queue import Block
from scheduler_side.request_state import RequestState
from scheduler_side.tiers.base import LowerTier, TierContext
from scheduler_side.tiers.disk.files import FileWorker
from scheduler_side.tiers.disk.index import DiskIndex
from scheduler_side.tiers.disk.reads import DiskReads
from scheduler_side.tiers.disk.stats import DESCRIPTIONS, DISK_COUNTERS, GAUGES

logger = logging.getLogger("scheduler_side.scheduler")
UNKNOWN_CAPACITY = 1 << 62  # until the first record's size is known (scan or report): evict nothing


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
        self.reads = DiskReads(disk, self.cpu_pool, context.allocate_cpu, self.index, self.counters,
                               self.world_size, self.group_id, clock, self._drop)
        self._evicted: list[tuple[int, bytes]] = []  # write-back: (CPU block id, key) evicted this step
        self._written_ranks: dict[bytes, set[int]] = {}  # keys some ranks wrote (bounded, oldest dropped)
        self._max_written_pending = 4 * self.cpu_pool.num_blocks
        self._written: list[bytes] = []  # committed since take_written
        self.enabled = True
        self.wants_cpu_evictions = disk.write == "on_cpu_evict"

    @classmethod
    def create(cls, section: DiskConfig, context: TierContext) -> DiskTier:
        """Checks and locks the directory (`DiskDirError` naming `disk.path` when it cannot), starts the
        file thread (the scan first) and waits for the scan at most `disk.scan_wait_ms`. No block is read
        or written here."""
        root = open_private_dir(section.path)
        lock = DirectoryLock(root, section.path)
        auth = load_auth_key("disk.auth_key_file", section.auth_key_file)
        fingerprints = [rank_fingerprint(context.identity, r, context.world_size) for r in range(context.world_size)]
        files = FileWorker([os.path.join(root, rank_dir_name(f)) for f in fingerprints],
                           [Verifier(f, auth) for f in fingerprints], None)
        tier = cls(section, context, files, lock)
        if section.scan_wait_ms:  # a small directory is indexed before the first request; a large one after
            tier.wait_scan(section.scan_wait_ms / 1000)
        return tier

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
                for key in keys:
                    self.context.on_dropped(key)
            self.files.delete(keys)

    def keeps_cpu_evictions(self) -> bool:
        """Write-back on and the tier working: each CPU eviction is written (or already here), and every
        key evicted to stay within `disk.bytes` goes to `on_dropped`."""
        return self.enabled and self.wants_cpu_evictions

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
                "records": self.index.num_committed, "waiting_requests": self.reads.num_waiting,
                "scan_done": int(self.files.scan_done)}

    # ---- lookups -------------------------------------------------------------------------------------
    def start(self, state: RequestState, hashes: Sequence[bytes], first: int, last: int) -> bool:
        if not self.enabled:
            return False
        if not self.files.scan_done:  # the first lookups may come before the first emit: take the scan now
            self._poll_files()
        return self.reads.start(state, first, last)

    def waiting(self, state: RequestState) -> bool:
        return self.reads.waiting(state)

    def forget(self, state: RequestState) -> None:
        self.reads.forget(state)

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
        event = self.reads.take_event()
        if event is None and not self._evicted and not stored:
            return
        ops = TierOps(tier=self.name, write_stored=stored)
        if self._evicted:
            ops.write_cpu_blocks = [cpu_block_id for cpu_block_id, _ in self._evicted]
            ops.write_keys = [key for _, key in self._evicted]
            self._evicted = []
        if event is not None:
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
        return self.reads.on_report(report, rank)

    def _drop(self, key: bytes) -> None:
        """A read of `key` failed on some rank and the index dropped it: delete its records."""
        self._delete([key])

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

    def fail_in_flight(self) -> None:
        """reset_cache: reads in flight fail, and the tier is off for this process (neither read nor
        written): the weights may have changed and the records are of the old ones. The files stay: they
        match the model this process started with, which is what a restart loads."""
        if self.enabled:
            logger.warning("disk tier turned off for this process after a cache reset (weights may have changed)")
        self.enabled = False
        self.reads.fail_in_flight()
        self._evicted = []

    # ---- introspection -------------------------------------------------------------------------------
    def held_block_ids(self) -> set[int]:
        return self.reads.held_block_ids()

    @property
    def num_events(self) -> int:
        return self.reads.num_events

    @property
    def num_waiting(self) -> int:
        return self.reads.num_waiting

    def close(self) -> None:
        self.files.close()
        if self._lock is not None:
            self._lock.release()
            self._lock = None
