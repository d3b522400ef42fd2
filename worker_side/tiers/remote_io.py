"""`RemoteWorkerIO`: one rank's traffic with the remote tier, the Redis tier's `TierIO` (tiers/base.py):
fetches (server -> host pool) and writes (host pool -> server).

A block is several records on the server, its parts (remote/format.py `BlockParts`): one per KV head of
the model when the identity says how the heads split (`kv_heads`), this rank writing and reading the parts
of its heads (`HeadRows`: a head's bytes are the same at any TP, so instances of any TP share blocks), or
else one per rank (this rank's whole block). A block is fetched when every one of this rank's parts is
there and verified; it is on the server (for the report) when every one of them was written or found.

Two daemon threads, each with its own `RemoteClient`, sharing one breaker and one `RemoteCounters`:
- the fetch thread takes fetch jobs (event id, CPU block ids, cache keys), GETs this rank's parts' keys in
  pipelined batches, checks each value (`remote_format.decode_value`: header, length = a part's bytes,
  checksum seeded with its key, and with `remote.auth_key_file` the keyed hash) and copies the parts of
  blocks whose every part is good into the host pool's rows: no byte of a value reaches the pool before
  the value passed every check. A missing, refused or corrupt part fails its block (a corrupt one, forged
  or signed with another key included, is counted in `corrupt_blocks` and deleted from the server: left
  there it would block the rightful writer's `SET NX` until its TTL). Results are polled.
  Invariant: a job writes only its own CPU blocks, which the scheduler holds (reserved) until it has seen
  every rank's result, so nobody else reads or writes those rows meanwhile.
- the write thread drains a queue of per-block snapshots (each part's key and payload) with pipelined
  `SET key value NX EX ttl` (each value signed with the auth key when there is one); the cache keys of
  blocks now on the server (every part written, or there already) go into the next report.
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

from offload_connector.auth_key import load_auth_key
from offload_connector.metadata import TierReport
from offload_connector.remote.breaker import CircuitBreaker, RemoteCounters
from offload_connector.remote.client import RemoteClient
from offload_connector.remote.config import RemoteConfig
from offload_connector.remote.format import (
    BlockParts,
    block_key,
    decode_value,
    encode_value,
    key_prefix,
    rank_labels,
)
from offload_connector.tier_identity import TierIdentity
from worker_side.host_pool import HostPool
from worker_side.tiers.base import TierIO
from worker_side.tiers.head_rows import HeadRows

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

    def __init__(self, remote: RemoteConfig, key_prefix: str, rank: int, world_size: int, pool: HostPool,
                 parts: BlockParts | None = None, auth_key: bytes | None = None) -> None:
        """`parts`: the block's parts on the server and this rank's (default: one per rank). `auth_key`:
        sign every value written and serve only values signed with it (None: unsigned values only)."""
        self.remote, self.prefix, self.rank, self.world_size = remote, key_prefix, rank, world_size
        self.auth_key = auth_key
        self.parts = parts if parts is not None else BlockParts(rank_labels(world_size), rank, rank + 1)
        self.labels = self.parts.mine
        self.rows = HeadRows(pool, len(self.labels))
        self.counters = RemoteCounters()
        self.breaker = CircuitBreaker(remote.breaker_backoff_ms / 1000, remote.breaker_max_backoff_ms / 1000)
        self._fetch_client = RemoteClient(remote, self.counters, self.breaker)
        self._write_client = RemoteClient(remote, self.counters, self.breaker)
        self._fetch_jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._results: list[FetchResult] = []
        self._lock = threading.Condition()
        self._fetches_in_flight = 0
        self._writes: deque[tuple[bytes, list[tuple[bytes, memoryview]]]] = deque()  # cache key, parts
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
        """Reads the auth key first (`AuthKeyError` naming `remote.auth_key_file`), before any thread starts."""
        auth_key = load_auth_key("remote.auth_key_file", section.auth_key_file)
        return cls(section, key_prefix(identity, section.namespace), rank, world_size, pool,
                   BlockParts.of(identity, rank, world_size), auth_key)

    def keys(self, cache_key: bytes) -> list[bytes]:
        """The server keys of this rank's parts of one block, in the order of its parts."""
        return [block_key(self.prefix, label, cache_key) for label in self.labels]

    # ---- fetch ---------------------------------------------------------------------------------------
    def submit_fetch(self, event_id: int, cpu_block_ids: Sequence[int], cache_keys: Sequence[bytes]) -> None:
        if len(cpu_block_ids) != len(cache_keys):
            raise ValueError(f"fetch event {event_id}: {len(cpu_block_ids)} CPU blocks vs {len(cache_keys)} keys "
                             "(scheduler bug)")
        with self._lock:
            self._fetches_in_flight += 1
        self._fetch_jobs.put((event_id, list(cpu_block_ids), [self.keys(k) for k in cache_keys]))

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

    def _fetch_batch(self, cpu_ids: list[int], key_lists: list[list[bytes]], result: FetchResult) -> None:
        values = self._fetch_client.get_many([k for keys in key_lists for k in keys])
        if values is None:
            result.failed_cpu_ids.extend(cpu_ids)
            return
        corrupt: list[bytes] = []
        counters, rows, n = self.counters, self.rows, len(self.labels)
        for i, (cpu_id, keys) in enumerate(zip(cpu_ids, key_lists, strict=True)):
            payloads, bad, missing = [], False, False
            for key, blob in zip(keys, values[i * n:(i + 1) * n], strict=True):
                if blob is None:
                    missing = True
                    continue
                payload, why = decode_value(key, blob, rows.part_bytes, self.auth_key)
                if payload is None:
                    logger.warning("remote value %s refused (%s); deleting it", key.decode(errors="replace"), why)
                    corrupt.append(key)
                    bad = True
                    continue
                payloads.append(payload)
            if bad or missing:
                if bad:
                    counters.corrupt_blocks += 1
                else:
                    counters.fetch_miss_blocks += 1
                result.failed_cpu_ids.append(cpu_id)
                continue
            rows.write_parts(cpu_id, payloads)
            counters.fetched_blocks += 1
            counters.fetched_bytes += rows.bytes_per_block
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
                parts = self.rows.read_parts(int(cpu_id))
                self._writes.append((cache_key, [(k, memoryview(p)) for k, p in
                                                 zip(self.keys(cache_key), parts, strict=True)]))
                self._write_bytes += size
            self._lock.notify_all()

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                while not self._writes and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                batch, step = [], batch_blocks(self.rows.bytes_per_block)
                while self._writes and len(batch) < step:
                    batch.append(self._writes.popleft())
                nbytes = len(batch) * self.rows.bytes_per_block
            try:
                self._write_batch(batch)
            except Exception:  # noqa: BLE001 - our bug; the queue must keep draining (wait_idle waits on it)
                logger.exception("remote write of %d blocks failed", len(batch))
                self.counters.dropped_writes += len(batch)
            with self._lock:
                self._write_bytes -= nbytes
                self._lock.notify_all()

    def _write_batch(self, batch: list[tuple[bytes, list[tuple[bytes, memoryview]]]]) -> None:
        """(cache key, [(server key, payload) per part]) per block; the blocks whose every part is now on the
        server join `_on_server`."""
        auth_key = self.auth_key
        replies = self._write_client.set_nx_many(
            [(k, encode_value(k, p, auth_key)) for _, parts in batch for k, p in parts], self.remote.ttl_seconds)
        counters = self.counters
        if replies is None:
            counters.dropped_writes += len(batch)
            return
        on_server, i = [], 0
        for cache_key, parts in batch:
            block_replies = replies[i:i + len(parts)]
            i += len(parts)
            if any(r is None for r in block_replies):
                counters.dropped_writes += 1  # refused by the server (e.g. OOM): counted in errors too
                continue
            written = [len(p) for (_, p), r in zip(parts, block_replies, strict=True) if r is True]
            if written:
                counters.written_blocks += 1
                counters.written_bytes += sum(written)
            else:
                counters.write_exists += 1
            on_server.append(cache_key)
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
