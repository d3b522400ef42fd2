"""The staged copy path: a job's blocks gathered on the GPU into a staging ring, the ring moved by DMA.

Part of the CUDA backend (backend.py, copy_paths.py). Why: the copy engines move a few large ranges at the
PCIe link's speed but pay per segment, and a layer-compact KV cache (vLLM's default layouts) cuts every block
into one small segment per layer and K/V (4-32 KiB); a kernel reading host memory from the SMs reaches the
link but takes SMs from the forward for the whole copy. Here a kernel touches device memory only (hundreds
of GB/s on a few thread blocks, so briefly), and the copy engines move whole host blocks (a `blocks` host
pool: each CPU block is one range).

A job's pairs are sorted by CPU block id (consecutive CPU blocks then share one DMA segment) and cut into
chunks of at most `slot_blocks` blocks; chunk c takes the direction's next slot (round robin over
`NUM_SLOTS`), and the chunks' DMAs take turns on the backend's copy stream and its helper (helper_stream.py),
so two copy engines overlap their per-segment costs while the kernel fills the next slots. A store:
  kernel stream: wait for the forward (the job's one fence, fences.py), wait until the slot is free (its
                 previous DMA completed: `slot_free`), gather the chunk's blocks into the slot, record
                 `slot_ready`;
  DMA stream:    wait `slot_ready`, DMA the slot into the host blocks, record `slot_free`.
The backend made its copy stream wait for the jobs in `job.after` (loads still reading host blocks this store
writes); the helper follows that, and the copy stream rejoins the helper at the end, where the backend
records the job's completion; the copy stream needs no fence of its own (its DMAs follow the gathers). A
load is the reverse, its one fence (the step fence) on the copy stream:
  DMA stream:    wait until the slot is free (its previous scatter completed), DMA host blocks into the
                 slot, record `slot_ready`;
  kernel stream: wait `slot_ready` (so, through the DMA, the step fence: work launched before this step's
                 forward may still read the GPU blocks), scatter the slot into the GPU blocks, record
                 `slot_free`.
It is done when the kernel stream passes its last chunk; only then may the compute stream read the blocks.
Host work per job is a fixed number of numpy calls (staged_plan.py), per chunk only the CUDA calls. What
runs before a job's first launch is kept short: the ids sorted and placed in the ring (the kernel's
arguments) and the fence; a store's first gather is launched before its DMA segments are planned (a load's
first DMA needs them).
Invariants: the ring (one device allocation: a ring per direction) and the plane tables (another) are
allocated at bind and never resized; a slot is never written before the copy that reads it completed; every
event here is permanent and re-recorded only after the waits on its previous record were enqueued; the
kernel's block ids live in the direction's argument ring (kernel_args.py) until the job completed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from offload_connector.sizing import format_bytes
from worker_side.backends.base import CopyJob, JobKind
from worker_side.backends.cuda.api import CudaRuntime, Event, Stream
from worker_side.backends.cuda.fences import StepFences
from worker_side.backends.cuda.helper_stream import Helper
from worker_side.backends.cuda.staged_plan import StagedDma, StagedIds, plan_dma, plan_ids
from worker_side.block_layout import TensorBlockView
from worker_side.copy_plan import CopyGeometry
from worker_side.errors import WorkerInvariantError
from worker_side.host_pool import BLOCKS, HostPool

NUM_SLOTS = 4  # per direction: two being copied (one per DMA stream) while the kernel fills the others
MAX_SLOT_BLOCKS = 1024  # the staged kernel's shared-memory id list (segment_copy.cu)
STAGED_MAX_CTAS = 16  # transfer.staging_max_sms: the staged kernel's grid (thread blocks of 8 warps)
PIECE_BYTES = 32 << 10  # the largest chunk one warp of the staged kernel copies (plane_table(max_piece))


@dataclass(frozen=True, slots=True)
class StagingPlan:
    """The ring's shape for this model: per direction `num_slots` slots of `slot_blocks` blocks."""
    bytes_per_block: int
    slot_blocks: int
    num_slots: int = NUM_SLOTS

    @property
    def ring_bytes(self) -> int:
        return self.num_slots * self.slot_blocks * self.bytes_per_block

    @staticmethod
    def fit(staging_bytes: int, bytes_per_block: int) -> StagingPlan | str:
        """The plan for `staging_bytes` of GPU memory (both directions), or why there is none."""
        slot_bytes = staging_bytes // (2 * NUM_SLOTS)
        if bytes_per_block <= 0 or slot_bytes < bytes_per_block:
            return (f"a block of {bytes_per_block:,} bytes does not fit one of the {2 * NUM_SLOTS} staging slots of "
                    f"transfer.staging_bytes={staging_bytes:,} (raise it to at least {2 * NUM_SLOTS * bytes_per_block:,})")
        return StagingPlan(bytes_per_block, min(MAX_SLOT_BLOCKS, slot_bytes // bytes_per_block))

    def describe(self) -> str:
        return (f"{format_bytes(2 * self.ring_bytes)} of GPU memory ({self.num_slots} slots of {self.slot_blocks} "
                f"blocks, {format_bytes(self.slot_blocks * self.bytes_per_block)} each, per direction)")


@dataclass(slots=True)
class _Ring:
    base_slot: int  # this direction's first block position in the ring views
    stream: Stream  # the kernel's stream (gathers for stores, scatters for loads)
    table_ptr: int  # the kernel's plane table (device memory)
    num_planes: int
    slot_ready: list[Event]
    slot_free: list[Event]
    helper: Helper | None  # the direction's second DMA stream (the backend's), or None
    free_recorded: list[bool] = field(default_factory=list)
    next_slot: int = 0


class StagedPath:
    """The staged path of one backend: its device memory, kernel streams and per-slot events."""

    def __init__(self, rt: CudaRuntime, device_views: Sequence[TensorBlockView], pool: HostPool, plan: StagingPlan,
                 fences: StepFences, max_ctas: int, helpers: dict[JobKind, Helper] | None = None) -> None:
        """Allocates the ring and uploads the plane tables (synchronously); a CudaError propagates, keeping
        nothing. `pool` must be a `blocks` pool. `helpers`: per direction a second DMA stream (the backend's,
        shared with its direct DMA path), or none."""
        if pool.layout != BLOCKS or plan.bytes_per_block != pool.bytes_per_block:
            raise WorkerInvariantError(f"staged path over a {pool.layout!r} pool of {pool.bytes_per_block}-byte blocks "
                                       f"with a plan for {plan.bytes_per_block}-byte blocks (our bug)")
        self.rt, self.plan, self.fences, self.max_ctas = rt, plan, fences, max_ctas
        ring_blocks = plan.num_slots * plan.slot_blocks  # per direction
        bpb = plan.bytes_per_block
        # ring positions [0, ring_blocks) are the store ring, [ring_blocks, 2 ring_blocks) the load ring
        self.ring = rt.alloc_device_bytes(2 * ring_blocks * bpb)
        ring_views = pool.views_at(self.ring, 2 * ring_blocks)
        tables = {"store": CopyGeometry.build(device_views, ring_views).plane_table(PIECE_BYTES),
                  "load": CopyGeometry.build(ring_views, device_views).plane_table(PIECE_BYTES)}
        self.tables = rt.alloc_device_bytes(tables["store"].nbytes + tables["load"].nbytes)
        table_at = {"store": self.tables.data_ptr(), "load": self.tables.data_ptr() + tables["store"].nbytes}
        self._upload_tables(tables, table_at["store"])
        self.rings: dict[JobKind, _Ring] = {}
        for i, kind in enumerate(("store", "load")):
            n = plan.num_slots
            self.rings[kind] = _Ring(i * ring_blocks, rt.create_stream(low_priority=False, high_priority=True),
                                     table_at[kind], len(tables[kind]), [rt.create_event() for _ in range(n)],
                                     [rt.create_event() for _ in range(n)], (helpers or {}).get(kind), [False] * n)
        self.bases = np.array([[pool.buffer.data_ptr()], [self.ring.data_ptr()]], np.int64)  # host pool, ring
        self.cut_rows = pool.rows_per_registration
        self.num_chunks = 0  # kernel launches (one per chunk)

    def _upload_tables(self, tables: dict[str, np.ndarray], device_ptr: int) -> None:
        """Copy both plane tables to device memory at `device_ptr`, through a registered host buffer (the
        seam's copies need one), and wait for it: this runs once, at bind."""
        from worker_side.host_memory import allocate_host_buffer

        host = np.concatenate([tables["store"].ravel(), tables["load"].ravel()])
        buffer = allocate_host_buffer(host.nbytes)
        buffer.numpy().view(np.int64)[:] = host
        self.rt.host_register(buffer.data_ptr(), buffer.numel())
        try:
            stream = self.rt.create_stream(low_priority=False)
            self.rt.memcpy(device_ptr, buffer.data_ptr(), host.nbytes, stream)
            self.rt.synchronize_stream(stream)
        finally:
            self.rt.host_unregister(buffer.data_ptr())

    @property
    def streams(self) -> list[Stream]:
        """The staged path's own streams: the kernel streams (high priority: a gather or scatter waits for
        free SMs behind no queued forward work)."""
        return [r.stream for r in self.rings.values()]

    def plan_job(self, job: CopyJob) -> StagedIds:
        """The job's blocks sorted by host id, in the slots the next `enqueue` of this direction takes (see
        staged_plan.py); call it right before that `enqueue`. Its DMA segments are planned by `enqueue`."""
        ring, store = self.rings[job.kind], job.kind == "store"
        host, gpu = (job.dst_ids, job.src_ids) if store else (job.src_ids, job.dst_ids)
        return plan_ids(host, gpu, ring.next_slot, self.plan.slot_blocks, self.plan.num_slots, ring.base_slot)

    @staticmethod
    def kernel_ids(kind: JobKind, ids: StagedIds) -> tuple[np.ndarray, np.ndarray]:
        """The kernel's (source, destination) block ids: GPU blocks into ring positions for a store, the
        reverse for a load. The argument ring holds them, source first, for the job's lifetime."""
        return (ids.gpu, ids.positions) if kind == "store" else (ids.positions, ids.gpu)

    def _plan_dma(self, ids: StagedIds) -> StagedDma:
        return plan_dma(ids, self.plan.slot_blocks, self.plan.bytes_per_block, self.bases, self.cut_rows)

    def enqueue(self, job: CopyJob, ids: StagedIds, copy_stream: Stream, args: int) -> Stream:
        """Submit the job's chunks in the slots `plan_job` planned; `args` is the address where the argument
        ring holds the `kernel_ids`. Returns the stream its completion is recorded on. Places the job's one
        fence (fences.py): on a store's kernel stream (the gathers read what the forward wrote), on a load's
        copy stream (each scatter follows its DMA). A CudaError propagates after the copy stream was made to
        wait for everything already enqueued."""
        ring, rt = self.rings[job.kind], self.rt
        try:
            if job.kind == "store":
                return self._enqueue_store(ring, ids, args, copy_stream)
            return self._enqueue_load(ring, ids, args, copy_stream)
        except BaseException:
            # chunks may be enqueued: the job's completion (recorded on `copy_stream` by the caller) must follow
            # them all, or a failed load would be reported while a scatter still writes
            for stream in (ring.stream, *([ring.helper.stream] if ring.helper is not None else [])):
                join = rt.create_event()
                rt.record_event(join, stream)
                rt.wait_event(copy_stream, join)
            raise

    def _enqueue_store(self, ring: _Ring, ids: StagedIds, args: int, copy_stream: Stream) -> Stream:
        """Per chunk: gather (kernel stream) then DMA (taking turns on the copy stream and its helper). Chunk 0's
        gather is launched before the DMA is planned: the copy engines wait for it anyway."""
        rt, k, num_slots, n = self.rt, self.plan.slot_blocks, self.plan.num_slots, ids.num_blocks
        num_chunks = -(-n // k)
        helper = ring.helper if num_chunks > 1 else None
        dma_streams = [copy_stream] if helper is None else [copy_stream, helper.stream]
        self.fences.order("store", ring.stream)  # the gathers read what the forward wrote
        dma: StagedDma | None = None
        for c in range(num_chunks):
            s, start = (ids.first_slot + c) % num_slots, c * k
            if ring.free_recorded[s]:
                rt.wait_event(ring.stream, ring.slot_free[s])
            rt.launch_staged_copy(ring.table_ptr, ring.num_planes, args + 8 * start, args + 8 * (n + start),
                                  min(k, n - start), ring.stream, self.max_ctas)
            self.num_chunks += 1
            rt.record_event(ring.slot_ready[s], ring.stream)
            if dma is None:  # after chunk 0's gather: plan the DMA, and start the helper after job.after
                dma = self._plan_dma(ids)
                if helper is not None:
                    helper.follow(rt, copy_stream)
            stream = dma_streams[c % len(dma_streams)]
            rt.wait_event(stream, ring.slot_ready[s])
            a, b = dma.bounds[c], dma.bounds[c + 1]
            self._copy(dma.host_addr[a:b], dma.ring_addr[a:b], dma.nbytes[a:b], stream)
            rt.record_event(ring.slot_free[s], stream)
            ring.free_recorded[s] = True
            ring.next_slot = (s + 1) % num_slots
        if helper is not None:
            helper.rejoin(rt, copy_stream)
        return copy_stream

    def _enqueue_load(self, ring: _Ring, ids: StagedIds, args: int, copy_stream: Stream) -> Stream:
        """Per chunk: DMA (taking turns on the copy stream and its helper) then scatter (kernel stream). The
        scatters need no fence of their own: each waits for its slot's DMA, which follows the job's fence."""
        rt, k, num_slots, n = self.rt, self.plan.slot_blocks, self.plan.num_slots, ids.num_blocks
        num_chunks = -(-n // k)
        helper = ring.helper if num_chunks > 1 else None
        dma_streams = [copy_stream] if helper is None else [copy_stream, helper.stream]
        dma = self._plan_dma(ids)
        self.fences.order("load", copy_stream)  # the step fence: work before this step may read the GPU blocks
        if helper is not None:
            helper.follow(rt, copy_stream)  # the fence (and any job.after) precedes the helper's DMAs too
        for c in range(num_chunks):
            s, start, stream = (ids.first_slot + c) % num_slots, c * k, dma_streams[c % len(dma_streams)]
            if ring.free_recorded[s]:
                rt.wait_event(stream, ring.slot_free[s])
            a, b = dma.bounds[c], dma.bounds[c + 1]
            self._copy(dma.ring_addr[a:b], dma.host_addr[a:b], dma.nbytes[a:b], stream)
            rt.record_event(ring.slot_ready[s], stream)
            rt.wait_event(ring.stream, ring.slot_ready[s])
            rt.launch_staged_copy(ring.table_ptr, ring.num_planes, args + 8 * start, args + 8 * (n + start),
                                  min(k, n - start), ring.stream, self.max_ctas)
            self.num_chunks += 1
            rt.record_event(ring.slot_free[s], ring.stream)
            ring.free_recorded[s] = True
            ring.next_slot = (s + 1) % num_slots
        return ring.stream

    def _copy(self, dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray, stream: Stream) -> None:
        if self.rt.supports_batch:
            self.rt.memcpy_batch(dst, src, nbytes, stream)
            return
        for d, s, nb in zip(dst.tolist(), src.tolist(), nbytes.tolist(), strict=True):
            self.rt.memcpy(d, s, nb, stream)
