"""Property test: random admissions (some in client sessions), steps, completions (in any order, some
failing), aborts, preemptions and session closes against the scheduler side, and two requests loading the
same CPU blocks across steps, with the load wait on or off and lazy's CPU pressure from the start or not.
After every rule: pools are consistent, no block with a transfer in flight is free, no store writes a CPU
block a load in flight reads, and when everything is drained all references are back to zero. On every CPU
allocation: no cached block is evicted while an empty block is free (a copy given up after a load or a
session close goes before older content, never ahead of free room)."""

from hypothesis import HealthCheck, settings
from scheduler_machine import SchedulerMachine

SchedulerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestSchedulerMachine = SchedulerMachine.TestCase
