"""Errors of the scheduler side (imported by every module there; imports nothing from the project)."""

from __future__ import annotations


class SchedulerError(RuntimeError):
    """Misuse of the scheduler-side API (unknown request or event, an impossible transition): a caller bug;
    the call that raises it leaves the scheduler's state unchanged."""
