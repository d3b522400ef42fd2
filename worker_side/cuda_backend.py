"""CUDA transfer backend: low-priority copy streams, event fences, a host pool pinned in place.

- Host pool: `torch.empty` of exactly the requested bytes, pinned with `cudaHostRegister` in 1 GiB chunks on a
  background thread (torch's `pin_memory` would round up to a power of two); the first submission waits for
  pinning to finish.
- Ordering: every job first waits on an event recorded on the compute stream at submission. A store (issued
  after the forward) therefore reads its blocks only after the compute that wrote them; a load writes its
  destination blocks only after every earlier kernel that might still read them (vLLM #45704, #47282).
- Copies: the shared copy plan (copy_plan.build_segments) submitted as one `cudaMemcpyAsync` per coalesced
  segment on a pooled stream, followed by a completion event; `poll()` queries events, never blocks.
Importing this module needs no CUDA; constructing `CudaBackend` without a device raises `BackendError`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection
from dataclasses import dataclass

import torch

from worker_side.backend import CopyJob, JobResult, TransferBackend
from worker_side.block_layout import TensorBlockView
from worker_side.copy_plan import build_segments
from worker_side.errors import BackendError, WorkerClosedError, WorkerInvariantError


@dataclass(slots=True)
class _InFlight:
    job: CopyJob
    done: torch.cuda.Event
    error: str | None = None


class CudaBackend(TransferBackend):
    name = "cuda"

    def __init__(self, num_streams: int = 2) -> None:
        if not torch.cuda.is_available():
            raise BackendError("the cuda transfer backend needs a CUDA device; allowed here: transfer.backend cpu")
        self.num_streams = max(1, num_streams)
        self._streams: list[torch.cuda.Stream] = []
        self._events: list[torch.cuda.Event] = []  # reusable events
        self._inflight: dict[int, _InFlight] = {}
        self._device_views: list[TensorBlockView] | None = None
        self._host_views: list[TensorBlockView] = []
        self._pin_thread: threading.Thread | None = None
        self._pinned: list[tuple[int, int]] = []
        self._pin_error: BaseException | None = None
        self._host_buffer: torch.Tensor | None = None
        self._closed = False

    def allocate_host_pool(self, nbytes: int) -> torch.Tensor:
        from worker_side.cuda_runtime import host_register_chunks

        buffer = torch.empty(nbytes, dtype=torch.uint8)

        def pin() -> None:
            try:
                self._pinned = host_register_chunks(buffer.data_ptr(), nbytes)
            except BaseException as exc:  # reported on first use
                self._pin_error = exc

        self._host_buffer = buffer
        self._pin_thread = threading.Thread(target=pin, name="offload-pin", daemon=True)
        self._pin_thread.start()
        return buffer

    def bind(self, device_views: list[TensorBlockView], host_views: list[TensorBlockView]) -> None:
        devices = {v.tensor.device for v in device_views}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            raise BackendError(f"the cuda backend needs KV tensors on one CUDA device; got {sorted(map(str, devices))}")
        self._device = next(iter(devices))
        # priority 0 is the lowest CUDA stream priority (lower numbers run first)
        self._streams = [torch.cuda.Stream(self._device, priority=0) for _ in range(self.num_streams)]
        self._device_views, self._host_views = list(device_views), list(host_views)

    def _event(self) -> torch.cuda.Event:
        return self._events.pop() if self._events else torch.cuda.Event()

    def submit(self, job: CopyJob) -> None:
        from worker_side.cuda_runtime import memcpy_async_many

        if self._closed or self._device_views is None:
            raise WorkerClosedError(f"job {job.job_id}: cuda backend closed or not bound")
        if self._pin_thread is not None:
            self._pin_thread.join()
            self._pin_thread = None
        if self._pin_error is not None:  # every submit, not just the first: never copy from unpinned memory
            raise BackendError(f"pinning the host pool failed: {self._pin_error}")
        if job.job_id in self._inflight:
            raise WorkerInvariantError(f"job id {job.job_id} submitted twice (our bug)")
        src, dst = ((self._device_views, self._host_views) if job.kind == "store"
                    else (self._host_views, self._device_views))
        segs = build_segments(src, dst, job.src_ids, job.dst_ids)
        stream = self._streams[job.job_id % len(self._streams)]
        fence, done = self._event(), self._event()
        fence.record(torch.cuda.current_stream(self._device))
        stream.wait_event(fence)
        error = None
        try:
            memcpy_async_many(segs.dst.tolist(), segs.src.tolist(), segs.nbytes.tolist(), stream.cuda_stream)
        except RuntimeError as exc:
            error = str(exc)
        done.record(stream)
        self._events.append(fence)  # safe to re-record: the wait was already enqueued
        self._inflight[job.job_id] = _InFlight(job, done, error)

    def _result(self, job_id: int) -> JobResult:
        f = self._inflight.pop(job_id)
        self._events.append(f.done)
        failed = tuple(int(i) for i in f.job.dst_ids) if f.error else ()
        return JobResult(job_id, failed, f.error, time.perf_counter())

    def poll(self) -> list[JobResult]:
        return [self._result(j) for j in [j for j, f in self._inflight.items() if f.done.query()]]

    def wait(self, job_ids: Collection[int] | None = None) -> None:
        for j in list(self._inflight) if job_ids is None else job_ids:
            f = self._inflight.get(j)
            if f is not None:
                f.done.synchronize()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pin_thread is not None:
            self._pin_thread.join()
        for s in self._streams:
            s.synchronize()
        if self._pinned:
            from worker_side.cuda_runtime import host_unregister

            host_unregister(self._pinned)
            self._pinned = []
