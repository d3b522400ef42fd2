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
   (vLLM #45704); the store stream waits for it. Stores have their own low-priority stream, so a load the
   engine needs never queues behind a large store.
5. `poll()` queries completion events and never blocks; the engine thread never waits for a load
   (`sync_loads = False`): a request resumes in the step after its load completed.

Submission: the job's segments (copy_plan, one per run and plane) go out as at most two calls: segments up
to `kernel_max_segment_bytes` as one launch of the segment-copy kernel (its `(dst, src, nbytes)` table
written into a registered host ring, released in stream order when the job completes), the rest as one
`memcpy_batch` (or, where the driver lacks it, one `memcpy` per segment).
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

from worker_side.backend import CopyJob, JobKind, JobResult, TransferBackend
from worker_side.block_layout import TensorBlockView
from worker_side.copy_plan import CopyGeometry, Segments
from worker_side.cuda_api import CudaError, CudaRuntime, Event, Stream
from worker_side.errors import BackendError, WorkerClosedError, WorkerInvariantError
from worker_side.host_memory import allocate_host_buffer
from worker_side.host_pool import HostPool
from worker_side.segment_ring import SegmentRing

logger = logging.getLogger(__name__)

KERNEL_MAX_SEGMENT_BYTES = 32 << 10  # not yet tuned on a GPU: see docs/worker.md
RING_ENTRIES = 1 << 16  # (dst, src, nbytes) triples per stream


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
        self._rings: dict[JobKind, SegmentRing] = {}
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
        kinds: tuple[JobKind, ...] = ("load", "store") if self.num_streams > 1 else ("load",)
        tables = allocate_host_buffer(len(kinds) * self._ring_entries * 24)
        try:
            self.rt.host_register(tables.data_ptr(), tables.numel())
        except CudaError as exc:
            logger.warning("offload: segment tables could not be pinned (%s); copying with DMA only", exc)
            return
        self._registered.append(tables.data_ptr())
        entries = tables.numpy().view(np.int64).reshape(len(kinds), -1, 3)
        for i, kind in enumerate(kinds):
            self._rings[kind] = SegmentRing(entries[i])
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
        segs = self._geometry[job.kind].segments(job.src_ids, job.dst_ids)
        stream = self._streams[job.kind]
        self._fence(job.kind, stream)
        error, used = None, 0
        try:
            used = self._enqueue(segs, stream, self._rings.get(job.kind))
        except CudaError as exc:
            error = str(exc)
        done = self._event()
        self.rt.record_event(done, stream)
        self._inflight[job.kind].append(_InFlight(job, done, used, error))
        self._job_ids.add(job.job_id)

    def _enqueue(self, segs: Segments, stream: Stream, ring: SegmentRing | None) -> int:
        """Submit the segments; returns the ring entries the job holds until it completes."""
        if len(segs) == 0:
            return 0
        if not self.pinned:
            for d, s, n in zip(segs.dst.tolist(), segs.src.tolist(), segs.nbytes.tolist(), strict=True):
                self.rt.memcpy(d, s, n, stream, pageable=True)
                self.num_copy_calls += 1
            return 0
        used = 0
        if ring is not None:
            small = segs.nbytes <= self.kernel_max_segment_bytes
            count = int(np.count_nonzero(small))
            table = ring.write(segs.dst[small], segs.src[small], segs.nbytes[small]) if count else None
            if table is not None:  # None: the ring is full; these segments go by DMA below
                table_ptr, used = table
                self.rt.launch_segment_copy(table_ptr, count, stream)
                self.num_copy_calls += 1
                segs = Segments(segs.dst[~small], segs.src[~small], segs.nbytes[~small])
        if len(segs) == 0:
            return used
        if self.rt.supports_batch:
            self.rt.memcpy_batch(segs.dst, segs.src, segs.nbytes, stream)
            self.num_copy_calls += 1
        else:
            for d, s, n in zip(segs.dst.tolist(), segs.src.tolist(), segs.nbytes.tolist(), strict=True):
                self.rt.memcpy(d, s, n, stream)
                self.num_copy_calls += 1
        return used

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

    def wait(self, job_ids: Collection[int] | None = None) -> None:
        if self._device is None:
            return
        self._use_device()
        for queue in self._inflight.values():
            for f in list(queue):
                if job_ids is None or f.job.job_id in job_ids:
                    self.rt.synchronize_event(f.done)

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
