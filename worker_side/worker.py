"""OffloadWorker: the worker-side connector (one per engine rank).

It registers the engine's KV tensors, allocates the host pool to match, turns each step's
`TransferMetadata` into at most one load job and one store job, and reports completions as a `WorkerReport`.

Lifecycle and invariants:
- `register_*` once, before any transfer; block id 0 of both tiers is never copied.
- per step: `begin_step()` before the forward is launched (the backend fences loads on the work launched
  before it), then `start_load` / `start_store` (one job each, stores after the forward wrote the blocks;
  the backend orders each against the compute stream where one exists; with `store_after_load` the store
  also follows this step's load, whose source slots it rewrites), then `get_finished()`.
- no store job starts writing a host block that a load job in flight reads: with `store_after_load` it
  follows this step's loads; any other load in flight that reads one of its blocks (an earlier step's, or
  this step's without `store_after_load`: a scheduler bug, which the scheduler's stores-and-reads invariant
  forbids) is added to its `after` too, counted in `num_stores_held_for_loads` and logged (load_reads.py).
- `_jobs` holds exactly the submitted jobs whose result has not been reported; each job is reported once:
  a load job lists its requests in `finished_load_reqs` (also when it failed: failed GPU blocks go to
  `failed_load_gpu_blocks`, and the engine recomputes them); a store job's event goes to
  `completed_store_events` or `failed_store_events`, never both.
- `get_finished(wait_for_loads=None)` waits for the loads started since the previous call when the backend
  says so (`sync_loads`: the CPU backend, one-step resume), else only polls (CUDA: the engine thread never
  blocks); it never waits for stores. Metadata that breaks the `TransferMetadata` invariants raises
  `WorkerInvariantError` before anything is submitted.
- a deadline on loads (`transfer.load_timeout_s`): a load job not done that long after its submission is
  reported as if it had failed whole (its requests finished, every GPU block failed: the engine
  recomputes them) and its event listed in `expired_load_events`. A copy cannot be recalled, so the job
  stays in `_jobs` (`expired`) until the backend reports it; then its event goes to `ended_load_events`
  and nothing else of it is reported. Until then the scheduler keeps its GPU and CPU blocks out of every
  other use (completions.py), so the late copy writes only what a load of those tokens writes, into
  blocks nobody else holds. A wait for this step's loads never outlasts the deadline.
- lower tiers (`tier_ios`: a `TierIO` per configured tier, tiers/base.py): `start_load` hands each its
  `TierOps` (evicted blocks' writes, then fetches; checked here); `get_finished` hands completed stores to
  tiers writing stored blocks (bytes copied before the report leaves) and adds their non-empty reports.
- with a `shared_pool` (ranks whose KV is byte-identical: MLA's latent under TP) the host pool is one mapping
  of every such rank; only its rank 0 copies stores, the others report theirs done at once (shared_pool.py).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from offload_connector.config import OffloadConfig
from offload_connector.lower_tiers import lower_tier_sections
from offload_connector.metadata import TierOps, TransferMetadata, WorkerReport
from offload_connector.sizing import num_cpu_blocks as sized_num_cpu_blocks
from offload_connector.tier_identity import TierIdentity
from worker_side.backends.base import CopyJob, JobKind, JobResult, TransferBackend
from worker_side.backends.select import make_backend
from worker_side.block_layout import BLOCK_FIRST, TensorBlockView, tensor_block_view
from worker_side.errors import LayoutError, WorkerClosedError, WorkerInvariantError
from worker_side.host_memory import allocate_host_buffer
from worker_side.host_pool import HostPool
from worker_side.job_ids import IdChecks
from worker_side.job_record import JobRecord, expire_loads, failed_requests
from worker_side.load_reads import LoadReads
from worker_side.shared_pool import SharedPoolSpec
from worker_side.tiers.base import TierIO
from worker_side.tiers.registry import check_tier_identity, make_tier_ios

logger = logging.getLogger(__name__)


class OffloadWorker:
    def __init__(self, config: OffloadConfig, world_size: int = 1, rank: int = 0,
                 backend: TransferBackend | None = None, tier_identity: TierIdentity | None = None,
                 shared_pool: SharedPoolSpec | None = None) -> None:
        """`shared_pool`: this rank maps one host pool with the other ranks of the spec (their KV is
        byte-identical, e.g. MLA's latent; shared_pool.py): only its rank 0 copies stores."""
        check_tier_identity(config, tier_identity)
        if shared_pool is not None and lower_tier_sections(config):
            raise ValueError("a host pool shared by several ranks does not serve lower tiers (our bug: the "
                             "adapter shares pools only without them)")
        self.config, self.world_size, self.rank = config, world_size, rank
        self.shared_pool = shared_pool
        self.tier_identity = tier_identity
        self.tier_ios: dict[str, TierIO] = {}  # by name, nearest first; created with the host pool
        self.backend = backend if backend is not None else make_backend(config)
        self._views: list[TensorBlockView] = []
        self._pool: HostPool | None = None
        self._num_gpu_blocks = 0
        self._job_ids = itertools.count(1)
        self._jobs: dict[int, JobRecord] = {}
        self._load_reads = LoadReads(0)  # the host blocks the load jobs in flight read (sized at registration)
        self._loads_this_step: list[int] = []
        self._instant: list[JobResult] = []  # jobs with no blocks: finished at submission
        self._ids = IdChecks()  # the metadata's block ids, checked per job (job_ids.py)
        self._closed = False
        self.load_timeout_s = config.transfer.load_timeout_s  # None: loads are waited for forever
        self.num_load_timeouts = 0  # load jobs given up on (expired), since start
        # store jobs the metadata did not order after a load in flight that reads their host blocks (a
        # scheduler bug): the worker ordered them itself, since start
        self.num_stores_held_for_loads = 0

    # ---- registration -------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor], num_gpu_blocks: int | None = None,
                           layout: str | None = None, head_dim: int | None = None) -> None:
        """Find each tensor's block dim, size and allocate the host pool, bind the backend. `head_dim`: the
        tensors' KV-head dim where the layout does not say (block_layout; per-head records of lower tiers)."""
        if self._pool is not None:
            raise WorkerInvariantError("register_kv_caches called twice; KV caches are registered once")
        if not kv_caches:
            raise LayoutError("register_kv_caches got no tensors; allowed: a dict of layer name -> tensor")
        views: list[TensorBlockView] = []
        seen: set[tuple[int, int, int]] = set()
        for name, tensor in kv_caches.items():
            view = tensor_block_view(name, tensor, num_gpu_blocks, layout, head_dim)
            key = (view.base_ptr, view.block_stride, view.block_bytes)
            if key in seen:  # layers sharing one KV cache (KV sharing): copy its bytes once
                continue
            seen.add(key)
            views.append(view)
        counts = {v.num_blocks for v in views}
        devices = {str(v.tensor.device) for v in views}
        if len(counts) != 1 or len(devices) != 1:
            raise LayoutError(f"KV tensors disagree on block count {sorted(counts)} or device {sorted(devices)}; "
                              "allowed: one block count and one device per worker (pass num_gpu_blocks)")
        bytes_per_block = sum(v.block_bytes for v in views)
        shared = self.shared_pool
        num_blocks = sized_num_cpu_blocks(self.config, bytes_per_block, self.world_size,
                                          shared.num_ranks if shared is not None else 1)
        node = self.backend.numa_node(views)
        pool = HostPool(views, num_blocks, shared.allocate if shared is not None else
                        lambda nbytes: allocate_host_buffer(nbytes, node), layout=self.backend.host_layout(views))
        self.backend.bind(views, pool)  # pins the pool where the backend needs it, before any graph capture
        self._pool = pool
        self._load_reads = LoadReads(pool.num_blocks)
        self._views, self._num_gpu_blocks = views, counts.pop()
        self.tier_ios = make_tier_ios(self.config, self.tier_identity, self.rank, self.world_size, pool)

    def register_cross_layer_kv_cache(self, tensor: torch.Tensor, num_gpu_blocks: int | None = None) -> None:
        """One tensor holding every layer, block dim first: each block is one contiguous range."""
        self.register_kv_caches({"cross_layer": tensor}, num_gpu_blocks, layout=BLOCK_FIRST)

    @property
    def bytes_per_block(self) -> int:
        return self._require_pool().bytes_per_block

    @property
    def num_cpu_blocks(self) -> int:
        return self._require_pool().num_blocks

    @property
    def num_gpu_blocks(self) -> int:
        return self._num_gpu_blocks

    @property
    def host_pool(self) -> HostPool:
        return self._require_pool()

    @property
    def num_in_flight(self) -> int:
        return len(self._jobs) + sum(io.num_fetches_in_flight for io in self.tier_ios.values())

    def _require_pool(self) -> HostPool:
        if self._pool is None:
            raise WorkerClosedError("register the KV caches (register_kv_caches) before using the host pool")
        return self._pool

    # ---- transfers ----------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Call before the step's forward is launched (vLLM: bind_connector_metadata)."""
        if not self._closed and self._pool is not None:
            self.backend.begin_step()

    def start_load(self, meta: TransferMetadata) -> None:
        """Issue this step's lower-tier ops (`start_tier_ops`), then its load (host pool -> KV cache); no wait."""
        if meta.tiers:
            self.start_tier_ops(meta.tiers)
        if meta.load_event is None:
            return
        cpu, gpu = self._checked_ids("load", meta.load_event, meta.load_cpu_blocks, meta.load_gpu_blocks)
        job_id = self._submit("load", meta.load_event, cpu, gpu, tuple(meta.load_event_reqs))
        if job_id in self._jobs:
            rec = self._jobs[job_id]
            rec.load_req_num_blocks, rec.load_dst = tuple(meta.load_req_num_blocks), gpu
        if len(gpu):  # an empty job finished at submission: nothing to wait for
            self._loads_this_step.append(job_id)
            self._load_reads.add(job_id, cpu)

    def start_tier_ops(self, tiers: Sequence[TierOps]) -> None:
        """Check every lower tier's ops, hand each its writes of evicted blocks (all before any fetch or copy
        reuses the blocks), then its fetch (tier -> host pool; called by `start_load`)."""
        ios, limit = [self._tier_io(ops) for ops in tiers], self._require_pool().num_blocks
        for ops in tiers:
            ids = np.asarray(ops.fetch_cpu_blocks, np.int64)
            if len(ids) != len(ops.fetch_keys) or not self._ids.valid_destinations(ids, limit):
                raise WorkerInvariantError(f"{ops.tier} fetch event {ops.fetch_event}: CPU blocks {ids.tolist()[:32]} "
                                           f"must be distinct, in [1, {limit}), one per key (scheduler bug)")
        for ops, io in zip(tiers, ios, strict=True):
            if ops.write_cpu_blocks:
                io.write(ops.write_cpu_blocks, ops.write_keys)
        for ops, io in zip(tiers, ios, strict=True):
            if ops.fetch_event is not None:
                io.submit_fetch(ops.fetch_event, ops.fetch_cpu_blocks, ops.fetch_keys)

    def _tier_io(self, ops: TierOps) -> TierIO:
        if (io := self.tier_ios.get(ops.tier)) is None:
            raise WorkerInvariantError(f"{ops.tier} tier operations, but this worker has no {ops.tier!r} tier "
                                       f"(it has: {sorted(self.tier_ios) or 'none'}; scheduler bug)")
        return io

    def start_store(self, meta: TransferMetadata) -> None:
        """Issue this step's store (KV cache -> host pool); call after the forward wrote the blocks."""
        if meta.store_event is None:
            return
        gpu, cpu = self._checked_ids("store", meta.store_event, meta.store_gpu_blocks, meta.store_cpu_blocks)
        if self.shared_pool is not None and not self.shared_pool.stores:
            gpu, cpu = gpu[:0], cpu[:0]  # rank 0 copies into the pool every rank maps: done at once here
        after: tuple[int, ...] = ()
        if meta.store_after_load:
            if meta.load_event is None:
                raise WorkerInvariantError(f"store event {meta.store_event} must follow this step's load, but "
                                           "the step has no load event (scheduler bug)")
            after = tuple(j for j in self._loads_this_step if j in self._jobs)
        unordered = tuple(j for j in self._load_reads.readers(cpu) if j not in after)
        if unordered:
            self._hold_for_loads(meta.store_event, cpu, unordered)
            after += unordered
        job_id = self._submit("store", meta.store_event, gpu, cpu, (), after)
        writers = tuple(self._tier_io(ops) for ops in meta.tiers if ops.write_stored)
        if writers and job_id in self._jobs:
            self._jobs[job_id].tier_writes = (writers, cpu, list(meta.store_keys))

    def _hold_for_loads(self, store_event: int, cpu: np.ndarray, load_job_ids: tuple[int, ...]) -> None:
        """A store the metadata sends into host blocks that these loads in flight still read, without
        ordering it after them: a scheduler bug that would load the store's bytes. Counted and logged; the
        caller orders the store after those loads."""
        self.num_stores_held_for_loads += 1
        events = sorted({self._jobs[j].event_id for j in load_job_ids})
        logger.warning("offload: store event %d writes host blocks that load events %s still read; it starts "
                       "after them (scheduler bug; %d host blocks: %s)", store_event, events, len(cpu),
                       cpu[:16].tolist())

    def _checked_ids(self, kind: JobKind, event_id: int, src: Sequence[int], dst: Sequence[int]
                     ) -> tuple[np.ndarray, np.ndarray]:
        if self._closed:
            raise WorkerClosedError(f"{kind} event {event_id} after shutdown()")
        num_cpu, num_gpu = self._require_pool().num_blocks, self._num_gpu_blocks
        limits = (num_cpu, num_gpu) if kind == "load" else (num_gpu, num_cpu)
        return self._ids.checked(kind, event_id, src, dst, *limits)

    def _submit(self, kind: JobKind, event_id: int, src: np.ndarray, dst: np.ndarray,
                load_reqs: tuple[str, ...], after: tuple[int, ...] = ()) -> int:
        job_id = next(self._job_ids)
        self._jobs[job_id] = JobRecord(kind, event_id, len(dst), time.perf_counter(), load_reqs)
        if len(dst) == 0:
            self._instant.append(JobResult(job_id, finished_at=time.perf_counter()))
            return job_id
        try:
            self.backend.submit(CopyJob(job_id, kind, event_id, src, dst, after))
        except BaseException:
            del self._jobs[job_id]  # a failed submission leaves state unchanged
            raise
        return job_id

    # ---- completions --------------------------------------------------------------------------------
    def get_finished(self, wait_for_loads: bool | None = None) -> WorkerReport:
        """Everything that finished since the previous call; with `wait_for_loads` (default: the backend's
        `sync_loads`) first wait for this step's loads."""
        if wait_for_loads is None:
            wait_for_loads = self.backend.sync_loads
        if wait_for_loads and self._loads_this_step:
            waiting = [j for j in self._loads_this_step if j in self._jobs]
            if waiting:
                self.backend.wait(waiting, timeout=self._time_to_deadline(waiting))
        self._loads_this_step = []
        results, self._instant = self._instant + self.backend.poll(), []
        self.backend.end_step()
        report = WorkerReport(rank=self.rank)
        bytes_per_block = self._pool.bytes_per_block if self._pool is not None else 0
        for r in results:
            rec = self._jobs.pop(r.job_id, None)
            if rec is None:
                raise WorkerInvariantError(f"backend reported job {r.job_id}, which is not in flight (our bug)")
            if rec.kind == "load":
                self._load_reads.remove(r.job_id)  # its copies are over (an expired one's too, only now)
            seconds = max(0.0, r.finished_at - rec.submitted_at)
            if r.path:
                report.jobs_by_path[r.path] = report.jobs_by_path.get(r.path, 0) + 1
            if rec.expired:  # reported failed at its deadline; its copy is over only now
                report.ended_load_events.append(rec.event_id)
            elif rec.kind == "load":
                report.finished_load_reqs.extend(rec.load_reqs)
                report.failed_load_gpu_blocks.extend(r.failed_dst_ids)
                if len(r.failed_dst_ids):
                    report.failed_load_reqs.extend(failed_requests(rec, r.failed_dst_ids))
                report.bytes_loaded += (rec.num_blocks - len(r.failed_dst_ids)) * bytes_per_block
                report.load_seconds += seconds
            elif r.ok:
                report.completed_store_events.append(rec.event_id)
                report.bytes_stored += rec.num_blocks * bytes_per_block
                report.store_seconds += seconds
                if rec.tier_writes is not None:
                    writers, cpu, keys = rec.tier_writes
                    for io in writers:
                        io.write(cpu, keys)
            else:
                report.failed_store_events.append(rec.event_id)
        if self.load_timeout_s is not None:
            self.num_load_timeouts += expire_loads(self._jobs.values(), self.load_timeout_s, report)
        if self.tier_ios:
            report.tiers = [t for t in (io.take_report() for io in self.tier_ios.values()) if not t.is_empty]
        return report

    def _time_to_deadline(self, job_ids: Sequence[int]) -> float | None:
        """Seconds until the first of these jobs reaches the load deadline (0 if one has), None: no deadline."""
        if self.load_timeout_s is None:
            return None
        first = min(self._jobs[j].submitted_at for j in job_ids)
        return max(0.0, first + self.load_timeout_s - time.perf_counter())

    def wait_all(self) -> None:
        """Block until every submitted job has finished (results stay queued for get_finished); with the
        lower tiers, also every fetch and queued write (each bounded by the tier's own timeouts)."""
        self.backend.wait(None)
        for io in self.tier_ios.values():
            io.wait_idle()

    def shutdown(self) -> None:
        """Stop the backend: running copies finish, queued ones fail. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self.backend.shutdown()
        if self.shared_pool is not None:
            self.shared_pool.unlink()  # normally gone since start-up
        for io in self.tier_ios.values():
            io.close()

