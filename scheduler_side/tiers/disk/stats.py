"""The disk tier's counters and gauges: names (exported as `disk_<name>`) and what each means.

Counters are running totals: the scheduler's index counters and every rank's I/O counters summed
(`DiskTier.counter_values`, in `DISK_COUNTERS` order); gauges are read when stats are taken.
"""

from __future__ import annotations

from offload_connector.disk.counters import DiskCounters, DiskIndexCounters

WORKER_COUNTERS = tuple(DiskCounters.__dataclass_fields__)
INDEX_COUNTERS = tuple(DiskIndexCounters.__dataclass_fields__)
DISK_COUNTERS = INDEX_COUNTERS + WORKER_COUNTERS
GAUGES = ("capacity_bytes", "used_bytes", "records", "waiting_requests", "scan_done")
DESCRIPTIONS = {
    "lookup_hit_blocks": "blocks found on disk after a CPU miss and read for a waiting request",
    "evicted_blocks": "records deleted to stay within disk.bytes (least recently used)",
    "dropped_blocks": "records forgotten because a rank could not read them (then deleted)",
    "scanned_blocks": "complete records found at start-up (warm restart)",
    "scan_refused_files": "files the start-up scan deleted or skipped (bad header, partial, not ours)",
    "scan_us": "microseconds the start-up scan took",
    "lookups_skipped": "CPU misses with blocks on disk not read: too many requests waiting",
    "read_blocks": "records read into the CPU tier and verified (all ranks)",
    "read_bytes": "bytes read (all ranks)",
    "read_us": "microseconds spent reading, summed over I/O threads (all ranks)",
    "read_miss_blocks": "records gone between lookup and read (all ranks)",
    "corrupt_blocks": "records refused by length or checksum, deleted (all ranks)",
    "foreign_blocks": "records refused as another model's, rank's, key's, user's or signer's (all ranks)",
    "read_failed_blocks": "reads failed by I/O errors or while reads stepped aside (all ranks)",
    "written_blocks": "records written (all ranks)",
    "written_bytes": "bytes written (all ranks)",
    "write_exists": "writes skipped: the record was there already (all ranks)",
    "write_us": "microseconds spent writing, summed over I/O threads (all ranks)",
    "dropped_writes": "blocks not written: copies over max_inflight_bytes, I/O errors, writes stepped aside",
    "errors": "I/O errors (disk full, read-only, EIO ...; all ranks)",
    "breaker_trips": "times reads or writes stepped aside after an I/O error (all ranks)",
    "record_bytes": "bytes one block's records take, summed over ranks (reported once)",
    "capacity_bytes": "disk.bytes: the tier's budget, all ranks",
    "used_bytes": "bytes of the records the index holds, all ranks",
    "records": "blocks on disk (every rank's record complete)",
    "waiting_requests": "requests waiting for a read",
    "scan_done": "1 once the start-up scan has been applied",
}
