"""Running counters of the scheduler side. Plain ints, updated in O(1) where events happen.

Reset never: callers take differences (`snapshot()` then subtract) for per-interval figures.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from operator import attrgetter


@dataclass(slots=True)
class SchedulerStats:
    num_lookups: int = 0
    num_deferred_lookups: int = 0  # lazy: lookups answered "retry next step" so unsaved blocks are saved
    num_lookup_tokens: int = 0  # tokens looked up (after the GPU hit)
    num_hit_tokens: int = 0  # tokens the engine accepted to load from the CPU tier
    num_loaded_blocks: int = 0
    num_stored_blocks: int = 0
    num_reused_load_slots: int = 0  # stores written into the slots of blocks this step's load read
    num_store_skipped_blocks: int = 0  # wanted a store but the CPU pool was pinned full
    num_failed_store_blocks: int = 0
    num_failed_load_blocks: int = 0
    num_load_timeouts: int = 0  # load events a rank gave up on after transfer.load_timeout_s (recomputed)
    num_quarantined_blocks: int = 0  # blocks of expired loads kept out of use until their copy ended
    num_load_waits: int = 0  # lookups that waited a step for another request's load of their first CPU block
    num_store_wait_timeouts: int = 0  # lookups that stopped waiting for a block's store (max_store_wait_steps)
    num_cpu_evictions: int = 0
    num_dropped_blocks: int = 0  # CPU copies dropped because the admission filter killed their key
    num_demoted_blocks: int = 0  # CPU copies moved to the eviction end by a session close
    num_closed_sessions: int = 0
    num_bad_hints: int = 0  # requests whose kv_transfer_params hints were malformed (ignored)
    num_staged_jobs: int = 0  # copy jobs (all ranks) by the CUDA backend's staged path
    num_dma_jobs: int = 0  # by DMA straight between the KV cache and the host pool (batched, per segment, pageable)
    num_kernel_jobs: int = 0  # by the direct block-copy kernel
    bytes_stored: int = 0
    bytes_loaded: int = 0
    store_seconds: float = 0.0
    load_seconds: float = 0.0

    def values(self) -> tuple[float, ...]:
        """All counters in `FIELDS` order (one C-level call: cheap enough to compare every step)."""
        return _get_all(self)

    def snapshot(self) -> dict[str, float]:
        return dict(zip(FIELDS, _get_all(self), strict=True))


FIELDS: tuple[str, ...] = tuple(f.name for f in fields(SchedulerStats))
_get_all = attrgetter(*FIELDS)
