"""One rank's fetch completions applied to a lower tier's fetch events (the Redis tier's fetches, the disk
tier's reads): the rule every tier that fetches into reserved CPU blocks shares (tiers/base.py).

An event completes once every rank reported it; a CPU block any rank failed is failed. A completion for an
event never issued is our bug (raises); a late one (the event already completed or failed) or a repeated
one from the same rank is logged and ignored. The event type needs `event_id`, `cpu_blocks`,
`reported_ranks` (a set) and `failed_cpu_ids` (a set). O(event blocks) per completion.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, MutableMapping
from typing import Any, TypeVar

from offload_connector.metadata import TierReport
from scheduler_side.errors import SchedulerError

E = TypeVar("E", bound=Any)


def apply_fetch_report(events: MutableMapping[int, E], next_event: int, report: TierReport, rank: int,
                       world_size: int, complete: Callable[[E], list[bytes]], what: str,
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
