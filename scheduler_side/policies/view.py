"""`SchedulerStorePolicyView`: the scheduler's implementation of `StorePolicyView` (store_policy.py), the
read-only window a store policy has on the scheduler.

It reads the CPU pool (cached and reserved keys, free blocks), the engine's GPU pool (free
blocks, eviction frontier), the outstanding store events and the admission filter (`is_dead`); it changes nothing and holds no state of
its own. The scheduler builds one and hands it to its policy, which never sees the scheduler itself.
"""

from __future__ import annotations

from collections.abc import Mapping

from scheduler_side.admission.filter import AdmissionFilter
from scheduler_side.interfaces import GpuPool
from scheduler_side.pool.block_pool import BlockPool


class SchedulerStorePolicyView:
    def __init__(self, cpu_pool: BlockPool, gpu_pool: GpuPool, store_events: Mapping[int, object], block_size: int,
                 group_id: int, max_blocks_per_step: int | None, lazy_lookahead_blocks: int | None,
                 admission: AdmissionFilter, num_gpu_blocks: int | None = None) -> None:
        self._cpu, self._gpu, self._store_events = cpu_pool, gpu_pool, store_events
        self.is_dead, self._admission = admission.is_dead, admission
        self._cached, self._reserved = cpu_pool.cached, cpu_pool.reserved
        self.block_size, self.group_id = block_size, group_id
        self.max_blocks_per_step, self.lazy_lookahead_blocks = max_blocks_per_step, lazy_lookahead_blocks
        self.num_gpu_blocks = num_gpu_blocks or cpu_pool.num_blocks
        # the GPU pool's own methods (per block read or placed: no call of ours in between)
        self.gpu_frontier = gpu_pool.frontier
        self.gpu_is_free = gpu_pool.is_free
        self.gpu_cached_block = gpu_pool.cached_block

    def is_saved(self, key: bytes) -> bool:
        return key in self._cached or key in self._reserved

    def may_have_dead(self) -> bool:
        return self._admission.active

    def saved_key_maps(self) -> tuple[Mapping[bytes, object], Mapping[bytes, object]]:
        return self._cached, self._reserved

    def is_store_outstanding(self, event_id: int) -> bool:
        return event_id in self._store_events

    def cpu_num_free_blocks(self) -> int:
        return self._cpu.num_free_blocks

    def gpu_num_free_blocks(self) -> int:
        return self._gpu.num_free_blocks()

