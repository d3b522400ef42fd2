"""The scheduler side: decides which blocks move between the engine's GPU pool and our CPU tier.

Imports no torch. Public API: `OffloadScheduler`, `BlockPool`, the interfaces it needs from an engine.
"""

from scheduler_side.errors import SchedulerError
from scheduler_side.interfaces import BlockPoolGpuView, GpuPool, RequestLike, StepRequest
from scheduler_side.kv_events import KVEvent
from scheduler_side.pool.block_pool import BlockPool, PoolError
from scheduler_side.scheduler import OffloadScheduler

__all__ = [
    "BlockPool", "BlockPoolGpuView", "GpuPool", "KVEvent", "OffloadScheduler", "PoolError",
    "RequestLike", "SchedulerError", "StepRequest",
]
