"""A circuit breaker with exponential backoff, and the remote tier's counters (no I/O, no project imports).

Breaker states: CLOSED (calls go through) -> a connection failure -> OPEN (calls are refused for the
backoff: `allow()` is False) -> backoff elapsed -> HALF_OPEN (one trial call allowed) -> its success
closes the breaker and resets the backoff; its failure opens it again with the backoff doubled, up to
`max_backoff_s`. So a server that is down costs one timeout per backoff period, and a server that comes
back is used again without anyone acting. Thread-safe (one lock; every method is O(1)).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
BREAKER_STATES = (CLOSED, OPEN, HALF_OPEN)


class CircuitBreaker:
    def __init__(self, backoff_s: float, max_backoff_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < backoff_s <= max_backoff_s:
            raise ValueError(f"backoff {backoff_s} s and max {max_backoff_s} s: need 0 < backoff <= max")
        self._initial, self._max, self._clock = backoff_s, max_backoff_s, clock
        self._lock = threading.Lock()
        self._state = CLOSED
        self._backoff = backoff_s
        self._open_until = 0.0
        self._trial_out = False  # HALF_OPEN: the one trial call has been handed out
        self.num_trips = 0  # CLOSED or HALF_OPEN -> OPEN
        self.num_refused = 0  # calls refused while open

    @property
    def state(self) -> str:
        with self._lock:
            self._advance()
            return self._state

    def _advance(self) -> None:
        if self._state == OPEN and self._clock() >= self._open_until:
            self._state, self._trial_out = HALF_OPEN, False

    def allow(self) -> bool:
        """May a call go to the server now? In HALF_OPEN, only the first caller gets True."""
        with self._lock:
            self._advance()
            if self._state == CLOSED:
                return True
            if self._state == HALF_OPEN and not self._trial_out:
                self._trial_out = True
                return True
            self.num_refused += 1
            return False

    def on_success(self) -> None:
        """A call succeeded: closes the breaker, unless it is open (a call started before it opened, as
        `on_failure` ignores such failures: one write that still fit on a full disk must not reopen it)."""
        with self._lock:
            self._advance()
            if self._state == OPEN:
                return
            self._state, self._backoff, self._trial_out = CLOSED, self._initial, False

    def on_failure(self) -> bool:
        """A connection-level failure (refused, reset, timed out, authentication): open for the backoff.
        True when this call opened it (one caller among threads failing together)."""
        with self._lock:
            if self._state == OPEN:
                return False  # a call started before the breaker opened: the backoff already runs
            if self._state == HALF_OPEN:
                self._backoff = min(self._backoff * 2, self._max)
            self._state, self._trial_out = OPEN, False
            self._open_until = self._clock() + self._backoff
            self.num_trips += 1
            return True


@dataclass(slots=True)
class RemoteCounters:
    """What the remote tier did, one instance per client (scheduler: lookups; worker: fetches, writes)."""

    lookups: int = 0  # pipelined existence checks sent
    lookup_blocks: int = 0  # blocks asked about
    lookup_hit_blocks: int = 0  # blocks found (every part of it present), before the first miss
    lookup_timeouts: int = 0  # requests that stopped waiting after timeout_ms
    lookups_skipped: int = 0  # CPU misses not asked about: breaker open or too many requests waiting
    fetched_blocks: int = 0  # blocks fetched into the host pool and verified
    fetched_bytes: int = 0
    fetch_miss_blocks: int = 0  # asked for, gone (expired or evicted since the lookup)
    corrupt_blocks: int = 0  # refused by the header check (checksum, length): deleted, a miss
    written_blocks: int = 0  # SET NX accepted (a key already present counts in write_exists)
    write_exists: int = 0
    written_bytes: int = 0
    dropped_writes: int = 0  # blocks not written: the queue was full or the breaker open
    errors: int = 0  # commands that failed (connection, timeout, server error such as OOM)

    def snapshot(self) -> dict[str, int]:
        return asdict(self)
