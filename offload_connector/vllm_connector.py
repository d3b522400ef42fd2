"""`OffloadConnector`: vLLM's `KVConnectorBase_V1` mapped onto `scheduler_side` and `worker_side`.

Enable with (SPEC §6):
    --kv-transfer-config '{"kv_connector":"OffloadConnector",
        "kv_connector_module_path":"offload_connector.vllm_connector","kv_role":"kv_both",
        "kv_connector_extra_config":{"config_file":"offload.yaml"}}'

One instance per role. The scheduler role owns an `OffloadScheduler` (CPU pool, per-request state) and
borrows vLLM's GPU `BlockPool` through `VllmGpuPool`; the worker role owns an `OffloadWorker` (host pool,
copies). They talk only through `OffloadConnectorMetadata` (scheduler -> workers, each step) and
`OffloadWorkerMetadata` (each rank's encoded `WorkerReport`, workers -> scheduler, aggregated by vLLM),
both in `vllm_messages.py`.

Per-step order in vLLM 0.32 and what each hook does here:
  scheduler: get_num_new_matched_tokens -> update_state_after_alloc -> build_connector_meta
  worker:    bind_connector_metadata (the backend fences this step's loads on the compute launched so
             far) -> forward launched -> start_load_kv (loads issued; on CUDA they overlap the forward)
             -> wait_for_save (stores issued, ordered after the forward) -> get_finished (the CPU backend
             waits for this step's loads, so a CPU-hit request runs the step after admission; the CUDA
             backend only polls, never blocking the engine thread) -> get_block_ids_with_load_errors
             -> build_connector_worker_meta (the rank's report)
  scheduler: update_connector_output (every rank's report: a load or store completes once each rank
             reported it once) -> request_finished / take_events / stats.
Blocks with a transfer in flight carry the connector's own references (GPU and CPU), so vLLM may free,
preempt or abort at any point: `request_finished` always returns (False, None) and `handle_preemptions`
has nothing to flush.

This module imports vLLM; nothing else in the package does (import it only when vLLM is installed).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from offload_connector.metadata import TransferMetadata, WorkerReport, decode_report, encode
from offload_connector.vllm_gpu_pool import VllmGpuPool
from offload_connector.vllm_messages import (
    OffloadConnectorMetadata,
    OffloadWorkerMetadata,
    merge_reports,
    to_vllm_events,
)
from offload_connector.vllm_setup import (
    KVCacheShape,
    UnsupportedSetupError,
    describe_kv_cache,
    resolve_config,
)
from offload_connector.vllm_stats import OffloadConnectorStats, OffloadPromMetrics, StatsTracker
from scheduler_side import OffloadScheduler, StepRequest

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class OffloadConnector(KVConnectorBase_V1):
    """CPU tier for vLLM's KV cache: evicted prefixes come back from host RAM instead of recomputation."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.config = resolve_config(self._kv_transfer_config.kv_connector_extra_config)
        self.shape: KVCacheShape = describe_kv_cache(vllm_config, kv_cache_config)
        self.num_cpu_blocks = self.shape.num_cpu_blocks(self.config)
        self.offload: OffloadScheduler | None = None
        self.worker: Any = None
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler(vllm_config)
        else:
            self._init_worker(vllm_config)
        logger.info(
            "OffloadConnector %s: %d CPU blocks of %d bytes per rank (%d ranks), block_size=%d, store_policy=%s",
            role.name, self.num_cpu_blocks, self.shape.bytes_per_block, self.shape.world_size,
            self.shape.block_size, self.config.store_policy,
        )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is only a future miss

    # ================================================================== scheduler role
    def _init_scheduler(self, vllm_config: VllmConfig) -> None:
        sched = vllm_config.scheduler_config
        self._gpu_pool = VllmGpuPool()
        self.offload = OffloadScheduler(
            self.config, self.shape.block_size, self.num_cpu_blocks, self._gpu_pool, self.shape.world_size,
            group_id=0,
            max_blocks_per_step=sched.max_num_batched_tokens // self.shape.block_size + sched.max_num_seqs,
            num_gpu_blocks=self.shape.num_gpu_blocks,
        )
        self._stats_tracker = StatsTracker()
        kv_events = getattr(vllm_config, "kv_events_config", None)
        self._emit_kv_events = bool(kv_events is not None and kv_events.enable_kv_cache_events)
        self.offload.emit_kv_events = self._emit_kv_events

    def _sched(self) -> OffloadScheduler:
        if self.offload is None:
            raise RuntimeError(f"OffloadConnector: scheduler hook called on the {self.role.name} role (vLLM bug?)")
        return self.offload

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self._sched()
        self._gpu_pool.bind(gpu_block_pool)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        gpu_block_ids = [block.block_id for block in blocks.blocks[0]] if blocks.blocks else []
        self._sched().update_state_after_alloc(request, gpu_block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        sched = self._sched()
        for req_id in scheduler_output.preempted_req_ids or ():
            sched.request_preempted(req_id)
        num_scheduled = scheduler_output.num_scheduled_tokens
        steps: list[StepRequest] = []
        for new in scheduler_output.scheduled_new_reqs:
            steps.append(StepRequest(new.req_id, new.block_ids[0] if new.block_ids else [],
                                     new.num_computed_tokens + num_scheduled.get(new.req_id, 0), True))
        cached = scheduler_output.scheduled_cached_reqs
        bs = self.shape.block_size
        resumed_ids = cached.resumed_req_ids
        for req_id, new_ids, before in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens,
                                           strict=True):
            n = num_scheduled[req_id]
            if before % bs + n < bs and not (new_ids and new_ids[0]) and req_id not in resumed_ids:
                continue  # the common decode step: no new block, none completed; nothing to tell
            steps.append(StepRequest(req_id, new_ids[0] if new_ids else [], before + n, req_id in resumed_ids))
        return OffloadConnectorMetadata(sched.build_connector_meta(steps))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        # One path for loads and stores: each rank's report, counted once per rank. vLLM's own
        # finished_recving (the same loads, aggregated across ranks) only tells vLLM the request may run.
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, OffloadWorkerMetadata) and meta.reports:
            self._sched().update_connector_output([decode_report(r) for r in meta.reports])

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request)

    def has_pending_push_work(self) -> bool:
        # Keep the engine stepping until in-flight transfers report back, so an idle engine holds no blocks.
        return self.offload is not None and self.offload.num_inflight_transfers > 0

    def take_events(self) -> Iterable[KVCacheEvent]:
        if self.offload is None:
            return ()
        events = self.offload.take_events()
        if not self._emit_kv_events or not events:
            return ()
        return to_vllm_events(events, self.shape.block_size)

    def get_kv_connector_stats(self) -> OffloadConnectorStats | None:
        sched = getattr(self, "offload", None)
        if sched is None or not self.config.metrics:
            return None
        pool = sched.cpu_pool
        return self._stats_tracker.take(sched.stats.values(), lambda: {
            "cpu_pool_usage": round(pool.usage, 4), "cpu_blocks_cached": len(pool.cached),
            "cpu_blocks_total": pool.num_blocks - 1})

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> OffloadConnectorStats | None:
        return OffloadConnectorStats(data=data) if data is not None else OffloadConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> OffloadPromMetrics:
        return OffloadPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ================================================================== worker role
    def _init_worker(self, vllm_config: VllmConfig) -> None:
        from worker_side import OffloadWorker

        self.worker = OffloadWorker(self.config, world_size=self.shape.world_size, rank=_tp_rank(vllm_config))
        self._report: WorkerReport | None = None
        self._failed_load_gpu_blocks: set[int] = set()

    def _work(self) -> Any:
        if self.worker is None:
            raise RuntimeError(f"OffloadConnector: worker hook called on the {self.role.name} role (vLLM bug?)")
        return self.worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        worker = self._work()
        worker.register_kv_caches(kv_caches, num_gpu_blocks=self.shape.num_gpu_blocks, layout=self.shape.layout)
        self._check_worker_sizing()

    def register_cross_layers_kv_cache(self, kv_cache: torch.Tensor, attn_backend: Any = None) -> None:
        """vLLM >= 0.33 hands one tensor holding every layer's blocks (block dimension first)."""
        worker = self._work()
        worker.register_cross_layer_kv_cache(kv_cache, num_gpu_blocks=self.shape.num_gpu_blocks)
        self._check_worker_sizing()

    def _check_worker_sizing(self) -> None:
        if self.worker.num_cpu_blocks != self.num_cpu_blocks:
            raise UnsupportedSetupError(
                f"OffloadConnector: the worker's KV tensors have {self.worker.bytes_per_block} bytes per block "
                f"({self.worker.num_cpu_blocks} CPU blocks) but kv_cache_config implies "
                f"{self.shape.bytes_per_block} ({self.num_cpu_blocks} CPU blocks); the scheduler and workers "
                "must agree. Set num_cpu_blocks in the connector config to pin the count."
            )

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None:
            self.worker.begin_step()  # before the forward is launched: loads fence on earlier compute only

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._bound()
        if meta is not None and meta.load_event is not None:
            self._work().start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads target requests that wait for them; no forward reads a block being loaded

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # stores are issued once per step in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._bound()
        if meta is not None and meta.store_event is not None:
            self._work().start_store(meta)

    def _bound(self) -> TransferMetadata | None:
        meta = self._connector_metadata
        if meta is None:
            return None
        if not isinstance(meta, OffloadConnectorMetadata):
            raise TypeError(f"OffloadConnector got {type(meta).__name__} metadata (a different connector's?)")
        return meta.transfer

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        report = self._work().get_finished()  # waits for loads only where the backend says (CPU)
        if self._report is None:
            self._report = report
        else:  # get_finished called twice before build_connector_worker_meta: keep both
            self._report = merge_reports(self._report, report)
        self._failed_load_gpu_blocks.update(report.failed_load_gpu_blocks)
        return None, (set(report.finished_load_reqs) or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.worker is None:
            return set()
        failed, self._failed_load_gpu_blocks = self._failed_load_gpu_blocks, set()
        return failed

    def build_connector_worker_meta(self) -> OffloadWorkerMetadata | None:
        if self.worker is None:
            return None
        report, self._report = self._report, None
        if report is None or (report.is_empty and not report.bytes_stored and not report.bytes_loaded):
            return None
        return OffloadWorkerMetadata(reports=[encode(report)])

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        return  # in-flight blocks hold connector references: vLLM cannot reuse them before we finish

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()


def _tp_rank(vllm_config: Any) -> int:
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_rank()
    return 0  # stand-alone use (tests): a single rank
