"""One rank's fetch completions applied to a lower tier's fetch events (the Redis tier's fetches, the disk
tier's reads): the rule every tier that fetches into reserved CPU blocks shares (tiers/base.py).

An event completes once every rank reported it; a CPU block any rank failed is failed. A completion for an
event never issued is our bug (raises); a late one (the event already completed or failed) or a repeated
one from the same rank is logged and ignored. A completed event settles its CPU blocks (`settle_fetch`): the
good ones are committed, the failed ones aborted. O(event blocks) per completion.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field

from offload_connector.metadata import TierReport
from scheduler_side.errors import SchedulerError
from scheduler_side.pool.block_pool import BlockPool
from scheduler_side.pool.free_queue import Block


@dataclass(slots=True)
class FetchEvent:
    """One step's fetches. Holds one reference on each CPU block; their keys are reservations until done."""

    event_id: int
    cpu_blocks: list[Block] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)
    reported_ranks: set[int] = field(default_factory=set)
    failed_cpu_ids: set[int] = field(default_factory=set)  # failed on any rank
    failed: bool = False  # every block fails (reset_cache)


def settle_fetch(pool: BlockPool, event: FetchEvent) -> list[bytes]:
    """Every rank reported `event`: its failed blocks' reservations are aborted (the blocks go to the head of
    the free queue), the others committed; the event's references are dropped. Returns the keys now hit-able."""
    bad = [b for b in event.cpu_blocks if event.failed or b.block_id in event.failed_cpu_ids]
    good = [b for b in event.cpu_blocks if not (event.failed or b.block_id in event.failed_cpu_ids)]
    pool.abort(bad)
    pool.free(bad, front=True)
    keys = pool.commit(good)
    pool.free(good)
    return keys


def apply_fetch_report(events: MutableMapping[int, FetchEvent], next_event: int, report: TierReport, rank: int,
                       world_size: int, complete: Callable[[FetchEvent], list[bytes]], what: str,
                       logger: logging.Logger) -> list[bytes]:
    """Apply `report`'s completed fetch events from `rank`; `complete(event)` runs once every rank reported
    the event and returns the keys that became hit-able on the CPU tier. `what` names the events in errors
    and warnings ("fetch event", "disk read event")."""
    committed: list[bytes] = []
    failed = set(report.failed_fetch_cpu_blocks)
    for event_id in report.completed_fetch_events:
        event = events.get(event_id)
        if event is None:
            if not 0 <= event_id < next_event:
                raise SchedulerError(f"completion for {what} {event_id}, which was never issued")
            logger.warning("ignoring a late completion of %s %d", what, event_id)
            continue
        if rank in event.reported_ranks:
            logger.warning("ignoring a repeated completion of %s %d from rank %d", what, event_id, rank)
            continue
        event.reported_ranks.add(rank)
        event.failed_cpu_ids.update(b.block_id for b in event.cpu_blocks if b.block_id in failed)
        if len(event.reported_ranks) == world_size:
            committed += complete(event)
    return committed
