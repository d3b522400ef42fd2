"""`LowerTier`: what the scheduler asks of a tier below the CPU tier (a Redis server, a directory, ...).

The CPU tier (`OffloadScheduler`) holds the configured lower tiers in a list, nearest first
(offload_connector/lower_tiers.py), built by name from registry.py, and talks to them only through this
interface. A lower tier never touches the GPU: its blocks come into the CPU tier (a *fetch*, tier -> host
pool) and from there the normal CPU -> GPU load follows; it receives copies of CPU blocks (a *write*, host
pool -> tier). Every method runs on the scheduler's thread and must not block on I/O (ask
a thread of your own, as the Redis tier does, and answer "wait" meanwhile).

Per step, in this order (scheduler.py):
1. lookups (lookups.py): when a request's CPU lookup misses at block `first` (a block not being stored),
   the scheduler asks each tier in order `start(state, hashes, first, last)`: True means the request waits
   on this tier (its lookup answers None: ask again next step). A tier is asked at most once per request
   (it remembers whom it was asked about until `forget`). Every later lookup of the request first asks
   every tier `waiting(state)`; while one says True the request waits. Once the blocks are fetched and
   committed, the request's next lookup hits them on the CPU like any stored block. A tier may stop a
   request waiting at any time (a deadline, a failure): the request then computes what it did not get.
2. allocation: to fetch n blocks the tier takes CPU blocks through `TierContext.allocate_cpu` (evicting,
   fewer when the pool is pinned full), and reserves them under their keys (`BlockPool.reserve`): not
   hit-able, not evictable. The CPU pool may tell a tier of each block it evicts (`on_cpu_evict`, when
   `wants_cpu_evictions`): the block's bytes are valid until this step's copies start, its key only
   during the call (take `block.block_hash` then: the block is reused at once, reserved under another).
3. `emit(meta)`, after every CPU allocation of the step: append this step's `TierOps` to `meta.tiers`
   (nothing when idle): one fetch event (the blocks reserved in 2), the evicted blocks to write, and
   `write_stored` for this step's store event when `writes_stored()` (then `meta.store_keys` is filled by
   stores.py). Fetch event ids count from 0 per tier.
4. `on_report(report, rank)` for each rank's `TierReport` of this tier: sum its counters; a fetch event
   completes once every one of the `world_size` ranks reported it once (repeats logged and ignored; an id
   never issued raises `SchedulerError`); then its blocks that no rank failed are committed
   (`BlockPool.commit`: hit-able from now on, most recently used) and returned as keys, the others aborted
   and freed to the LRU end. `take_written()` returns the keys whose every rank's copy is in the tier now
   (KV events with `medium`): a key is *visible* in a lower tier only once every rank wrote it.

Ownership (the invariant that makes finish, preemption and reset safe at any point):
- a fetch event holds one reference on each of its CPU blocks, from its allocation until it completes on
  every rank; `held_block_ids()` names them (check_integrity), `num_events` counts the events (issued or
  about to be); no block with a fetch in flight is in a free queue, and only this tier's worker I/O writes
  it. A request that finishes stops waiting (`forget`); its fetch still completes and caches its blocks.
- a write holds nothing: each rank copies the bytes out before its tier I/O returns (worker_side/tiers/
  base.py); the scheduler may reuse the block right after.
- `fail_in_flight()` (reset_cache: the weights may have changed): nothing fetched before the call becomes
  hit-able (in-flight events complete as failed), and the tier may turn itself off for this instance.
- a failure report (a block in `failed_fetch_cpu_blocks`, on any rank) means that rank did not fill the
  block: it is forgotten everywhere, never offered as KV; the request that waited computes it.

Stats: `COUNTERS` (running totals, `counter_values()` in that order, both sides summed) and `GAUGES`
(`gauges()`), exported to vLLM as `<name>_<counter>` (every registered tier's, at 0 when it is off),
described by `DESCRIPTIONS`, and listed per configured tier in the replay report. Capacity: the tier's
budget goes into `describe(section)`, its part of the start-up line, and its occupancy and limit into its
gauges (the Redis tier: `server_used_bytes`, `server_max_bytes`). A new tier: one module implementing this (and one implementing
worker_side/tiers/base.py), a config section, and a registration under the section's name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from offload_connector.metadata import TierReport, TransferMetadata
from offload_connector.tier_identity import TierIdentity
from scheduler_side.errors import SchedulerError
from scheduler_side.pool.block import Block
from scheduler_side.pool.block_pool import BlockPool
from scheduler_side.request_state import RequestState


@dataclass(frozen=True, slots=True)
class TierContext:
    """What the scheduler lends a lower tier: the CPU pool (reserve, commit, abort and free only the blocks
    the tier allocated; `touch` then `free` cached ones to keep them through its own allocation), the one
    way to allocate CPU blocks, and the shape of the deployment."""

    identity: TierIdentity  # what the tier's keys or records must name (the adapter's)
    cpu_pool: BlockPool
    allocate_cpu: Callable[[int], list[Block]]  # up to n blocks, evicting; fewer when pinned full
    world_size: int  # tensor-parallel ranks: each reports every fetch event once
    group_id: int  # the KV-cache group whose keys the tier serves (one group only)
    # A tier that keeps the CPU pool's evictions (`keeps_cpu_evictions`) names each key it drops to make room
    # here: the store policy hears of those drops instead of the CPU's evictions (content lost, not moved).
    on_dropped: Callable[[bytes], None] = lambda key: None


class LowerTier(ABC):
    name: ClassVar[str]  # its config section, its `TierOps.tier`/`TierReport.tier`, its stats prefix
    medium: ClassVar[str]  # the KV events' medium for blocks written to it ("REMOTE", "DISK")
    COUNTERS: ClassVar[tuple[str, ...]] = ()
    GAUGES: ClassVar[tuple[str, ...]] = ()
    DESCRIPTIONS: ClassVar[Mapping[str, str]] = {}  # counter or gauge -> one line for Prometheus
    wants_cpu_evictions: bool = False  # hear of each CPU eviction (`on_cpu_evict`)

    def keeps_cpu_evictions(self) -> bool:
        """Whether every block the CPU pool evicts now stays hit-able here (a write-back tier that names each
        key it later drops to `TierContext.on_dropped`). Then a CPU eviction loses nothing, and the store
        policy hears of this tier's drops instead (lazy.py: pressure is a miss on content lost recently)."""
        return False

    @classmethod
    @abstractmethod
    def create(cls, section: Any, context: TierContext) -> LowerTier:
        """The tier for its config section; connects to nothing yet (no I/O before the first lookup)."""

    @staticmethod
    @abstractmethod
    def describe(section: Any) -> str:
        """The tier's part of the start-up line (no secrets), e.g. "remote tier redis://host:6379/0"."""

    # ---- 1. lookups --------------------------------------------------------------------------------
    @abstractmethod
    def start(self, state: RequestState, hashes: Sequence[bytes], first: int, last: int) -> bool:
        """The request's CPU lookup missed at block `first` (blocks `first`..`last`-1 may follow): True if it
        now waits on this tier. False when the tier was asked about the request before, has nothing, or
        declines (busy, broken, off)."""

    @abstractmethod
    def waiting(self, state: RequestState) -> bool:
        """Does the request still wait on this tier? May allocate and reserve CPU blocks for a fetch."""

    @abstractmethod
    def forget(self, state: RequestState) -> None:
        """The request finished: it waits no more and is forgotten (its fetch, if any, still completes)."""

    # ---- 2.-3. the step ----------------------------------------------------------------------------
    def on_cpu_evict(self, block: Block) -> None:
        """The CPU pool evicts `block`: its hash is still set now (keep it: the block is reused at once), its
        bytes valid until this step's copies start. Called only when `wants_cpu_evictions`."""
        raise SchedulerError(f"the {self.name} tier wants CPU evictions but does not take them (our bug)")

    def writes_stored(self) -> bool:
        """Should this step's stored blocks be written to the tier once stored (write-through)?"""
        return False

    @abstractmethod
    def emit(self, meta: TransferMetadata) -> None:
        """Append this step's `TierOps` to `meta.tiers`, if any; call once per step after every allocation."""

    # ---- 4. reports --------------------------------------------------------------------------------
    @abstractmethod
    def on_report(self, report: TierReport, rank: int) -> list[bytes]:
        """Apply one rank's report; returns the keys that became hit-able on the CPU tier."""

    @abstractmethod
    def take_written(self) -> list[bytes]:
        """Keys every rank's copy of reached the tier since the last call (KV events, `medium`)."""

    # ---- lifecycle and introspection ---------------------------------------------------------------
    @abstractmethod
    def fail_in_flight(self) -> None:
        """reset_cache: nothing fetched before now becomes hit-able."""

    @abstractmethod
    def held_block_ids(self) -> set[int]:
        """CPU blocks the tier's fetch events hold a reference on (O(blocks in flight))."""

    @property
    @abstractmethod
    def num_events(self) -> int:
        """Fetch events issued or about to be, not complete: the engine keeps stepping while > 0."""

    @property
    def num_waiting(self) -> int:
        """Requests waiting on the tier now."""
        return 0

    def counter_values(self) -> tuple[int, ...]:
        """Running totals in `COUNTERS` order (the scheduler's and the workers' summed)."""
        return (0,) * len(self.COUNTERS)

    def gauges(self) -> dict[str, float]:
        """Current values of `GAUGES` (names without the tier prefix)."""
        return {}

    @abstractmethod
    def close(self) -> None:
        """Stop the tier's threads and connections (nothing else to release)."""
