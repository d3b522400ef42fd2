"""CUDA transfer backend: one load stream, one store stream, event fences, batched submission.

Every CUDA call goes through the `CudaRuntime` seam (cuda_api.py): `TorchCudaRuntime` on a GPU, the
simulated device (`cuda_sim.SimCudaRuntime`) in tests, where a missing fence is an integrity error.

Per engine step (vLLM 0.32 order; docs/worker.md has the diagram):
1. `begin_step()` (bind_connector_metadata, before the forward is launched) records `step_fence` on the
   compute stream: the work that may still read blocks this step's loads overwrite (vLLM #47282).
2. The forward is launched on the compute stream.
3. `submit(load)`: the load stream waits for `step_fence` only, so the load overlaps this step's forward
   (which never reads a block being loaded: those requests wait).
4. `submit(store)`: a fence recorded *now* on the compute stream, after the forward that wrote the blocks
   (vLLM #45704); the store stream waits for it, and for the completion event of each job in `job.after`
   (this step's load, when the store writes host blocks that load reads). Stores have their own stream, so a load the engine
   needs never queues behind a large store (it asks for the lowest priority: in practice CUDA's
   default, which the compute stream has too).
5. `poll()` queries completion events and never blocks; the engine thread never waits for a load
   (`sync_loads = False`): a request resumes in the step after its load completed.

Submission: one call per job. Where the job's segments (copy_plan: one per run and plane) would average at
most `kernel_max_segment_bytes` (scattered blocks of per-layer chunks: vLLM's usual case), or would number
more than `DMA_MAX_SEGMENTS` (each is work for the driver and for numpy on the engine thread), one launch of
the block-copy kernel: it reads the direction's plane table (fixed at bind) and the job's block ids (written
into a registered host ring, released in stream order when the job completes) and finds every chunk
itself, so the host's work is O(blocks), never O(blocks x layers). Otherwise (long runs, big chunks) one
`memcpy_batch` of the segments (or, where the driver lacks it, one `memcpy` per segment).
Host pool: pinned synchronously in `bind` (registration ranges from host_pool: page aligned, <= 64 GiB),
on the engine's thread with the KV cache's device current. If pinning fails the pool stays pageable: one
warning, `num_pin_failures` counts it, and copies fall back to staged per-segment `memcpy`; the engine runs.
Invariants: `_inflight[kind]` holds the submitted, unreported jobs of that stream in submission order;
each job's result is returned once; ring space is released only after the job's completion event fired.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from worker_side.arg_ring import ArgRing
from worker_side.backend import CopyJob, JobKind, JobResult, TransferBackend
from worker_side.block_layout import TensorBlockView
from worker_side.copy_plan import CopyGeometry
from worker_side.cuda_api import CudaError, CudaRuntime, Event, Stream
from worker_side.errors import BackendError, WorkerClosedError, WorkerInvariantError
from worker_side.host_memory import allocate_host_buffer
from worker_side.host_pool import HostPool

logger = logging.getLogger(__name__)

KERNEL_MAX_SEGMENT_BYTES = 64 << 10  # not yet tuned on a GPU: see docs/worker.md
DMA_MAX_SEGMENTS = 1024  # more segments than this cost the driver (and numpy) more than one kernel launch
RING_ENTRIES = 1 << 16  # int64 block ids per stream (a job takes 2 per block)
WAIT_POLL_S = 0.0002  # a bounded wait for loads polls their events this often


@dataclass(slots=True)
class _InFlight:
    job: CopyJob
    done: Event
    ring_entries: int
    error: str | None = None


class CudaBackend(TransferBackend):
    name = "cuda"
    sync_loads = False

    def __init__(self, num_streams: int = 2, runtime: CudaRuntime | None = None,
                 kernel_max_segment_bytes: int = KERNEL_MAX_SEGMENT_BYTES, ring_entries: int = RING_ENTRIES) -> None:
        if runtime is None:
            from worker_side.cuda_runtime import TorchCudaRuntime

            runtime = TorchCudaRuntime()  # BackendError without a CUDA device
        self.rt = runtime
        self.num_streams = max(1, num_streams)
        self.kernel_max_segment_bytes = kernel_max_segment_bytes
        self._ring_entries = ring_entries
        self._device: int | None = None
        self._geometry: dict[JobKind, CopyGeometry] = {}
        self._streams: dict[JobKind, Stream] = {}
        self._rings: dict[JobKind, ArgRing] = {}
        self._plane_tables: dict[JobKind, int] = {}  # registered (num_planes, 5) tables, per direction
        self._inflight: dict[JobKind, deque[_InFlight]] = {"load": deque(), "store": deque()}
        self._job_ids: set[int] = set()
        self._events: list[Event] = []  # reusable events
        self._step_fence: Event | None = None
        self._registered: list[int] = []  # host pointers we pinned, unpinned at shutdown
        self.pinned = False
        self.num_pin_failures = 0
        self.num_copy_calls = 0  # memcpy / memcpy_batch / kernel-launch calls made
        self._closed = False

    # ---- binding ----------------------------------------------------------------------------------
    def _device_of_views(self, device_views: list[TensorBlockView]) -> int:
        devices = {self.rt.device_of(v.base_ptr, 1) for v in device_views}
        if len(devices) != 1 or None in devices:
            raise BackendError(f"the cuda backend needs KV tensors on one CUDA device; got devices {devices} "
                               "(None: host memory); allowed: transfer.backend cpu for host tensors")
        return devices.pop()  # type: ignore[return-value]

    def _use_device(self) -> None:
        """Make the KV cache's device current on the calling thread (a no-op when it already is)."""
        if self._device is not None and self.rt.get_device() != self._device:
            self.rt.set_device(self._device)

    def numa_node(self, device_views: list[TensorBlockView]) -> int | None:
        return self.rt.numa_node(self._device_of_views(device_views))

    def bind(self, device_views: list[TensorBlockView], pool: HostPool) -> None:
        self._device = self._device_of_views(device_views)
        self._use_device()
        rows = pool.rows_per_registration
        self._geometry = {"store": CopyGeometry.build(device_views, pool.views, rows),
                          "load": CopyGeometry.build(pool.views, device_views, rows, cut_src=True)}
        load_stream = self.rt.create_stream(low_priority=False)
        self._streams = {"load": load_stream,
                         "store": self.rt.create_stream(low_priority=True) if self.num_streams > 1 else load_stream}
        self.pinned = self._pin(pool.registration_ranges())
        if self.pinned and self.rt.supports_kernel and self.kernel_max_segment_bytes > 0:
            self._make_rings()

    def _pin(self, ranges: list[tuple[int, int]]) -> bool:
        try:
            for ptr, nbytes in ranges:
                self.rt.host_register(ptr, nbytes)
                self._registered.append(ptr)
        except CudaError as exc:
            self._unpin()
            self.num_pin_failures += 1
            logger.warning("offload host pool: pinning failed (%s); continuing with pageable memory: "
                           "copies are staged and slower. Check the memlock limit and free RAM.", exc)
            return False
        return True

    def _make_rings(self) -> None:
        """Registered host memory for the kernel's arguments: both plane tables, one id ring per stream."""
        kinds: tuple[JobKind, ...] = ("load", "store") if self.num_streams > 1 else ("load",)
        tables = {kind: self._geometry[kind].plane_table().ravel() for kind in ("load", "store")}
        num_table = sum(len(t) for t in tables.values())
        memory = allocate_host_buffer(8 * (num_table + len(kinds) * self._ring_entries))
        try:
            self.rt.host_register(memory.data_ptr(), memory.numel())
        except CudaError as exc:
            logger.warning("offload: kernel arguments could not be pinned (%s); copying with DMA only", exc)
            return
        self._registered.append(memory.data_ptr())
        self._kernel_memory = memory  # keeps the tables and rings alive
        words = memory.numpy().view(np.int64)
        at = 0
        for kind, table in tables.items():
            words[at:at + len(table)] = table
            self._plane_tables[kind] = words[at:].ctypes.data
            at += len(table)
        for kind in kinds:
            self._rings[kind] = ArgRing(words[at:at + self._ring_entries])
            at += self._ring_entries
        if len(kinds) == 1:
            self._rings["store"] = self._rings["load"]

    # ---- steps and jobs -----------------------------------------------------------------------------
    def _event(self) -> Event:
        return self._events.pop() if self._events else self.rt.create_event()

    def begin_step(self) -> None:
        """Record the fence this step's loads wait on: all compute launched before this step's forward."""
        if self._closed or self._device is None:
            return
        self._use_device()
        if self._step_fence is None:
            self._step_fence = self._event()
        self.rt.record_event(self._step_fence, self.rt.compute_stream())

    def end_step(self) -> None:
        if self._step_fence is not None:
            self._events.append(self._step_fence)  # its waits are enqueued: safe to re-record
            self._step_fence = None

    def _fence(self, kind: JobKind, stream: Stream) -> None:
        """Make `stream` wait for the compute `kind` must follow (see the module docstring)."""
        if kind == "load" and self._step_fence is not None:
            self.rt.wait_event(stream, self._step_fence)
            return
        fence = self._event()  # a store, or a load outside begin_step/end_step: everything launched so far
        self.rt.record_event(fence, self.rt.compute_stream())
        self.rt.wait_event(stream, fence)
        self._events.append(fence)  # the wait is enqueued: safe to re-record

    def submit(self, job: CopyJob) -> None:
        if self._closed or self._device is None:
            raise WorkerClosedError(f"job {job.job_id}: cuda backend closed or not bound")
        if job.job_id in self._job_ids:
            raise WorkerInvariantError(f"job id {job.job_id} submitted twice (our bug)")
        self._use_device()
        stream = self._streams[job.kind]
        self._fence(job.kind, stream)
        self._wait_for_jobs(job.after, stream)
        error, used = None, 0
        try:
            used = self._enqueue(job, stream)
        except CudaError as exc:
            error = str(exc)
        done = self._event()
        self.rt.record_event(done, stream)
        self._inflight[job.kind].append(_InFlight(job, done, used, error))
        self._job_ids.add(job.job_id)

    def _wait_for_jobs(self, job_ids: tuple[int, ...], stream: Stream) -> None:
        """Make `stream` wait for the completion events of these jobs still in flight (a store into host
        blocks a load still reads). O(jobs in flight) per job named."""
        for job_id in job_ids:
            for queue in self._inflight.values():
                earlier = next((f for f in queue if f.job.job_id == job_id), None)
                if earlier is not None:
                    self.rt.wait_event(stream, earlier.done)
                    break

    def _enqueue(self, job: CopyJob, stream: Stream) -> int:
        """Submit the job's copies; returns the ring entries it holds until it completes."""
        geometry, ring = self._geometry[job.kind], self._rings.get(job.kind)
        src_ids, dst_ids = job.src_ids, job.dst_ids
        runs = geometry.runs(src_ids, dst_ids)
        if ring is not None and self._kernel_suits(geometry, len(src_ids), len(runs[2])):
            args = ring.write(src_ids, dst_ids)
            if args is not None:  # None: the ring is full; this job goes by DMA below
                self.rt.launch_block_copy(self._plane_tables[job.kind], geometry.num_planes, args[0], len(src_ids),
                                          stream)
                self.num_copy_calls += 1
                return args[1]
        segs = geometry.segments(src_ids, dst_ids, runs)
        if self.pinned and self.rt.supports_batch:
            self.rt.memcpy_batch(segs.dst, segs.src, segs.nbytes, stream)
            self.num_copy_calls += 1
            return 0
        for d, s, n in zip(segs.dst.tolist(), segs.src.tolist(), segs.nbytes.tolist(), strict=True):
            self.rt.memcpy(d, s, n, stream, pageable=not self.pinned)
            self.num_copy_calls += 1
        return 0

    def _kernel_suits(self, geometry: CopyGeometry, num_blocks: int, num_runs: int) -> bool:
        """Would the job's DMA segments be many, or average at most `kernel_max_segment_bytes`?"""
        if self.kernel_max_segment_bytes <= 0:
            return False
        num_segments = geometry.num_segments(num_blocks, num_runs)
        total = num_blocks * geometry.bytes_per_block
        return num_segments > DMA_MAX_SEGMENTS or total <= self.kernel_max_segment_bytes * num_segments

    # ---- completions --------------------------------------------------------------------------------
    def _finish(self, kind: JobKind) -> JobResult:
        f = self._inflight[kind].popleft()
        self._job_ids.discard(f.job.job_id)
        self._events.append(f.done)
        if f.ring_entries:
            self._rings[kind].release(f.ring_entries)
        failed = tuple(int(i) for i in f.job.dst_ids) if f.error else ()
        return JobResult(f.job.job_id, failed, f.error, time.perf_counter())

    def poll(self) -> list[JobResult]:
        if self._device is None:
            return []
        self._use_device()
        out = []
        for kind, queue in self._inflight.items():
            while queue and self.rt.query_event(queue[0].done):  # a stream completes in order
                out.append(self._finish(kind))
        return out

    def wait(self, job_ids: Collection[int] | None = None, timeout: float | None = None) -> None:
        if self._device is None:
            return
        self._use_device()
        events = [f.done for queue in self._inflight.values() for f in queue
                  if job_ids is None or f.job.job_id in job_ids]
        if timeout is None:
            for event in events:
                self.rt.synchronize_event(event)
            return
        deadline = time.perf_counter() + timeout  # a bounded wait polls: CUDA has no timed event wait
        while not all(self.rt.query_event(e) for e in events) and time.perf_counter() < deadline:
            time.sleep(WAIT_POLL_S)

    def shutdown(self) -> None:
        """Let every submitted copy finish (CUDA cannot cancel them), then unpin. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._device is None:
            return
        self._use_device()
        for stream in {id(s): s for s in self._streams.values()}.values():
            self.rt.synchronize_stream(stream)
        self._unpin()

    def _unpin(self) -> None:
        for ptr in self._registered:
            self.rt.host_unregister(ptr)
        self._registered = []
