"""When a lookup asks the engine to ask again next step rather than take a shorter hit (lookups.py and
hybrid.py, one group or several).

Both rules wait for something already under way that makes the hit whole next step, and both are bounded
by `max_store_wait_steps` lookups per request, so nothing can hold a request back for good. Each mutates
only the request's wait counter and phase (NEW while it waits) and the `SchedulerStats` counters named.
"""

from __future__ import annotations

from scheduler_side.request_state import Phase, RequestState
from scheduler_side.stats import SchedulerStats


def asks_again_for_store(state: RequestState, max_waits: int, stats: SchedulerStats) -> bool:
    """A block of the hit is being stored: its store completes soon, so the request asks again next step
    (True), at most `max_waits` times; after that the hit ends there (False, `num_store_wait_timeouts`)."""
    if state.num_store_waits < max_waits:
        state.num_store_waits += 1
        state.move_to(Phase.NEW)
        return True
    stats.num_store_wait_timeouts += 1
    return False


def asks_again_for_load(state: RequestState, max_waits: int, stats: SchedulerStats) -> bool:
    """The hit's first block is held: another request's load reads it (or will, this step: a pending hit).
    Once that load is done the engine's GPU prefix cache has it, so ask again next step (True,
    `num_load_waits`) rather than load the same blocks twice; at most `max_waits` times per request."""
    if state.num_load_waits < max_waits:
        state.num_load_waits += 1
        state.move_to(Phase.NEW)
        stats.num_load_waits += 1
        return True
    return False
