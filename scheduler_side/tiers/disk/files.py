"""The disk tier's file work on the scheduler side, off the step path: the start-up scan and deletions.

`scan_rank_dirs` rebuilds the index at start-up from the records' headers (never their payloads: reads
verify those): a key counts when every rank's directory holds a record for it whose header is ours
(`Verifier.check_header`: magic, version, fingerprint, key, length, keyed or not) in a file of the right
size owned by this user. Files left from before this start (`before`, a time.time()) that fail are
deleted: bad headers, records some ranks lack, temporaries of writers killed mid-write. Files written
since are left alone (this engine's writers may be busy). Keys come back oldest first (newest mtime of
their ranks' files), so the index's LRU order survives a restart.

`FileWorker` runs the scan, then deletions, on one daemon thread (unlinks spread over a few more):
`delete(keys)` queues a key's record in
every rank's directory for unlinking; `poll()` returns the scan result once and the keys whose files are
gone, so the index may let them be written again (never before: a late unlink would remove the new file).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from offload_connector.disk.format import (
    HEADER_BYTES,
    TMP_SUFFIX,
    Verifier,
    key_of_name,
    record_bytes,
    record_name,
)

logger = logging.getLogger("scheduler_side.scheduler")
_HEADER_READ = 256  # enough for the fixed header and any key
UNLINK_THREADS = 4  # unlinking a record written with O_DIRECT took ~5 ms on ext4 here (bench_disk deletes_per_s)


@dataclass(slots=True)
class ScanResult:
    keys: list[bytes] = field(default_factory=list)  # complete on every rank, oldest first
    payload_bytes: int | None = None  # one rank's block bytes, as the records say (None: no record)
    files_seen: int = 0
    refused_files: int = 0  # deleted (ours, before the start) or skipped (not ours)
    seconds: float = 0.0

    @property
    def blocks_per_second(self) -> float:
        return len(self.keys) / self.seconds if self.seconds > 0 else 0.0


def _unlink(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


def scan_rank_dirs(rank_dirs: Sequence[str], verifiers: Sequence[Verifier], payload_bytes: int | None,
                   before: float) -> ScanResult:
    """`payload_bytes`: one rank's block bytes, or None when the caller does not know them (the scheduler):
    then the first valid record says, and records of another length are refused."""
    start = time.perf_counter()
    result = ScanResult(payload_bytes=payload_bytes)
    uid = os.geteuid()
    found: dict[bytes, list] = {}  # key -> [ranks seen, newest mtime]
    for verifier, path in zip(verifiers, rank_dirs, strict=True):
        try:
            dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            with os.scandir(dir_fd) as entries:
                for entry in entries:
                    result.files_seen += 1
                    why, mtime, key = _check_file(dir_fd, entry.name, verifier, result, uid)
                    if why:
                        result.refused_files += 1
                        if why != "not ours" and mtime < before:
                            _unlink(dir_fd, entry.name)
                        continue
                    seen = found.setdefault(key, [0, 0.0])
                    seen[0] += 1
                    seen[1] = max(seen[1], mtime)
        finally:
            os.close(dir_fd)
    complete = [(mtime, key) for key, (ranks, mtime) in found.items() if ranks == len(rank_dirs)]
    partial = [key for key, (ranks, mtime) in found.items() if ranks != len(rank_dirs) and mtime < before]
    for key in partial:  # a write some ranks never finished: its other records are useless
        for path in rank_dirs:
            try:
                os.unlink(os.path.join(path, record_name(key)))
            except OSError:
                pass
    complete.sort()
    result.keys = [key for _, key in complete]
    result.seconds = time.perf_counter() - start
    return result


def _check_file(dir_fd: int, name: str, verifier: Verifier, result: ScanResult,
                uid: int) -> tuple[str, float, bytes | None]:
    """(why refused or "", mtime, key when a record may be indexed); learns `result.payload_bytes`."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError:
        return "not ours", 0.0, None  # a link, gone, or unreadable
    try:
        st = os.fstat(fd)
        if st.st_uid != uid:
            return "not ours", st.st_mtime, None
        if name.endswith(TMP_SUFFIX):
            return "temporary", st.st_mtime, None
        key = key_of_name(name)
        if key is None:
            return "not a record name", st.st_mtime, None
        header = os.pread(fd, min(_HEADER_READ, HEADER_BYTES), 0)
        why = verifier.check_header(header, key, result.payload_bytes)
        if why:
            return why, st.st_mtime, None
        length = verifier.payload_length(header)
        if st.st_size != record_bytes(length):
            return "wrong size", st.st_mtime, None
        result.payload_bytes = length
        return "", st.st_mtime, key
    finally:
        os.close(fd)


class FileWorker:
    """One daemon thread: the start-up scan first, then deletions in order."""

    def __init__(self, rank_dirs: Sequence[str], verifiers: Sequence[Verifier], payload_bytes: int | None) -> None:
        self.rank_dirs = list(rank_dirs)
        self._verifiers, self._payload_bytes = list(verifiers), payload_bytes
        self._before = time.time()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._scan: ScanResult | None = None
        self._scan_taken = False
        self._scan_ready = threading.Event()
        self._deleted: list[bytes] = []
        self._thread = threading.Thread(target=self._loop, name="disk-files", daemon=True)
        self._thread.start()

    def delete(self, keys: Sequence[bytes]) -> None:
        if keys:
            self._jobs.put(list(keys))

    def poll(self) -> tuple[ScanResult | None, list[bytes]]:
        """(the scan's result the first time it is ready, else None; keys whose files are gone)."""
        with self._lock:
            scan = None
            if self._scan is not None and not self._scan_taken:
                scan, self._scan_taken = self._scan, True
            deleted, self._deleted = self._deleted, []
        return scan, deleted

    def wait_scan(self, timeout: float | None = None) -> bool:
        """Block until the scan's result is ready (for `poll`); False on timeout."""
        return self._scan_ready.wait(timeout)

    @property
    def scan_done(self) -> bool:
        return self._scan_taken

    def _loop(self) -> None:
        try:
            scan = scan_rank_dirs(self.rank_dirs, self._verifiers, self._payload_bytes, self._before)
        except Exception:  # noqa: BLE001 - the tier goes on empty rather than not at all
            logger.exception("disk tier: the start-up scan failed; starting with an empty index")
            scan = ScanResult()
        with self._lock:
            self._scan = scan
        self._scan_ready.set()
        with ThreadPoolExecutor(UNLINK_THREADS, thread_name_prefix="disk-unlink") as unlinkers:
            while True:
                keys = self._jobs.get()
                if keys is None:
                    return
                for _ in unlinkers.map(self._unlink_key, keys):
                    pass
                with self._lock:
                    self._deleted.extend(keys)

    def _unlink_key(self, key: bytes) -> None:
        name = record_name(key)
        for path in self.rank_dirs:
            try:
                os.unlink(os.path.join(path, name))
            except OSError:
                pass

    def close(self, timeout: float = 5.0) -> None:
        self._jobs.put(None)
        self._thread.join(timeout)
