"""`Transfers`: the ledger the scheduler's parts share: every request it tracks and every transfer between
the GPU pool and the CPU tier that is queued or in flight.

It holds state and answers questions about it; the parts change it, each as its docstring says:
- `requests` (request id -> `RequestState`): created by a lookup or an allocation (lookups.py,
  allocations.py), deleted by the scheduler's `request_finished` or, for a request that finished while
  loading, by its load's completion (completions.py);
- `loads_to_send`: requests whose load job was created at allocation and not yet handed to the workers
  (allocations.py appends and empties it in `send_loads`);
- `store_events`: issued store events not yet reported by every rank (stores.py issues them through
  `issue_store_event`, completions.py deletes them);
- `expired`: load events a rank gave up on whose copy may still run (completions.py).
Event ids count up from 0 per kind and are never reused. Queries are O(requests + transfers in flight):
between steps, for the engine's idle checks and tests. `store_read_overlaps` checks the one invariant that
ties stores to loads (the scheduler's docstring states it): no CPU block a store in flight writes is read by
a load in flight or held by a pending hit, unless the only load reading it lent it to that store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduler_side.errors import SchedulerError
from scheduler_side.request_state import LoadJob, Phase, RequestState, StoreEvent

if TYPE_CHECKING:
    from scheduler_side.pool.block import Block


@dataclass(slots=True)
class ExpiredLoad:
    """A load event some rank gave up on while its copy may still run."""

    ranks: set[int]  # ranks that gave up on it and have not yet reported its copy over
    jobs: list[LoadJob]  # its completed jobs: their GPU (ours) and CPU references, held until `ranks` empties


class Transfers:
    __slots__ = ("requests", "loads_to_send", "store_events", "expired", "next_load_event", "next_store_event")

    def __init__(self) -> None:
        self.requests: dict[str, RequestState] = {}
        self.loads_to_send: list[RequestState] = []  # load jobs created since the last metadata
        self.store_events: dict[int, StoreEvent] = {}
        self.expired: dict[int, ExpiredLoad] = {}  # load event id -> its quarantine (its copy may still run)
        self.next_load_event = 0
        self.next_store_event = 0

    def issue_load_event(self) -> int:
        """The id of a new load event."""
        event_id, self.next_load_event = self.next_load_event, self.next_load_event + 1
        return event_id

    def issue_store_event(self, gpu_block_ids: list[int], cpu_blocks: list[Block]) -> StoreEvent:
        """A new store event, outstanding until completions.py deletes it."""
        event = StoreEvent(self.next_store_event, gpu_block_ids, cpu_blocks)
        self.next_store_event += 1
        self.store_events[event.event_id] = event
        return event

    def num_in_flight(self) -> int:
        """Store events, load jobs and quarantined load events outstanding."""
        return (len(self.store_events) + sum(1 for s in self.requests.values() if s.load is not None)
                + len(self.expired))

    def is_quiet(self) -> bool:
        """Nothing queued or in flight, and no request holds a pending hit or a load."""
        if self.store_events or self.loads_to_send or self.expired:
            return False
        return all(s.load is None and s.pending_hit is None for s in self.requests.values())

    @property
    def num_blocks_in_quarantine(self) -> int:
        """GPU blocks (and as many CPU blocks) kept out of use now for copies that may still run."""
        return sum(job.num_blocks for e in self.expired.values() for job in e.jobs)

    def gpu_blocks_being_stored(self) -> set[int]:
        """GPU blocks an outstanding store event copies from."""
        return {i for event in self.store_events.values() for i in event.gpu_block_ids}

    def held_cpu_block_ids(self) -> set[int]:
        """CPU blocks some transfer or pending hit references; raises `SchedulerError` on a request whose
        phase contradicts what it holds (a pending hit exactly in PENDING_HIT, a load exactly in LOADING or
        FINISHED)."""
        held = {b.block_id for e in self.store_events.values() for b in e.cpu_blocks}
        held.update(b.block_id for e in self.expired.values() for job in e.jobs for b in job.cpu_blocks)
        for s in self.requests.values():
            if (s.pending_hit is not None) != (s.phase is Phase.PENDING_HIT) or (s.load is not None) != (
                    s.phase in (Phase.LOADING, Phase.FINISHED)):
                raise SchedulerError(f"request {s.request_id} is {s.phase.value} with pending hit "
                                     f"{s.pending_hit is not None} and load {s.load is not None} (our bug)")
            if s.load is not None:
                held.update(b.block_id for b in s.load.cpu_blocks)
            if s.pending_hit is not None:
                held.update(b.block_id for b in s.pending_hit.cpu_blocks)
        return held

    def store_read_overlaps(self) -> list[str]:
        """Every breach of the store/read invariant (empty: none): a CPU block an outstanding store event
        writes that a pending hit holds, or that a load in flight reads (a request's, or one quarantined after
        its deadline) other than the one load that lent its slot to that store (`LoadJob.lent`: the workers
        run the store after that load), or that more than one load reads. O(blocks of the transfers in
        flight)."""
        written = {b.block_id: e.event_id for e in self.store_events.values() for b in e.cpu_blocks}
        if not written:
            return []
        readers: dict[int, list[str]] = {}  # written block -> who else reads or holds it
        lent_by: dict[int, int] = {}  # written block -> readers that lent it
        jobs = [(f"request {s.request_id}'s load", s.load) for s in self.requests.values() if s.load is not None]
        jobs += [(f"expired load event {event_id}", job) for event_id, e in self.expired.items() for job in e.jobs]
        for who, job in jobs:
            for block in job.cpu_blocks:
                if block.block_id in written:
                    readers.setdefault(block.block_id, []).append(who)
                    lent_by[block.block_id] = lent_by.get(block.block_id, 0) + (block.block_id in job.lent)
        for s in self.requests.values():
            if s.pending_hit is not None:
                for block in s.pending_hit.cpu_blocks:
                    if block.block_id in written:
                        readers.setdefault(block.block_id, []).append(f"request {s.request_id}'s pending hit")
        return [f"CPU block {block_id} is written by store event {written[block_id]} while read by {', '.join(who)} "
                f"({lent_by.get(block_id, 0)} of them lent it)" for block_id, who in readers.items()
                if len(who) != 1 or lent_by.get(block_id, 0) != 1]
