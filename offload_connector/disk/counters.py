"""What the disk tier did: one `DiskCounters` per worker rank (reads, writes) and one `DiskIndexCounters`
on the scheduler (lookups, eviction, the start-up scan). Plain int counters (times in microseconds: a
worker report's counters are ints), no I/O, no project imports."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class DiskCounters:
    read_blocks: int = 0  # records read into the host pool and verified
    read_bytes: int = 0  # payload bytes of those
    read_us: int = 0  # microseconds, summed over the I/O threads
    read_miss_blocks: int = 0  # the file was gone (evicted or removed since the lookup)
    corrupt_blocks: int = 0  # refused: length, checksum, truncated (dropped: the file is deleted)
    foreign_blocks: int = 0  # refused: another fingerprint, key, owner, or keyed hash (dropped)
    read_failed_blocks: int = 0  # I/O errors or the tier stepped aside: a miss, the record kept
    written_blocks: int = 0
    written_bytes: int = 0
    write_exists: int = 0  # writes skipped: this rank's record of the key was there already
    write_us: int = 0
    dropped_writes: int = 0  # not written: queue full, the tier stepped aside, or an I/O error
    errors: int = 0  # I/O errors (disk full, read-only, EIO ...)
    breaker_trips: int = 0
    record_bytes: int = 0  # bytes one block's record takes on this rank (set once: its delta is reported once)

    def snapshot(self) -> dict[str, int]:
        return asdict(self)


@dataclass(slots=True)
class DiskIndexCounters:
    lookup_hit_blocks: int = 0  # blocks found on disk after a CPU miss
    evicted_blocks: int = 0  # records deleted to stay within disk.bytes
    dropped_blocks: int = 0  # records a rank refused on read (corrupt or foreign): deleted
    scanned_blocks: int = 0  # complete records found by the start-up scan
    scan_refused_files: int = 0  # files the scan deleted (bad header) or skipped (not ours)
    scan_us: int = 0
    lookups_skipped: int = 0  # CPU misses with blocks on disk not read: max_waiting_requests reached

    def snapshot(self) -> dict[str, int]:
        return asdict(self)
