"""Errors raised by the worker side.

User-facing problems (a KV tensor layout we cannot handle, a host pool that does not fit) raise a
`ValueError` subclass whose message names what is wrong and what is allowed, before anything is allocated.
Internal invariant violations (bad metadata from the scheduler, a backend reporting an unknown job) raise
`WorkerInvariantError` with the ids and counts involved: those are our bugs, never user errors.
"""

from __future__ import annotations


class LayoutError(ValueError):
    """A KV cache tensor whose block layout is unknown, ambiguous or unsupported."""


class HostPoolError(ValueError):
    """The host pool cannot be sized or allocated as configured (too small, too big for RAM)."""


class BackendError(ValueError):
    """The requested transfer backend cannot run here (e.g. `cuda` without a CUDA device)."""


class WorkerInvariantError(RuntimeError):
    """An internal invariant was violated (our bug); the message names the ids involved."""


class WorkerClosedError(RuntimeError):
    """A transfer was requested after `shutdown()` or before the KV caches were registered."""
