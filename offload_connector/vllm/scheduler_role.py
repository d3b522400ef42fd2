"""`SchedulerRole`: the bodies of `OffloadConnector`'s scheduler hooks, over one `OffloadScheduler`.

Exists only in the scheduler process (`KVConnectorRole.SCHEDULER`); `OffloadConnector` creates it and
forwards each scheduler hook here. It owns
- `scheduler`, the `OffloadScheduler` (CPU pool, per-request transfer state, stats),
- the `VllmGpuPool` view through which that scheduler borrows vLLM's GPU `BlockPool`; it is empty until
  vLLM calls `bind_gpu_block_pool`, which vLLM does before the first `get_num_new_matched_tokens`,
- the `StatsTracker` that turns the scheduler's running counters into deltas for vLLM (every 16 steps,
  and on every step without a live request, so a burst's last figures are not held back); its first
  report comes from one step the role asks vLLM for at start-up (`has_pending_push_work`), before any
  request, so the capacity gauges are exported from the first scrape, and
- whether vLLM asked for KV-cache events.
Everything here runs on vLLM's scheduler thread, one hook at a time; nothing touches a KV tensor. The
translation is from vLLM's types (`Request`, `KVCacheBlocks`, `SchedulerOutput`, `KVConnectorOutput`) to
the scheduler side's (`StepRequest`, `WorkerReport`) and back (`OffloadConnectorMetadata`, vLLM events).
"""

from __future__ import annotations

from collections.abc import Iterable
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from offload_connector.config import OffloadConfig
from offload_connector.metadata import decode_report
from offload_connector.tier_identity import TierIdentity
from offload_connector.vllm.engine_setup import KVCacheShape
from offload_connector.vllm.gpu_pool import VllmGpuPool
from offload_connector.vllm.messages import OffloadConnectorMetadata, OffloadWorkerMetadata, to_vllm_events
from offload_connector.vllm.stats import OffloadConnectorStats, StatsTracker, tier_counter_values
from scheduler_side import OffloadScheduler, StepRequest
from scheduler_side.groups import KVGroup

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

_block_id = attrgetter("block_id")
_step = tuple.__new__  # StepRequest(...) without its Python-level __new__ (per scheduled request, new or running)


class SchedulerRole:
    """The scheduler process's half of the connector: admission lookups, per-step metadata, completions."""

    def __init__(self, vllm_config: VllmConfig, config: OffloadConfig, shape: KVCacheShape,
                 num_cpu_blocks: int, tier_identity: TierIdentity | None = None) -> None:
        sched = vllm_config.scheduler_config
        self.config = config
        self.block_size = shape.block_size
        self.num_groups = len(shape.groups)  # several: a hybrid model, every block list is per group
        kv_events = vllm_config.kv_events_config
        self.emit_kv_events = bool(kv_events is not None and kv_events.enable_kv_cache_events)
        self._gpu_pool = VllmGpuPool()
        self.scheduler = OffloadScheduler(
            config, shape.block_size, num_cpu_blocks, self._gpu_pool, shape.world_size,
            group_id=0,
            groups=tuple(KVGroup(i, window, extra, state=i in shape.state_groups)
                         for i, (window, extra) in enumerate(shape.groups)),
            max_blocks_per_step=sched.max_num_batched_tokens // shape.block_size + sched.max_num_seqs,
            num_gpu_blocks=shape.num_gpu_blocks,
            tier_identity=tier_identity,
            emit_kv_events=self.emit_kv_events,
            lend_load_slots=shape.shared_by == 1,  # a shared pool: ranks do not order copies among themselves
        )
        self._stats_tracker = StatsTracker()
        # One step asked of vLLM at start-up, before any request (`has_pending_push_work`): its stats report
        # carries the capacity gauges, so Prometheus holds them from the first scrape, not 0 until a request.
        self._capacity_unreported = config.metrics
        # Host bytes one CPU block takes, all pools together (ranks sharing a pool hold one copy).
        self._bytes_per_block_all_ranks = shape.bytes_per_block * (shape.world_size // shape.shared_by)
        self._drafted: set[str] = set()  # requests with draft tokens in the last step (speculative decoding)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self._gpu_pool.bind(gpu_block_pool)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        if self.num_groups > 1:
            groups = [list(map(_block_id, group)) for group in blocks.blocks]
            self.scheduler.update_state_after_alloc(request, groups, num_external_tokens)
            return
        gpu_block_ids = list(map(_block_id, blocks.blocks[0])) if blocks.blocks else []
        self.scheduler.update_state_after_alloc(request, gpu_block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadConnectorMetadata:
        self._capacity_unreported = False  # this step's stats report carries the gauges (StatsTracker's first)
        sched = self.scheduler
        for req_id in scheduler_output.preempted_req_ids or ():
            sched.request_preempted(req_id)
        num_scheduled = scheduler_output.num_scheduled_tokens
        # One group: StepRequest carries group 0's block ids; several (a hybrid model): one list per group.
        one, empty = self.num_groups == 1, tuple([] for _ in range(self.num_groups))
        steps: list[StepRequest] = []
        for new in scheduler_output.scheduled_new_reqs:
            ids = (new.block_ids[0] if new.block_ids else []) if one else (new.block_ids or empty)
            steps.append(_step(StepRequest, (new.req_id, ids, new.num_computed_tokens + num_scheduled.get(new.req_id, 0),
                                             True)))
        cached = scheduler_output.scheduled_cached_reqs
        bs = self.block_size
        resumed_ids = cached.resumed_req_ids
        # Speculative decoding: a step with draft tokens may complete a block before its last tokens are
        # accepted and hashed; the store policy picks it only once it has a hash, in a later step, so a
        # request is kept in the step after one with drafts too (else a decode step inside the block
        # would be left out and the block never stored).
        drafted, previously_drafted = scheduler_output.scheduled_spec_decode_tokens, self._drafted
        self._drafted = set(drafted)
        kept = resumed_ids.union(drafted, previously_drafted) if drafted or previously_drafted else resumed_ids
        # StepRequest's contract: a request with no new block that completes none (a decode step) is left
        # out unless kept; most of a batch is (comprehensions, and tuple.__new__ for the StepRequests).
        # `before % bs + n >= bs`: the step completes a block ((before + n) // bs > before // bs, n >= 0).
        changed = zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens,
                      map(num_scheduled.__getitem__, cached.req_ids), strict=True)
        if one:
            steps += [_step(StepRequest, (req_id, new_ids[0] if new_ids else [], before + n, req_id in resumed_ids))
                      for req_id, new_ids, before, n in changed
                      if before % bs + n >= bs or (new_ids is not None and any(new_ids)) or req_id in kept]
        else:
            steps += [_step(StepRequest, (req_id, empty if new_ids is None else new_ids, before + n,
                                          req_id in resumed_ids))
                      for req_id, new_ids, before, n in changed
                      if before % bs + n >= bs or (new_ids is not None and any(new_ids)) or req_id in kept]
        return OffloadConnectorMetadata(sched.build_connector_meta(steps))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        # One path for loads and stores: each rank's report, counted once per rank. vLLM's own
        # finished_recving (the same loads, aggregated across ranks) only tells vLLM the request may run.
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, OffloadWorkerMetadata) and meta.reports:
            self.scheduler.update_connector_output([decode_report(r) for r in meta.reports])

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request)

    def reset_cache(self) -> bool:
        """vLLM's `reset_prefix_cache(reset_connector=True)` (sleep, weight updates): forget the CPU tier."""
        return self.scheduler.reset_cache()

    def has_pending_push_work(self) -> bool:
        # Keep the engine stepping until in-flight transfers report back, so an idle engine holds no blocks;
        # and step once at start-up to report the capacity.
        return self._capacity_unreported or self.scheduler.num_inflight_transfers > 0

    def take_events(self) -> Iterable[KVCacheEvent]:
        events = self.scheduler.take_events()
        if not self.emit_kv_events or not events:
            return ()
        return to_vllm_events(events, self.block_size)

    def get_kv_connector_stats(self) -> OffloadConnectorStats | None:
        if not self.config.metrics:
            return None
        sched = self.scheduler
        return self._stats_tracker.take(lambda: sched.stats.values() + tier_counter_values(sched.tiers),
                                        self._gauges, flush=not sched.has_live_requests())

    def _gauges(self) -> dict[str, float]:
        """Capacity and occupancy of each tier, and the CPU hit rate since start-up."""
        sched = self.scheduler
        pool, stats = sched.cpu_pool, sched.stats
        cached = len(pool.cached)
        gauges: dict[str, float] = {
            "cpu_pool_usage": round(pool.usage, 4), "cpu_blocks_cached": cached,
            "cpu_capacity_blocks": pool.num_blocks - 1,
            "cpu_cached_bytes": cached * self._bytes_per_block_all_ranks,
            "cpu_capacity_bytes": (pool.num_blocks - 1) * self._bytes_per_block_all_ranks,
            "cpu_hit_rate": round(stats.num_hit_tokens / stats.num_lookup_tokens, 4) if stats.num_lookup_tokens else 0,
        }
        for name, tier in sched.tiers.items():
            gauges.update({f"{name}_{gauge}": value for gauge, value in tier.gauges().items()})
        return gauges
