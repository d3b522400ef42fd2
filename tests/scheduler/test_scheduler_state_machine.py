"""Property test: random admissions (some in client sessions), steps, completions (in any order, some
failing), aborts, preemptions and session closes against the scheduler side. After every rule: pools are
consistent, no block with a transfer in flight is free, and when everything is drained all references are
back to zero. On every CPU allocation: no cached block is evicted while an empty block is free (a copy
given up after a load or a session close goes before older content, never ahead of free room)."""

from hypothesis import HealthCheck, settings
from scheduler_machine import SchedulerMachine

SchedulerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestSchedulerMachine = SchedulerMachine.TestCase
