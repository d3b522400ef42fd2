"""One rank's traffic with the disk tier: reads (disk -> host pool) and writes (host pool -> disk).

A job is one step's reads or one step's writes (batched per step); its blocks run in parallel on a pool of
`disk.io_threads` threads doing positional vector I/O (`records.py`, GIL released) straight into and out of
the host pool's rows. `poll()` hands back finished jobs as `DiskJobResult`s, each naming the blocks that
failed (a miss for a read: the engine recomputes) and the records refused and deleted (corrupt or foreign:
the scheduler drops them from its index).
Invariants: a read job writes only its own CPU blocks, which the scheduler holds reserved until every rank
reported the job; a write job copies its rows into `Snapshots` slots (one batched copy, GIL released)
before `submit_write` returns and never reads the pool again: the scheduler holds nothing for a write. Every read is verified (`format.Verifier`: key, fingerprint, length,
checksum, keyed hash) before it counts: a record that fails is a miss, never KV.
Faults: an I/O error on a write (disk full, read-only, EIO ...) or a read opens that direction's breaker
(`remote/breaker.py`): one warning, and the direction steps aside (jobs fail at once, counted) until a trial
after the backoff succeeds. No file descriptor, temporary file or buffer outlives its block's task.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from offload_connector.disk.config import DiskConfig
from offload_connector.disk.counters import DiskCounters
from offload_connector.disk.directory import open_rank_dir
from offload_connector.disk.format import Verifier, rank_dir_name, record_bytes, record_name
from offload_connector.remote.breaker import CircuitBreaker
from worker_side.tiers.disk.records import PoolSegments, read_record, write_record
from worker_side.tiers.disk.snapshots import Snapshots

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class DiskJobResult:
    event_id: int
    kind: str  # "read" or "write"
    keys: list[bytes] = field(default_factory=list)  # every block of the job
    failed_keys: list[bytes] = field(default_factory=list)  # blocks not moved (read: a miss)
    dropped_keys: list[bytes] = field(default_factory=list)  # read: records refused and deleted


@dataclass(slots=True)
class _Job:
    result: DiskJobResult
    remaining: int


class DiskWorkerIO:
    def __init__(self, disk: DiskConfig, root: str, fingerprint: bytes, rows: PoolSegments,
                 auth_key: bytes | None = None) -> None:
        """`root`: the tier directory, already checked (`open_private_dir`); this rank's records live in
        its subdirectory named after `fingerprint` (`format.rank_fingerprint`)."""
        self.disk, self.rows = disk, rows
        self.dir = open_rank_dir(root, rank_dir_name(fingerprint))
        self._dir_fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.verifier = Verifier(fingerprint, auth_key)
        self.payload_bytes = rows.bytes_per_block
        self.record_bytes = record_bytes(self.payload_bytes)
        self.direct = bool(disk.direct_io and rows.direct_ok)
        if disk.direct_io and not self.direct:
            logger.info("disk tier: the host pool's rows are not 4096-byte aligned; buffered I/O, not O_DIRECT")
        self.counters = DiskCounters(record_bytes=self.record_bytes)
        backoff, most = disk.breaker_backoff_ms / 1000, disk.breaker_max_backoff_ms / 1000
        self.write_breaker, self.read_breaker = CircuitBreaker(backoff, most), CircuitBreaker(backoff, most)
        self._pool = ThreadPoolExecutor(disk.io_threads, thread_name_prefix="disk-io")
        self._lock = threading.Condition()
        self._results: list[DiskJobResult] = []
        self._jobs_in_flight = 0
        self._reads_in_flight = 0
        self._snapshots = Snapshots(rows.bytes_per_block, disk.max_inflight_bytes)
        self._reported: dict[str, int] = {}
        self._closed = False

    # ---- submitting ----------------------------------------------------------------------------------
    def submit_read(self, event_id: int, cpu_block_ids: Sequence[int], cache_keys: Sequence[bytes]) -> None:
        self._submit(_Job(DiskJobResult(event_id, "read", list(cache_keys)), len(cpu_block_ids)), cpu_block_ids, cache_keys,
                     self._read_one)

    def submit_write(self, event_id: int, cpu_block_ids: Sequence[int], cache_keys: Sequence[bytes]) -> None:
        """Copy these blocks' rows now (the caller may reuse them once this returns), write them later.
        Blocks beyond `max_inflight_bytes` of copies waiting, or all while writes step aside, are dropped."""
        job = _Job(DiskJobResult(event_id, "write", list(cache_keys)), len(cpu_block_ids))
        slots = [] if self.write_breaker.state == "open" else self._snapshots.take(len(cpu_block_ids))
        if slots:
            self.rows.gather(cpu_block_ids[:len(slots)], [self._snapshots.address(s) for s in slots])
        self._submit(job, slots + [None] * (len(cpu_block_ids) - len(slots)), cache_keys, self._write_one)

    def _submit(self, job: _Job, sources: Sequence, cache_keys: Sequence[bytes], task) -> None:  # noqa: ANN001
        if len(sources) != len(cache_keys):
            raise ValueError(f"disk {job.result.kind} event {job.result.event_id}: {len(sources)} blocks vs "
                             f"{len(cache_keys)} keys (scheduler bug)")
        with self._lock:
            if self._closed:
                raise RuntimeError("disk tier I/O used after close (our bug)")
            self._jobs_in_flight += 1
            self._reads_in_flight += job.result.kind == "read"
        if not sources:
            self._finish(job)
            return
        for source, key in zip(sources, cache_keys, strict=True):
            self._pool.submit(self._run, job, task, source, key)

    def _run(self, job: _Job, task, source, key: bytes) -> None:  # noqa: ANN001
        try:
            task(job, source, key)
        except Exception:  # noqa: BLE001 - our bug; the job must still complete (its block fails)
            logger.exception("disk tier: %s of one block failed", job.result.kind)
            with self._lock:
                job.result.failed_keys.append(key)
        with self._lock:
            job.remaining -= 1
            done = job.remaining == 0
        if done:
            self._finish(job)

    def _finish(self, job: _Job) -> None:
        with self._lock:
            self._results.append(job.result)
            self._jobs_in_flight -= 1
            self._reads_in_flight -= job.result.kind == "read"
            self._lock.notify_all()

    # ---- one block -----------------------------------------------------------------------------------
    def _io_failed(self, breaker: CircuitBreaker, what: str, exc: OSError) -> None:
        with self._lock:
            self.counters.errors += 1
        if breaker.on_failure():  # (I/O threads failing together: only the one that opened it warns)
            with self._lock:
                self.counters.breaker_trips += 1
            logger.warning("disk tier: %s failed in %s (%s); %ss step aside for %.1f s and are retried after, "
                           "the engine goes on without them", what, self.dir, errno.errorcode.get(exc.errno or 0,
                           exc.strerror), what, self.disk.breaker_backoff_ms / 1000)

    def _write_one(self, job: _Job, slot: int | None, key: bytes) -> None:
        fail = job.result.failed_keys
        name = record_name(key)
        if slot is not None and self._exists(name):
            self._snapshots.give(slot)
            with self._lock:
                self.counters.write_exists += 1
            return
        if slot is None or not self.write_breaker.allow():
            with self._lock:
                self.counters.dropped_writes += 1
                fail.append(key)
            if slot is not None:
                self._snapshots.give(slot)
            return
        start = time.perf_counter()
        copy = self._snapshots.view(slot)
        try:
            header = self.verifier.seal(key, [copy[:self.payload_bytes]], self.payload_bytes)
            write_record(self._dir_fd, name, f"{name}.{os.getpid()}.{threading.get_ident():x}.tmp", header,
                         [copy], self.payload_bytes, self.direct, self.disk.fsync)
        except OSError as exc:
            self._io_failed(self.write_breaker, "write", exc)
            with self._lock:
                self.counters.dropped_writes += 1
                fail.append(key)
            return
        finally:
            self._snapshots.give(slot)
        self.write_breaker.on_success()
        with self._lock:
            self.counters.written_blocks += 1
            self.counters.written_bytes += self.payload_bytes
            self.counters.write_us += int((time.perf_counter() - start) * 1e6)

    def _exists(self, name: str) -> bool:
        """This rank's record `name` is there already, whole and ours (its content is checked on read)."""
        try:
            st = os.stat(name, dir_fd=self._dir_fd, follow_symlinks=False)
        except OSError:
            return False
        return st.st_size == self.record_bytes and st.st_uid == os.geteuid()

    def _read_one(self, job: _Job, cpu_block_id: int, key: bytes) -> None:
        result, counters = job.result, self.counters
        if not self.read_breaker.allow():
            with self._lock:
                counters.read_failed_blocks += 1
                result.failed_keys.append(key)
            return
        start = time.perf_counter()
        segments = self.rows.segments(cpu_block_id)
        name = record_name(key)
        try:
            header, why = read_record(self._dir_fd, name, segments, self.payload_bytes, self.direct)
            if header is not None:
                why = self.verifier.check_header(header, key, self.payload_bytes) or \
                    self.verifier.check_payload(header, segments)
        except OSError as exc:
            self._io_failed(self.read_breaker, "read", exc)
            with self._lock:
                counters.read_failed_blocks += 1
                result.failed_keys.append(key)
            return
        self.read_breaker.on_success()
        if not why:
            with self._lock:
                counters.read_blocks += 1
                counters.read_bytes += self.payload_bytes
                counters.read_us += int((time.perf_counter() - start) * 1e6)
            return
        dropped = why != "missing"
        if dropped:
            logger.warning("disk tier: record %s refused (%s); deleting it", name, why)
            if not why.startswith("foreign: owned by"):  # another user's file: not ours to delete
                try:
                    os.unlink(name, dir_fd=self._dir_fd)
                except OSError:
                    pass
        with self._lock:
            if why == "missing":
                counters.read_miss_blocks += 1
            elif why.startswith("foreign"):
                counters.foreign_blocks += 1
            else:
                counters.corrupt_blocks += 1
            result.failed_keys.append(key)
            if dropped:
                result.dropped_keys.append(key)

    # ---- results and lifecycle -----------------------------------------------------------------------
    def poll(self) -> list[DiskJobResult]:
        with self._lock:
            out, self._results = self._results, []
        return out

    @property
    def num_jobs_in_flight(self) -> int:
        return self._jobs_in_flight

    @property
    def num_reads_in_flight(self) -> int:
        return self._reads_in_flight

    def take_counter_deltas(self) -> dict[str, int]:
        """The counters' changes since the previous call (non-zero ones only), for the worker's report."""
        with self._lock:
            now = self.counters.snapshot()
        last, self._reported = self._reported, now
        return {k: v - last.get(k, 0) for k, v in now.items() if v != last.get(k, 0)}

    def wait_idle(self, timeout: float | None = None) -> bool:
        with self._lock:
            return self._lock.wait_for(lambda: self._jobs_in_flight == 0, timeout)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True)
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1
