"""`RemoteWorkerIO`: one rank's traffic with the remote tier, the Redis tier's `TierIO` (tiers/base.py):
fetches (server -> host pool) and writes (host pool -> server).

Two daemon threads, each with its own `RemoteClient`, sharing one breaker and one `RemoteCounters`:
- the fetch thread takes fetch jobs (event id, CPU block ids, cache keys), GETs this rank's keys in
  pipelined batches, checks each value (`remote_format.decode_value`: header, length = the pool's
  `bytes_per_block`, checksum) and copies good payloads into the host pool's rows. A missing, refused or
  corrupt value fails that block (a corrupt one is also deleted from the server). Results are polled.
  Invariant: a job writes only its own CPU blocks, which the scheduler holds (reserved) until it has seen
  every rank's result, so nobody else reads or writes those rows meanwhile.
- the write thread drains a queue of (key, payload) snapshots with pipelined `SET key value NX EX ttl`;
  the cache keys of blocks now on the server (written, or there already) go into the next report.
  `write` copies the blocks' bytes out of the host pool on the caller's thread, at store completion,
  before the scheduler can hear of it and reuse the blocks: a write never reads a row that changed.
  The queue holds at most `max_inflight_bytes` of payload; beyond it, or while the breaker is open, blocks
  are dropped (`dropped_writes`). The server's `maxmemory-policy` (allkeys-lru) evicts; we never delete
  except corrupt values.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from offload_connector.metadata import TierReport
from offload_connector.remote.breaker import CircuitBreaker, RemoteCounters
from offload_connector.remote.client import RemoteClient
from offload_connector.remote.config import RemoteConfig
from offload_connector.remote.format import block_key, decode_value, encode_value, key_prefix
from offload_connector.tier_identity import TierIdentity
from worker_side.host_pool import HostPool
from worker_side.tiers.base import TierIO
from worker_side.tiers.host_rows import HostRows

logger = logging.getLogger(__name__)
BATCH_BLOCKS = 64  # at most this many blocks per pipelined round trip ...
BATCH_BYTES = 2 << 20  # ... and about this many bytes: larger pipelines were slower on loopback (docs/benchmarks.md)


def batch_blocks(block_bytes: int) -> int:
    """Blocks per round trip for blocks of `block_bytes`: at least 1."""
    return max(1, min(BATCH_BLOCKS, BATCH_BYTES // max(1, block_bytes)))


@dataclass(slots=True)
class FetchResult:
    event_id: int
    failed_cpu_ids: list[int] = field(default_factory=list)


class RemoteWorkerIO(TierIO):
    name = "remote"

    def __init__(self, remote: RemoteConfig, key_prefix: str, rank: int, world_size: int, pool: HostPool) -> None:
        self.remote, self.prefix, self.rank, self.world_size = remote, key_prefix, rank, world_size
        self.rows = HostRows(pool)
        self.counters = RemoteCounters()
        self.breaker = CircuitBreaker(remote.breaker_backoff_ms / 1000, remote.breaker_max_backoff_ms / 1000)
        self._fetch_client = RemoteClient(remote, self.counters, self.breaker)
        self._write_client = RemoteClient(remote, self.counters, self.breaker)
        self._fetch_jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._results: list[FetchResult] = []
        self._lock = threading.Condition()
        self._fetches_in_flight = 0
        self._writes: deque[tuple[bytes, bytes, bytes]] = deque()
        self._write_bytes = 0  # payload bytes queued or being written
        self._closed = False
        self._reported: dict[str, int] = {}  # counters at the last take_counter_deltas
        self._on_server: list[bytes] = []  # cache keys this rank's copy of is on the server, not reported yet
        self._threads = [threading.Thread(target=self._fetch_loop, name=f"remote-fetch-{rank}", daemon=True),
                         threading.Thread(target=self._write_loop, name=f"remote-write-{rank}", daemon=True)]
        for t in self._threads:
            t.start()

    @classmethod
    def create(cls, section: RemoteConfig, identity: TierIdentity, rank: int, world_size: int,
               pool: HostPool) -> RemoteWorkerIO:
        return cls(section, key_prefix(identity, section.namespace), rank, world_size, pool)

    def key(self, cache_key: bytes) -> bytes:
        return block_key(self.prefix, self.rank, self.world_size, cache_key)

    # ---- fetch ---------------------------------------------------------------------------------------
    def submit_fetch(self, event_id: int, cpu_block_ids: Sequence[int], cache_keys: Sequence[bytes]) -> None:
        if len(cpu_block_ids) != len(cache_keys):
            raise ValueError(f"fetch event {event_id}: {len(cpu_block_ids)} CPU blocks vs {len(cache_keys)} keys "
                             "(scheduler bug)")
        with self._lock:
            self._fetches_in_flight += 1
        self._fetch_jobs.put((event_id, list(cpu_block_ids), [self.key(k) for k in cache_keys]))

    def poll(self) -> list[FetchResult]:
        with self._lock:
            out, self._results = self._results, []
        return out

    @property
    def num_fetches_in_flight(self) -> int:
        return self._fetches_in_flight

    def _fetch_loop(self) -> None:
        while True:
            job = self._fetch_jobs.get()
            if job is None:
                return
            event_id, cpu_ids, keys = job
            result = FetchResult(event_id)
            step = batch_blocks(self.rows.bytes_per_block)
            for start in range(0, len(keys), step):
                try:
                    self._fetch_batch(cpu_ids[start:start + step], keys[start:start + step], result)
                except Exception:  # noqa: BLE001 - our bug; the event must still complete (its blocks fail)
                    logger.exception("remote fetch of event %d failed", event_id)
                    self.counters.errors += 1
                    done = set(result.failed_cpu_ids)
                    result.failed_cpu_ids += [c for c in cpu_ids[start:start + step] if c not in done]
            with self._lock:
                self._results.append(result)
                self._fetches_in_flight -= 1
                self._lock.notify_all()

    def _fetch_batch(self, cpu_ids: list[int], keys: list[bytes], result: FetchResult) -> None:
        values = self._fetch_client.get_many(keys)
        if values is None:
            result.failed_cpu_ids.extend(cpu_ids)
            return
        corrupt = []
        counters, rows = self.counters, self.rows
        for cpu_id, key, blob in zip(cpu_ids, keys, values, strict=True):
            if blob is None:
                counters.fetch_miss_blocks += 1
                result.failed_cpu_ids.append(cpu_id)
                continue
            payload, why = decode_value(key, blob, rows.bytes_per_block)
            if payload is None:
                counters.corrupt_blocks += 1
                logger.warning("remote value %s refused (%s); deleting it", key.decode(errors="replace"), why)
                corrupt.append(key)
                result.failed_cpu_ids.append(cpu_id)
                continue
            rows.write(cpu_id, payload)
            counters.fetched_blocks += 1
            counters.fetched_bytes += len(payload)
        if corrupt:
            self._fetch_client.delete(corrupt)

    # ---- write ---------------------------------------------------------------------------------------
    def write(self, cpu_block_ids: Sequence[int], cache_keys: Sequence[bytes]) -> None:
        """Snapshot these just-stored blocks and queue them for the server (dropping what does not fit)."""
        size, limit = self.rows.bytes_per_block, self.remote.max_inflight_bytes
        if self.breaker.state == "open":
            self.counters.dropped_writes += len(cpu_block_ids)
            return
        with self._lock:
            for cpu_id, cache_key in zip(cpu_block_ids, cache_keys, strict=True):
                if self._write_bytes + size > limit:
                    self.counters.dropped_writes += 1
                    continue
                self._writes.append((cache_key, self.key(cache_key), self.rows.read(int(cpu_id))))
                self._write_bytes += size
            self._lock.notify_all()

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                while not self._writes and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                batch, nbytes, step = [], 0, batch_blocks(self.rows.bytes_per_block)
                while self._writes and len(batch) < step:
                    item = self._writes.popleft()
                    batch.append(item)
                    nbytes += len(item[2])
            try:
                self._write_batch(batch)
            except Exception:  # noqa: BLE001 - our bug; the queue must keep draining (wait_idle waits on it)
                logger.exception("remote write of %d blocks failed", len(batch))
                self.counters.dropped_writes += len(batch)
            with self._lock:
                self._write_bytes -= nbytes
                self._lock.notify_all()

    def _write_batch(self, batch: list[tuple[bytes, bytes, bytes]]) -> None:
        """(cache key, server key, payload) per block; the blocks now on the server join `_on_server`."""
        replies = self._write_client.set_nx_many([(k, encode_value(k, p)) for _, k, p in batch],
                                                 self.remote.ttl_seconds)
        counters = self.counters
        if replies is None:
            counters.dropped_writes += len(batch)
            return
        on_server = []
        for (cache_key, _, payload), reply in zip(batch, replies, strict=True):
            if reply is True:
                counters.written_blocks += 1
                counters.written_bytes += len(payload)
                on_server.append(cache_key)
            elif reply is False:
                counters.write_exists += 1
                on_server.append(cache_key)
            else:
                counters.dropped_writes += 1  # refused by the server (e.g. OOM): counted in errors too
        with self._lock:
            self._on_server.extend(on_server)

    def take_on_server_keys(self) -> list[bytes]:
        """Cache keys of the blocks written (or found there already) since the previous call, for the
        worker's report: the scheduler publishes them as KV events with medium REMOTE."""
        with self._lock:
            keys, self._on_server = self._on_server, []
        return keys

    def take_counter_deltas(self) -> dict[str, int]:
        """The counters' changes since the previous call (non-zero ones only), for the worker's report."""
        now = self.counters.snapshot()
        now["breaker_trips"] = self.breaker.num_trips
        last, self._reported = self._reported, now
        return {k: v - last.get(k, 0) for k, v in now.items() if v != last.get(k, 0)}

    def take_report(self) -> TierReport:
        report = TierReport(tier=self.name)
        for fetch in self.poll():
            report.completed_fetch_events.append(fetch.event_id)
            report.failed_fetch_cpu_blocks.extend(fetch.failed_cpu_ids)
        report.counters = self.take_counter_deltas()
        report.written_keys = self.take_on_server_keys()
        return report

    # ---- lifecycle -----------------------------------------------------------------------------------
    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no fetch is running and the write queue is empty; False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: self._fetches_in_flight == 0 and self._write_bytes == 0, timeout)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._fetch_jobs.put(None)
        for t in self._threads:
            t.join(timeout=5)
        self._fetch_client.close()
        self._write_client.close()
