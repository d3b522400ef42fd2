"""`OffloadConnector`: vLLM's `KVConnectorBase_V1`, forwarding each hook to its role's object.

Enable with (SPEC §6):
    --kv-transfer-config '{"kv_connector":"OffloadConnector",
        "kv_connector_module_path":"offload_connector.vllm_connector","kv_role":"kv_both",
        "kv_connector_extra_config":{"config_file":"offload.yaml"}}'

One instance per role, holding exactly one role object, as vLLM's own connectors do:
- scheduler role: `connector_scheduler`, a `SchedulerRole` (scheduler_role.py): an `OffloadScheduler`
  (CPU pool, per-request state) borrowing vLLM's GPU `BlockPool` through `VllmGpuPool`;
- worker role: `connector_worker`, a `WorkerRole` (worker_role.py): an `OffloadWorker` (host pool,
  copies) and the rank's per-step report.
The other attribute is None, and only the module of the role in use is imported. The two roles talk
only through `OffloadConnectorMetadata` (scheduler -> workers, each step) and `OffloadWorkerMetadata`
(each rank's encoded `WorkerReport`, workers -> scheduler, aggregated by vLLM), both in
messages.py. This class keeps what both roles share: the resolved config, the KV-cache shape and
the CPU block count.

Hybrid models: the class declares vLLM's `SupportsHMA`, so vLLM keeps its hybrid KV cache manager on and
hands every hook one block list per KV-cache group (full attention, sliding window, Mamba state); the
scheduler role passes them on per group (scheduler_side/hybrid.py), the worker copies whole block ids as
for one group (a Mamba layer's state as whole pages, state_pages.py).

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

Sleep mode and weight updates (vLLM 0.32 and 0.33): sleep (level >= 1) pauses the scheduler and calls
`reset_prefix_cache(reset_connector=True)`, which calls `reset_cache` here: the CPU tier forgets all its
contents, so KV computed with the old weights is never served after a weight update (the same call
after an update without sleep does the same). vLLM 0.33 also asks `supports_sleep_mode` (True) and calls
`unregister_kv_caches` before the KV memory is unmapped and `restore_kv_caches` after wake-up (worker).

A hook of one role called on the other raises `RuntimeError` naming the hook and the role (a vLLM bug),
except those with a harmless empty answer that vLLM or a wrapper may ask either role for:
`get_kv_connector_stats` (None), `shutdown` (nothing), `has_pending_push_work` (False), `take_events`
(none), `bind_connector_metadata` (only stored), `get_block_ids_with_load_errors` (none) and
`build_connector_worker_meta` (None).

This module and the role and message modules it imports use vLLM: import them only when it is installed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from offload_connector.config import ConfigError
from offload_connector.lower_tiers import lower_tier_sections
from offload_connector.metadata import TransferMetadata
from offload_connector.sizing import (
    check_host_memory,
    check_shared_memory,
    mem_available_bytes,
    shm_free_bytes,
)
from offload_connector.vllm.compat import check_vllm_version
from offload_connector.vllm.early_check import ranks_on_host
from offload_connector.vllm.engine_setup import (
    KVCacheShape,
    adopt_vllm_logging,
    check_groups_config,
    describe_kv_cache,
    located_in_extra_config,
    resolve_config,
    shared_pool_path,
    shared_pool_ranks,
)
from offload_connector.vllm.kv_layout import describe_layout, required_layout
from offload_connector.vllm.messages import OffloadConnectorMetadata, OffloadWorkerMetadata
from offload_connector.vllm.startup_line import backend_in_this_process, startup_line
from offload_connector.vllm.stats import OffloadConnectorStats, OffloadPromMetrics

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from offload_connector.vllm.scheduler_role import SchedulerRole
    from offload_connector.vllm.worker_role import WorkerRole
    from scheduler_side import OffloadScheduler
    from worker_side import OffloadWorker

__all__ = ["OffloadConnector", "OffloadConnectorMetadata", "OffloadWorkerMetadata"]

logger = logging.getLogger(__name__)


class OffloadConnector(KVConnectorBase_V1, SupportsHMA):
    """CPU tier for vLLM's KV cache: evicted prefixes come back from host RAM instead of recomputation."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        check_vllm_version()  # first: on another vLLM even the base class may fail in obscure ways
        super().__init__(vllm_config, role, kv_cache_config)
        adopt_vllm_logging()  # our start-up line and warnings reach vLLM's log, formatted as vLLM's
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.config = resolve_config(extra)
        shape = describe_kv_cache(vllm_config, kv_cache_config)
        if len(shape.groups) > 1:  # a hybrid model: an unset store_policy means eager here
            self.config = resolve_config(extra, len(shape.groups))
        # MLA under TP: every rank holds the same latent; one host pool serves them all (shared_pool.py).
        self.shape: KVCacheShape = replace(shape, shared_by=shared_pool_ranks(vllm_config, kv_cache_config,
                                                                               self.config))
        check_groups_config(self.config, self.shape)  # a hybrid model: eager stores, no lower tier
        try:
            self.capacity = self.shape.capacity(self.config)  # raises for fewer than 2 blocks per rank
            # Before any block exists: the host must hold its ranks' pools (the plugin checked the same from
            # the model's config; this is vLLM's exact KV spec, and the check for set-ups without the
            # plugin), and /dev/shm a pool the ranks share.
            check_host_memory(self.config, self.capacity, ranks_on_host(vllm_config.parallel_config),
                              mem_available_bytes())
            check_shared_memory(self.config, self.capacity, shm_free_bytes())
        except ConfigError as err:
            raise located_in_extra_config(err, extra) from None
        self.num_cpu_blocks = self.capacity.num_cpu_blocks  # the null block included
        identity = None
        if lower_tier_sections(self.config):  # tiers below the CPU tier (offload_connector/lower_tiers.py)
            from offload_connector.vllm.tier_identity import vllm_tier_identity

            identity = vllm_tier_identity(vllm_config, kv_cache_config, self.shape)
        self.connector_scheduler: SchedulerRole | None = None
        self.connector_worker: WorkerRole | None = None
        if role == KVConnectorRole.SCHEDULER:
            from offload_connector.vllm.scheduler_role import SchedulerRole

            self.connector_scheduler = SchedulerRole(vllm_config, self.config, self.shape,
                                                     self.num_cpu_blocks, identity)
            backend = backend_in_this_process(self.config.transfer.backend)
        else:
            from offload_connector.vllm.worker_role import WorkerRole

            self.connector_worker = WorkerRole(self.config, self.shape, self.num_cpu_blocks, identity,
                                               shared_pool_path(vllm_config) if self.shape.shared_by > 1 else None)
            backend = self.connector_worker.worker.backend.name
        layout = describe_layout(required_layout(vllm_config, self.config), self.shape.layout)
        logger.info("%s", startup_line(role.name, extra, self.config, backend, self.capacity, layout))

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """A block-outermost layout (each block one range across layers, which the copy engines move at the
        link's speed) where the model and its attention backends allow it, else None: vLLM's own
        (kv_layout.py). vLLM keeps its own where a backend does not support the one asked for."""
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        return required_layout(vllm_config, resolve_config(extra)).layout

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """False: no layer-by-layer work to keep out of CUDA graphs.

        vLLM calls this while it builds its `VllmConfig` (on GPUs, when CUDA graphs are on): the earliest
        hook that hands a connector its config. A bad config raises `ConfigError` here, before the engine
        core, the model or any cache exists (pydantic wraps it in a `ValidationError`; the plugin's check
        in plugin.py re-raises ours, and covers the set-ups where vLLM does not call this)."""
        resolve_config(extra_config)  # parse only, allocates nothing
        return False

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any = None) -> bool:
        """True (vLLM >= 0.33 asks): `reset_cache` drops the CPU tier at sleep, and the worker stops
        copying between `unregister_kv_caches` and `restore_kv_caches`."""
        return True

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is only a future miss

    @property
    def offload(self) -> OffloadScheduler | None:
        """The scheduler role's `OffloadScheduler`; None on the worker role."""
        return self.connector_scheduler.scheduler if self.connector_scheduler is not None else None

    @property
    def worker(self) -> OffloadWorker | None:
        """The worker role's `OffloadWorker`; None on the scheduler role."""
        return self.connector_worker.worker if self.connector_worker is not None else None

    def _sched(self, hook: str) -> SchedulerRole:
        if self.connector_scheduler is None:
            raise RuntimeError(
                f"OffloadConnector: scheduler hook {hook} called on the {self.role.name} role (vLLM bug?)")
        return self.connector_scheduler

    def _work(self, hook: str) -> WorkerRole:
        if self.connector_worker is None:
            raise RuntimeError(
                f"OffloadConnector: worker hook {hook} called on the {self.role.name} role (vLLM bug?)")
        return self.connector_worker

    # ================================================================== scheduler role
    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self._sched("bind_gpu_block_pool").bind_gpu_block_pool(gpu_block_pool)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        role = self._sched("get_num_new_matched_tokens")
        return role.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self._sched("update_state_after_alloc").update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched("build_connector_meta").build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched("update_connector_output").update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched("request_finished").request_finished(request)

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """`SupportsHMA`: vLLM 0.32 calls this instead of `request_finished`, once, for every model (one
        group or several). Never delays the free: in-flight transfers hold their own references."""
        return self._sched("request_finished_all_groups").request_finished(request)

    def reset_cache(self) -> bool:
        """Forget every CPU-tier entry, in-flight stores included (`OffloadScheduler.reset_cache`); False
        (vLLM's reset then reports failure) while the lazy policy holds blocks not yet stored."""
        return self._sched("reset_cache").reset_cache()

    def has_pending_push_work(self) -> bool:
        return self.connector_scheduler is not None and self.connector_scheduler.has_pending_push_work()

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self.connector_scheduler.take_events() if self.connector_scheduler is not None else ()

    def get_kv_connector_stats(self) -> OffloadConnectorStats | None:
        # vLLM asks both roles; only the scheduler's counts (worker figures reach it in the reports).
        role = self.connector_scheduler
        return role.get_kv_connector_stats() if role is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> OffloadConnectorStats | None:
        return OffloadConnectorStats(data=data) if data is not None else OffloadConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> OffloadPromMetrics:
        return OffloadPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ================================================================== worker role
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work("register_kv_caches").register_kv_caches(kv_caches)

    def unregister_kv_caches(self) -> None:
        self._work("unregister_kv_caches").unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        self._work("restore_kv_caches").restore_kv_caches()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.connector_worker is not None:
            self.connector_worker.begin_step()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._work("start_load_kv").start_load_kv(self._bound())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads target requests that wait for them; no forward reads a block being loaded

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # stores are issued once per step in wait_for_save

    def wait_for_save(self) -> None:
        self._work("wait_for_save").wait_for_save(self._bound())

    def _bound(self) -> TransferMetadata | None:
        meta = self._connector_metadata
        if meta is None:
            return None
        if not isinstance(meta, OffloadConnectorMetadata):
            raise TypeError(f"OffloadConnector got {type(meta).__name__} metadata (a different connector's?)")
        return meta.transfer

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, self._work("get_finished").get_finished()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """`get_finished`'s loads, and with several KV-cache groups the requests whose load failed
        (`failed_recving`, also in `finished_recving`): vLLM cannot take failed block ids from hybrid
        models (it raises), so there they go by request."""
        _, finished = self.get_finished(finished_req_ids)
        failed = self._work("get_transfer_results").failed_load_requests()
        return KVConnectorTransferResults(finished_recving=set(finished or ()), failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        role = self.connector_worker
        return role.get_block_ids_with_load_errors() if role is not None else set()

    def build_connector_worker_meta(self) -> OffloadWorkerMetadata | None:
        role = self.connector_worker
        return role.build_connector_worker_meta() if role is not None else None

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        return  # in-flight blocks hold connector references: vLLM cannot reuse them before we finish

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
        if self.connector_scheduler is not None:
            self.connector_scheduler.scheduler.close()  # the lower tiers' threads, if any
