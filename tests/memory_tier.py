"""A lower tier kept in this process's memory: a real implementation of both tier interfaces, for tests.

It shows what a new tier is: this one module (a config section, `MemoryTier` for the scheduler side,
`MemoryTierIO` for each worker rank) and a registration under the section's name (`registered`). A
`MemoryStore` plays the tier's storage (a server, a directory): engines naming the same store share it.
Records are keyed by the identity's fingerprints, the rank and the cache key, and carry a checksum of the
key and payload; a record that fails it is a failed block (never KV), as the interface demands.
Lookups are synchronous (the store is a dict): a CPU miss fetches the run found at once, the request
waits for the fetch event like any tier's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import msgspec
import xxhash

from offload_connector import lower_tiers
from offload_connector.config import OffloadConfig
from offload_connector.hashing import with_group_id
from offload_connector.metadata import TierOps, TierReport, TransferMetadata
from offload_connector.tier_identity import TierIdentity
from scheduler_side.pool.block import Block
from scheduler_side.request_state import RequestState
from scheduler_side.tiers import registry as scheduler_registry
from scheduler_side.tiers.base import LowerTier, TierContext
from scheduler_side.tiers.fetch_reports import FetchEvent, apply_fetch_report, settle_fetch
from worker_side.host_pool import HostPool
from worker_side.tiers import registry as worker_registry
from worker_side.tiers.base import TierIO
from worker_side.tiers.host_rows import HostRows


class MemorySection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    store: str  # the name of the in-process store (engines naming the same one share it)
    write: Literal["on_store", "on_cpu_evict"] = "on_store"


class MemoryTierConfig(OffloadConfig, kw_only=True):
    memory: MemorySection | None = None  # the new tier's config section


def with_memory(config: OffloadConfig, store: str, **section) -> MemoryTierConfig:
    return MemoryTierConfig(**msgspec.structs.asdict(config), memory=MemorySection(store=store, **section))


logger = logging.getLogger("tests.memory_tier")

@dataclass
class MemoryStore:
    records: dict[tuple[str, int, int, bytes], tuple[int, bytes]] = field(default_factory=dict)


STORES: dict[str, MemoryStore] = {}


def record_key(identity: TierIdentity, rank: int, world_size: int, cache_key: bytes) -> tuple[str, int, int, bytes]:
    return f"{identity.model_fingerprint()}:{identity.layout_fingerprint()}", rank, world_size, cache_key


def checksum(cache_key: bytes, payload: bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload, seed=xxhash.xxh3_64_intdigest(cache_key))


@contextmanager
def registered(nearest: bool = True) -> Iterator[None]:
    """Register the memory tier under "memory" (nearest first, or last) for the duration."""
    saved = lower_tiers.LOWER_TIERS
    lower_tiers.LOWER_TIERS = ("memory", *saved) if nearest else (*saved, "memory")
    scheduler_registry.TIERS["memory"] = MemoryTier
    worker_registry.TIER_IOS["memory"] = MemoryTierIO
    try:
        yield
    finally:
        lower_tiers.LOWER_TIERS = saved
        del scheduler_registry.TIERS["memory"], worker_registry.TIER_IOS["memory"]


class MemoryTier(LowerTier):
    name, medium = "memory", "MEMORY"
    COUNTERS = ("hit_blocks", "fetched_blocks", "failed_blocks", "written_blocks")

    def __init__(self, section: MemorySection, context: TierContext) -> None:
        self.section, self.context = section, context
        self.store = STORES.setdefault(section.store, MemoryStore())
        self.wants_cpu_evictions = section.write == "on_cpu_evict"
        self.enabled = True
        self.asked: dict[str, int | None] = {}  # request id -> the fetch event it waits for (None: none)
        self.events: dict[int, FetchEvent] = {}  # emitted, not complete on every rank
        self.to_send: FetchEvent | None = None
        self.next_event = 0
        self.evicted: list[tuple[int, bytes]] = []  # (CPU block, its key when evicted: it is reused right after)
        self.written_ranks: dict[bytes, set[int]] = {}
        self.written: list[bytes] = []
        self.counts = dict.fromkeys(self.COUNTERS, 0)

    @classmethod
    def create(cls, section: MemorySection, context: TierContext) -> MemoryTier:
        return cls(section, context)

    @staticmethod
    def describe(section: MemorySection) -> str:
        return f"memory tier {section.store}"

    def _present(self, cache_key: bytes) -> bool:
        ctx = self.context
        return all(record_key(ctx.identity, r, ctx.world_size, cache_key) in self.store.records
                   for r in range(ctx.world_size))

    def start(self, state: RequestState, hashes: Sequence[bytes], first: int, last: int) -> bool:
        rid, pool = state.request_id, self.context.cpu_pool
        if rid in self.asked or first >= last or not self.enabled:
            return False
        self.asked[rid] = None
        keys = []
        for h in hashes[first:last]:
            key = with_group_id(h, self.context.group_id)
            if key in pool.cached or key in pool.reserved or not self._present(key):
                break
            keys.append(key)
        if not keys:
            return False
        own = [b for b in (pool.cached.get(with_group_id(h, self.context.group_id)) for h in hashes[:first]) if b]
        pool.touch(own)  # the request's own CPU hits stay while the run's blocks are allocated
        blocks = self.context.allocate_cpu(len(keys))
        pool.free(own)
        if not blocks:
            return False
        keys = keys[:len(blocks)]
        pool.reserve(blocks, keys)
        if self.to_send is None:
            self.to_send, self.next_event = FetchEvent(self.next_event), self.next_event + 1
        self.to_send.cpu_blocks += blocks
        self.to_send.keys += keys
        self.asked[rid] = self.to_send.event_id
        self.counts["hit_blocks"] += len(keys)
        return True

    def waiting(self, state: RequestState) -> bool:
        event_id = self.asked.get(state.request_id)
        if event_id is None:
            return False
        if event_id in self.events or (self.to_send is not None and self.to_send.event_id == event_id):
            return True
        self.asked[state.request_id] = None
        return False

    def forget(self, state: RequestState) -> None:
        self.asked.pop(state.request_id, None)

    def on_cpu_evict(self, block: Block) -> None:
        if self.enabled:
            self.evicted.append((block.block_id, block.block_hash))

    def writes_stored(self) -> bool:
        return self.enabled and self.section.write == "on_store"

    def emit(self, meta: TransferMetadata) -> None:
        stored = bool(meta.store_keys) and self.writes_stored()
        if self.to_send is None and not self.evicted and not stored:
            return
        ops = TierOps(tier=self.name, write_stored=stored, write_cpu_blocks=[cpu_id for cpu_id, _ in self.evicted],
                      write_keys=[key for _, key in self.evicted])
        self.evicted = []
        if self.to_send is not None:
            event, self.to_send = self.to_send, None
            self.events[event.event_id] = event
            ops.fetch_event, ops.fetch_cpu_blocks = event.event_id, [b.block_id for b in event.cpu_blocks]
            ops.fetch_keys = list(event.keys)
        meta.tiers.append(ops)

    def on_report(self, report: TierReport, rank: int) -> list[bytes]:
        for name, delta in report.counters.items():
            self.counts[name] += delta
        for key in report.written_keys:
            ranks = self.written_ranks.setdefault(key, set())
            ranks.add(rank)
            if len(ranks) == self.context.world_size:
                del self.written_ranks[key]
                self.written.append(key)
        return apply_fetch_report(self.events, self.next_event, report, rank, self.context.world_size,
                                  self._complete, "memory fetch event", logger)

    def _complete(self, event: FetchEvent) -> list[bytes]:
        del self.events[event.event_id]
        return settle_fetch(self.context.cpu_pool, event)

    def take_written(self) -> list[bytes]:
        keys, self.written = self.written, []
        return keys

    def fail_in_flight(self) -> None:
        self.enabled = False
        for event in [*self.events.values(), *([self.to_send] if self.to_send else [])]:
            event.failed = True

    def held_block_ids(self) -> set[int]:
        events = [*self.events.values(), *([self.to_send] if self.to_send else [])]
        return {b.block_id for e in events for b in e.cpu_blocks}

    @property
    def num_events(self) -> int:
        return len(self.events) + (self.to_send is not None)

    @property
    def num_waiting(self) -> int:
        return sum(1 for e in self.asked.values() if e is not None)

    def counter_values(self) -> tuple[int, ...]:
        return tuple(self.counts[name] for name in self.COUNTERS)

    def close(self) -> None:
        self.asked.clear()


class MemoryTierIO(TierIO):
    name = "memory"

    def __init__(self, section: MemorySection, identity: TierIdentity, rank: int, world_size: int,
                 pool: HostPool) -> None:
        self.store = STORES.setdefault(section.store, MemoryStore())
        self.identity, self.rank, self.world_size = identity, rank, world_size
        self.rows = HostRows(pool)
        self.done: list[tuple[int, list[int]]] = []
        self.written: list[bytes] = []
        self.counts: dict[str, int] = {}

    @classmethod
    def create(cls, section: MemorySection, identity: TierIdentity, rank: int, world_size: int,
               pool: HostPool) -> MemoryTierIO:
        return cls(section, identity, rank, world_size, pool)

    def _count(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def submit_fetch(self, event_id: int, cpu_block_ids: Sequence[int], keys: Sequence[bytes]) -> None:
        failed = []
        for cpu_id, key in zip(cpu_block_ids, keys, strict=True):
            record = self.store.records.get(record_key(self.identity, self.rank, self.world_size, key))
            if record is None or len(record[1]) != self.rows.bytes_per_block or checksum(key, record[1]) != record[0]:
                failed.append(cpu_id)
                self._count("failed_blocks")
                continue
            self.rows.write(cpu_id, memoryview(record[1]))
            self._count("fetched_blocks")
        self.done.append((event_id, failed))

    def write(self, cpu_block_ids: Sequence[int], keys: Sequence[bytes]) -> None:
        for cpu_id, key in zip(cpu_block_ids, keys, strict=True):
            payload = self.rows.read(int(cpu_id))
            self.store.records[record_key(self.identity, self.rank, self.world_size, key)] = (checksum(key, payload), payload)
            self.written.append(key)
            self._count("written_blocks")

    def take_report(self) -> TierReport:
        report = TierReport(tier=self.name, written_keys=self.written, counters=self.counts)
        for event_id, failed in self.done:
            report.completed_fetch_events.append(event_id)
            report.failed_fetch_cpu_blocks += failed
        self.done, self.written, self.counts = [], [], {}
        return report

    @property
    def num_fetches_in_flight(self) -> int:
        return 0  # each fetch is done within submit_fetch

    def wait_idle(self, timeout: float | None = None) -> bool:
        return True

    def close(self) -> None:
        self.done = []
