"""`WorkerRole`: the bodies of `OffloadConnector`'s worker hooks, over one `OffloadWorker`.

Exists only in a worker process (`KVConnectorRole.WORKER`), one per tensor-parallel rank; `OffloadConnector`
creates it and forwards each worker hook here. It owns
- `worker`, the `OffloadWorker` (host pool, copy backend, in-flight jobs), and
- this step's report: the `WorkerReport` that `get_finished` gathers and `build_connector_worker_meta`
  hands to vLLM, and what vLLM must hear of failed loads, handed out once: with one KV-cache group the GPU
  blocks whose load failed (`get_block_ids_with_load_errors`, vLLM recomputes from the first); with several
  (a hybrid model, where vLLM 0.32/0.33 raise on block ids because they are ambiguous across groups) the
  requests with a failed block instead (`failed_recving`, vLLM recomputes or fails the whole request).
  All are emptied when handed out, so a report reaches the scheduler exactly once.
The worker's CPU block count must equal the scheduler's (both derive it from the same config and shape);
registering KV tensors that imply another count fails start-up rather than corrupting block ids later.
Nothing here reads the connector metadata's type: `OffloadConnector` unwraps it to a `TransferMetadata`.

Sleep mode (vLLM >= 0.33): `unregister_kv_caches` (before the KV memory is unmapped) waits for every copy
in flight, and until `restore_kv_caches` (after it is mapped again) a step that carries a load or a store
raises `RuntimeError`: no copy ever touches unmapped KV memory. The registered views stay valid across
sleep because vLLM's default (CuMem) sleep backend maps the memory back at the same virtual addresses;
vLLM's own connectors (NIXL, Mooncake) re-register the same addresses on restore, assuming the same. The
host pool keeps its memory.
"""

from __future__ import annotations

import torch

from offload_connector.config import OffloadConfig
from offload_connector.metadata import TransferMetadata, WorkerReport, encode
from offload_connector.tier_identity import TierIdentity
from offload_connector.vllm.compat import tensor_parallel_barrier, tensor_parallel_rank
from offload_connector.vllm.engine_setup import KVCacheShape
from offload_connector.vllm.errors import UnsupportedSetupError
from offload_connector.vllm.messages import OffloadWorkerMetadata, merge_reports
from offload_connector.vllm.state_pages import state_page_view
from worker_side import OffloadWorker
from worker_side.shared_pool import SharedPoolSpec


class WorkerRole:
    """One rank's half of the connector: registers the KV tensors, issues loads and stores, reports back."""

    def __init__(self, config: OffloadConfig, shape: KVCacheShape, num_cpu_blocks: int,
                 tier_identity: TierIdentity | None = None, shared_pool_path: str | None = None) -> None:
        """`shared_pool_path`: with `shape.shared_by` > 1 (every TP rank holds the same KV), the /dev/shm file
        of the one host pool the ranks map; rank 0 stores into it, every rank loads from it."""
        self.shape = shape
        self.num_cpu_blocks = num_cpu_blocks  # what the scheduler role counts; the worker must agree
        rank = tensor_parallel_rank()
        shared = None
        if shape.shared_by > 1:
            if shared_pool_path is None:
                raise ValueError("a host pool shared by several ranks needs its path (our bug)")
            shared = SharedPoolSpec(shared_pool_path, rank, shape.shared_by, tensor_parallel_barrier)
        self.worker = OffloadWorker(config, world_size=shape.world_size, rank=rank,
                                    tier_identity=tier_identity, shared_pool=shared)
        self._report: WorkerReport | None = None  # since the last build_connector_worker_meta
        self._failed_load_gpu_blocks: set[int] = set()  # since the last get_block_ids_with_load_errors
        self._failed_load_reqs: set[str] = set()  # since the last failed_load_requests (several groups)
        self.several_groups = len(shape.groups) > 1
        self.kv_caches_unregistered = False  # between unregister_kv_caches and restore_kv_caches (asleep)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """vLLM's tensors per layer; a Mamba/SSM layer's state becomes one tensor of its whole pages
        (state_pages.py), so the worker copies state blocks as it copies attention blocks."""
        if self.shape.state_layers:
            page_bytes = self.shape.bytes_per_block // self.shape.num_layers
            kv_caches = {name: state_page_view(name, entry, self.shape.num_gpu_blocks, page_bytes)
                         if name in self.shape.state_layers else entry for name, entry in kv_caches.items()}
        self.worker.register_kv_caches(kv_caches, num_gpu_blocks=self.shape.num_gpu_blocks,
                                       layout=self.shape.layout)
        self._check_sizing()

    def _check_sizing(self) -> None:
        if self.worker.num_cpu_blocks != self.num_cpu_blocks:
            raise UnsupportedSetupError(
                f"OffloadConnector: the worker's KV tensors have {self.worker.bytes_per_block} bytes per "
                f"block ({self.worker.num_cpu_blocks} CPU blocks) but kv_cache_config implies "
                f"{self.shape.bytes_per_block} ({self.num_cpu_blocks} CPU blocks); the scheduler and workers "
                "must agree. Set num_cpu_blocks in the connector config to pin the count."
            )

    def unregister_kv_caches(self) -> None:
        """Before sleep: finish every copy in flight (results stay queued for `get_finished`), then refuse
        copies until `restore_kv_caches`. Idempotent."""
        if not self.kv_caches_unregistered:
            self.worker.wait_all()
            self.kv_caches_unregistered = True

    def restore_kv_caches(self) -> None:
        """After wake-up: the KV memory is mapped again at the same addresses; copies may resume. Idempotent."""
        self.kv_caches_unregistered = False

    def _check_registered(self, meta: TransferMetadata | None, hook: str) -> None:
        if self.kv_caches_unregistered and meta is not None and (
                meta.load_event is not None or meta.store_event is not None):
            raise RuntimeError(f"OffloadConnector: {hook} got load event {meta.load_event} / store event "
                               f"{meta.store_event} while the KV caches are unregistered (engine asleep; "
                               "vLLM bug?)")

    def begin_step(self) -> None:
        self.worker.begin_step()  # before the forward is launched: loads fence on earlier compute only

    def start_load_kv(self, meta: TransferMetadata | None) -> None:
        self._check_registered(meta, "start_load_kv")
        if meta is not None and (meta.load_event is not None or meta.tiers):
            self.worker.start_load(meta)  # also issues the lower tiers' fetches

    def wait_for_save(self, meta: TransferMetadata | None) -> None:
        self._check_registered(meta, "wait_for_save")
        if meta is not None and meta.store_event is not None:
            self.worker.start_store(meta)

    def get_finished(self) -> set[str] | None:
        """Requests whose loads finished (vLLM's `finished_recving`); keeps the rank's report for the step."""
        report = self.worker.get_finished()  # waits for loads only where the backend says (CPU)
        if self._report is None:
            self._report = report
        else:  # get_finished called twice before build_connector_worker_meta: keep both
            self._report = merge_reports(self._report, report)
        if self.several_groups:
            self._failed_load_reqs.update(report.failed_load_reqs)
        else:
            self._failed_load_gpu_blocks.update(report.failed_load_gpu_blocks)
        return set(report.finished_load_reqs) or None

    def failed_load_requests(self) -> set[str]:
        """Several KV-cache groups: requests whose load had a failed block (also among the finished ones),
        vLLM's `failed_recving`; always empty with one group (block ids are reported instead)."""
        failed, self._failed_load_reqs = self._failed_load_reqs, set()
        return failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_load_gpu_blocks = self._failed_load_gpu_blocks, set()
        return failed

    def build_connector_worker_meta(self) -> OffloadWorkerMetadata | None:
        report, self._report = self._report, None
        if report is None or (report.is_empty and not report.bytes_stored and not report.bytes_loaded
                              and not report.tiers):
            return None
        return OffloadWorkerMetadata(reports=[encode(report)])

    def shutdown(self) -> None:
        self.worker.shutdown()

