"""`RemoteTier`: the Redis tier behind the lower-tier interface (tiers/base.py): which requests wait on it,
and the fetches it brings in.

Flow for one request (at most once per request; `_waits` holds its `RemoteWait` until `forget`):
1. its CPU lookup misses at block i (not being stored): `start` asks the lookup thread which of blocks
   i.. exist on the server (every part's key: remote/format.py `BlockParts`) and the lookup answers None
   (ask again next step). Refused, so the request goes on without the tier, when `max_waiting_requests`
   requests already wait or the breaker is open.
2. later lookups call `waiting`: while no answer, wait (until `timeout_ms` since step 1: then no remote
   hit). An answer of n > 0 blocks allocates CPU blocks (evicting LRU ones), reserves them under the
   blocks' keys (as a store does: not hit-able yet) and adds them to this step's fetch event; the request
   waits for that fetch (same deadline).
3. every rank reports the fetch event (`on_report`): blocks no rank failed are committed (hit-able, MRU),
   failed ones aborted (LRU head). The request's next lookup then hits them on the CPU like any block and
   the normal CPU -> GPU load follows.
A finished request stops waiting (`forget`); its fetch, if any, still completes and caches its blocks.
Holds: one reference on each CPU block of an outstanding fetch event, released at its completion.
Per step O(1) per waiting request plus O(blocks) when a fetch is issued or completes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from offload_connector.hashing import with_group_id
from offload_connector.metadata import TierOps, TierReport, TransferMetadata
from offload_connector.remote.breaker import RemoteCounters
from offload_connector.remote.config import RemoteConfig, redact, remote_urls
from offload_connector.remote.format import BlockParts, key_prefix
from scheduler_side.pool.block_pool import BlockPool
from scheduler_side.pool.free_queue import Block
from scheduler_side.request_state import RequestState
from scheduler_side.tiers.base import LowerTier, TierContext
from scheduler_side.tiers.fetch_reports import FetchEvent, apply_fetch_report, settle_fetch
from scheduler_side.tiers.remote.lookups import RemoteLookups
from scheduler_side.tiers.remote.stats import DESCRIPTIONS, GAUGES, REMOTE_COUNTERS

logger = logging.getLogger("scheduler_side.scheduler")


@dataclass(slots=True)
class RemoteWait:
    """A request's one look at the remote tier: it waits (lookups answer None) while `ticket` (the
    existence check) or `fetch_event` (the fetch it caused) is outstanding, until `deadline`."""

    first_block: int  # the request's block index the remote run starts at (its first CPU miss)
    deadline: float  # time.monotonic() after which the request stops waiting
    ticket: int | None  # the existence check in flight, None once answered
    fetch_event: int | None = None  # the fetch event bringing the run into the CPU tier
    done: bool = False  # no longer waiting (answered, fetched, or timed out); never asks again


class RemoteTier(LowerTier):
    name, medium = "remote", "REMOTE"
    COUNTERS, GAUGES, DESCRIPTIONS = REMOTE_COUNTERS, GAUGES, DESCRIPTIONS

    def __init__(self, remote: RemoteConfig, lookups: RemoteLookups, cpu_pool: BlockPool,
                 allocate_cpu: Callable[[int], list[Block]], world_size: int, group_id: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.remote, self.lookups, self.cpu_pool = remote, lookups, cpu_pool
        self.counters: RemoteCounters = lookups.client.counters
        self._allocate_cpu, self.world_size, self.group_id = allocate_cpu, world_size, group_id
        self.clock = clock  # time.monotonic; tests pass their own
        self._waits: dict[str, RemoteWait] = {}  # every live request asked about (done or not), until forget
        self._waiting: set[str] = set()  # requests with a RemoteWait not done
        self._events: dict[int, FetchEvent] = {}  # issued, not complete
        self._to_send: FetchEvent | None = None  # this step's fetches, sent by the next metadata
        self._next_event = 0
        self._evicted: list[Block] = []  # on_cpu_evict: blocks evicted since the last metadata (hash set)
        self._evicted_keys: list[bytes] = []
        self.enabled = True  # False after reset_cache: the weights may have changed, the server's KV not
        self.worker_counters: dict[str, int] = {}  # the workers' remote counters, summed over ranks
        # Keys some ranks have reported on the server (insertion-ordered, oldest dropped past the bound: a
        # rank's write may be dropped, and its key must not wait here forever); keys every rank reported.
        self._on_server_ranks: dict[bytes, set[int]] = {}
        self._max_on_server_pending = 4 * cpu_pool.num_blocks
        self._on_server: list[bytes] = []

    @classmethod
    def create(cls, section: RemoteConfig, context: TierContext) -> RemoteTier:
        """The tier with its lookup thread and client (connects on first use, never here). With
        `write: on_cpu_evict`, it hears of the CPU pool's evictions."""
        from offload_connector.remote.client import RemoteClient

        lookups = RemoteLookups(RemoteClient(section), key_prefix(context.identity, section.namespace),
                                BlockParts.of(context.identity, 0, context.world_size).labels)
        tier = cls(section, lookups, context.cpu_pool, context.allocate_cpu, context.world_size, context.group_id)
        tier.wants_cpu_evictions = section.write == "on_cpu_evict"
        return tier

    @staticmethod
    def describe(section: RemoteConfig) -> str:
        signed = ", records signed (remote.auth_key_file)" if section.auth_key_file else ""
        return f"remote tier {', '.join(map(redact, remote_urls(section)))}{signed}"

    def counter_values(self) -> tuple[int, ...]:
        """Both sides' counters summed, in `REMOTE_COUNTERS` order (for stats)."""
        mine, theirs = self.counters.snapshot(), self.worker_counters
        return tuple(mine.get(k, 0) + theirs.get(k, 0) for k in REMOTE_COUNTERS)

    def gauges(self) -> dict[str, float]:
        used, limit = self.lookups.server_memory
        return {"breaker_open": int(self.lookups.client.breaker.state == "open"),
                "waiting_requests": len(self._waiting), "server_used_bytes": used, "server_max_bytes": limit}

    # ---- lookups -------------------------------------------------------------------------------------
    def start(self, state: RequestState, hashes: Sequence[bytes], first: int, last: int) -> bool:
        """The request missed on the CPU at block `first`: ask the server about blocks first..last-1.
        True: the request waits (its lookup answers None)."""
        if state.request_id in self._waits or first >= last or not self.enabled:
            return False
        if len(self._waiting) >= self.remote.max_waiting_requests or self.lookups.client.breaker.state == "open":
            self.counters.lookups_skipped += 1
            return False
        n = min(last - first, self.remote.max_lookup_blocks)
        ticket = self.lookups.submit(hashes[first:first + n], self.group_id)
        self._waits[state.request_id] = RemoteWait(first, self.clock() + self.remote.timeout_ms / 1000, ticket)
        self._waiting.add(state.request_id)
        return True

    def waiting(self, state: RequestState) -> bool:
        """Is the request still waiting on the tier? Issues its fetch when the lookup's answer is there."""
        wait = self._waits.get(state.request_id)
        if wait is None or wait.done:
            return False
        if wait.ticket is not None:
            found = self.lookups.take(wait.ticket)
            if found is None:
                return self._still_waiting(state, wait)
            wait.ticket = None
            if found == 0 or not self._issue_fetch(state, wait, found):
                return self._stop(state, wait)
            return True
        if wait.fetch_event in self._events or (self._to_send is not None
                                                and wait.fetch_event == self._to_send.event_id):
            return self._still_waiting(state, wait)
        return self._stop(state, wait)

    def _still_waiting(self, state: RequestState, wait: RemoteWait) -> bool:
        if self.clock() < wait.deadline:
            return True
        self.counters.lookup_timeouts += 1
        if wait.ticket is not None:
            self.lookups.cancel(wait.ticket)
            wait.ticket = None
        return self._stop(state, wait)

    def _stop(self, state: RequestState, wait: RemoteWait) -> bool:
        wait.done = True
        self._waiting.discard(state.request_id)
        return False

    def _issue_fetch(self, state: RequestState, wait: RemoteWait, found: int) -> bool:
        """Reserve CPU blocks for the first `found` blocks from `wait.first_block` (stopping at one the CPU
        has or is receiving) and add them to this step's fetch event. False: nothing to fetch."""
        hashes, pool, group = state.request.block_hashes, self.cpu_pool, self.group_id
        keys = []
        for h in hashes[wait.first_block:wait.first_block + found]:
            key = with_group_id(h, group)
            if key in pool.cached or key in pool.reserved:
                break
            keys.append(key)
        # the request's own CPU hits before the run stay pinned while the run's blocks are allocated
        own = [b for b in (pool.cached.get(with_group_id(h, group)) for h in hashes[:wait.first_block]) if b]
        pool.touch(own)
        blocks = self._allocate_cpu(len(keys)) if keys else []
        pool.free(own)
        if not blocks:
            return False
        keys = keys[:len(blocks)]
        pool.reserve(blocks, keys)
        event = self._to_send
        if event is None:
            event = self._to_send = FetchEvent(self._next_event)
            self._next_event += 1
        event.cpu_blocks.extend(blocks)
        event.keys.extend(keys)
        wait.fetch_event = event.event_id
        return True

    def forget(self, state: RequestState) -> None:
        """The request finished: it waits no more (an answer still coming is dropped), and is forgotten."""
        wait = self._waits.pop(state.request_id, None)
        if wait is not None and not wait.done:
            if wait.ticket is not None:
                self.lookups.cancel(wait.ticket)
            self._stop(state, wait)

    # ---- fetch events --------------------------------------------------------------------------------
    def writes_stored(self) -> bool:
        return self.enabled and self.remote.write == "on_store"

    def on_cpu_evict(self, block: Block) -> None:
        """`write: on_cpu_evict`: the CPU pool evicts `block` (its content still there until this step's
        copies start): have the workers write it first."""
        if self.enabled:
            self._evicted.append(block)
            self._evicted_keys.append(block.block_hash)

    def emit(self, meta: TransferMetadata) -> None:
        """This step's fetch event and evicted blocks to write, and whether to write its stored blocks;
        call after every allocation of the step."""
        stored = bool(meta.store_keys) and self.writes_stored()
        event = self._to_send
        if event is None and not self._evicted and not stored:
            return
        ops = TierOps(tier=self.name, write_stored=stored)
        if self._evicted:
            ops.write_cpu_blocks = [b.block_id for b in self._evicted]
            ops.write_keys = self._evicted_keys
            self._evicted, self._evicted_keys = [], []
        if event is not None:
            self._to_send = None
            self._events[event.event_id] = event
            ops.fetch_event = event.event_id
            ops.fetch_cpu_blocks = [b.block_id for b in event.cpu_blocks]
            ops.fetch_keys = list(event.keys)
        meta.tiers.append(ops)

    def on_report(self, report: TierReport, rank: int) -> list[bytes]:
        """Apply one rank's fetch completions and counters; returns the keys that became hit-able on the CPU tier."""
        for name, delta in report.counters.items():
            self.worker_counters[name] = self.worker_counters.get(name, 0) + delta
        if report.written_keys:
            self._note_on_server(report.written_keys, rank)
        return apply_fetch_report(self._events, self._next_event, report, rank, self.world_size, self._complete,
                                  "fetch event", logger)

    def _note_on_server(self, keys: Sequence[bytes], rank: int) -> None:
        """These blocks' copies from `rank` are on the server: a block is there once every rank's is."""
        if self.world_size == 1:
            self._on_server.extend(keys)
            return
        pending = self._on_server_ranks
        for key in keys:
            ranks = pending.get(key)
            if ranks is None:
                ranks = pending[key] = set()
                if len(pending) > self._max_on_server_pending:
                    del pending[next(iter(pending))]
            ranks.add(rank)
            if len(ranks) == self.world_size:
                del pending[key]
                self._on_server.append(key)

    def take_written(self) -> list[bytes]:
        """Cache keys whose every rank's copy reached the server since the last call (KV events, medium
        REMOTE). The server evicts without telling anyone, so no removal ever follows."""
        keys, self._on_server = self._on_server, []
        return keys

    def _complete(self, event: FetchEvent) -> list[bytes]:
        del self._events[event.event_id]
        return settle_fetch(self.cpu_pool, event)

    def fail_in_flight(self) -> None:
        """reset_cache: nothing fetched before now becomes hit-able, and the tier is off from now on for
        this instance (neither asked nor written): vLLM resets the cache when the weights change, and the
        server keeps KV of the old ones under the same keys. Other instances are not affected."""
        if self.enabled:
            logger.warning("remote tier turned off for this instance after a cache reset (weights may have "
                           "changed); change remote.namespace on every instance to share again")
        self.enabled = False
        for event in self._events.values():
            event.failed = True
        if self._to_send is not None:
            self._to_send.failed = True

    # ---- introspection -------------------------------------------------------------------------------
    def held_block_ids(self) -> set[int]:
        events = list(self._events.values()) + ([self._to_send] if self._to_send is not None else [])
        return {b.block_id for e in events for b in e.cpu_blocks}

    @property
    def num_events(self) -> int:
        return len(self._events) + (self._to_send is not None)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def close(self) -> None:
        self.lookups.close()
