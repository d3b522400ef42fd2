"""How the CUDA backend issues one job's copies: one block-copy kernel launch, or the copy engines (DMA).

A part of the CUDA backend (backend.py), on the engine thread with the KV cache's device current. It owns
the copy geometry of each direction (`CopyGeometry`, fixed at bind) and, where the kernel is on, the
kernel's registered arguments (kernel_args.py: the plane tables and one block-id ring per stream).
`enqueue(job, stream, policy)` takes the path `policy` (kernel_policy.py) picks from the job's segments:
- "kernel": one launch, which reads the direction's plane table and the job's block ids (written into the
  ring, held until the job completed: the backend gives them back with `release`) and finds every chunk
  itself, so the host's work is O(blocks), never O(blocks x layers); a full ring sends the job by DMA;
- "batch": one `memcpy_batch` of the job's segments; "per_segment": one `memcpy` per segment, where the
  driver lacks the batched call.
`num_copy_calls` counts the launches and memcpy calls made, `num_jobs_by_path` the path each job took (the
backend counts "pageable" jobs, which its copy thread issues). A driver error propagates to the backend,
which fails the job; a launch that raises keeps no ring entries (kernel_args.py).
"""

from __future__ import annotations

import numpy as np

from worker_side.backends.base import CopyJob, JobKind
from worker_side.backends.cuda.api import CudaRuntime, Stream
from worker_side.backends.cuda.arg_ring import ArgRing
from worker_side.backends.cuda.kernel_args import KernelArgs
from worker_side.backends.cuda.kernel_policy import KernelPolicy
from worker_side.copy_plan import CopyGeometry, Segments
from worker_side.errors import WorkerInvariantError

PATHS = ("kernel", "batch", "per_segment", "pageable")


class CopyPaths:
    def __init__(self, rt: CudaRuntime) -> None:
        self.rt = rt
        self.geometry: dict[JobKind, CopyGeometry] = {}  # set at bind
        self.kernel_args: KernelArgs | None = None  # set at bind, where the kernel is on
        self.num_copy_calls = 0  # memcpy / memcpy_batch / kernel-launch calls made (engine thread)
        self.num_jobs_by_path = dict.fromkeys(PATHS, 0)  # the path each submitted job took

    @property
    def rings(self) -> dict[JobKind, ArgRing]:
        """The kernel's argument ring per direction (empty where the kernel is off)."""
        return self.kernel_args.rings if self.kernel_args is not None else {}

    def release(self, kind: JobKind, num_entries: int) -> None:
        """Give back the ring entries of a `kind` job that completed (the kernel has read its ids)."""
        self.rings[kind].release(num_entries)

    def segments(self, kind: JobKind, src_ids: np.ndarray, dst_ids: np.ndarray) -> Segments:
        return self.geometry[kind].segments(src_ids, dst_ids)

    def enqueue(self, job: CopyJob, stream: Stream, policy: KernelPolicy) -> int:
        """Submit the job's copies by the policy's path; returns the ring entries it holds until it completes."""
        geometry = self.geometry[job.kind]
        src_ids, dst_ids = job.src_ids, job.dst_ids
        runs = geometry.runs(src_ids, dst_ids)
        num_segments = geometry.num_segments(len(src_ids), len(runs[2]))
        if job.kind in self.rings and policy.use_kernel(job.kind, num_segments,
                                                        len(src_ids) * geometry.bytes_per_block):
            entries = self.launch(job.kind, src_ids, dst_ids, stream)
            if entries is not None:  # None: the ring is full; this job goes by DMA below
                self.num_jobs_by_path["kernel"] += 1
                return entries
        self.num_jobs_by_path[self.dma(job.kind, src_ids, dst_ids, runs, stream)] += 1
        return 0

    def issue(self, kind: JobKind, path: str, src_ids: np.ndarray, dst_ids: np.ndarray, stream: Stream) -> int:
        """One calibration job by `path` ("kernel" | "dma"); the ring entries it holds."""
        if path == "kernel":
            entries = self.launch(kind, src_ids, dst_ids, stream)
            if entries is None:
                raise WorkerInvariantError("calibration: the argument ring is full while nothing else runs (our bug)")
            return entries
        self.dma(kind, src_ids, dst_ids, self.geometry[kind].runs(src_ids, dst_ids), stream)
        return 0

    def launch(self, kind: JobKind, src_ids: np.ndarray, dst_ids: np.ndarray, stream: Stream) -> int | None:
        """One kernel launch (kernel_args.py): the ring entries it holds, None when the ring is full."""
        if self.kernel_args is None:
            raise WorkerInvariantError(f"{kind} job: kernel launch with the kernel off (our bug)")
        entries = self.kernel_args.launch(kind, src_ids, dst_ids, stream)
        if entries is not None:
            self.num_copy_calls += 1
        return entries

    def dma(self, kind: JobKind, src_ids: np.ndarray, dst_ids: np.ndarray,
            runs: tuple[np.ndarray, np.ndarray, np.ndarray], stream: Stream) -> str:
        """The job's segments by the copy engines: one batched call, or one call per segment. Its path."""
        segs = self.geometry[kind].segments(src_ids, dst_ids, runs)
        if self.rt.supports_batch:
            self.rt.memcpy_batch(segs.dst, segs.src, segs.nbytes, stream)
            self.num_copy_calls += 1
            return "batch"
        for d, s, n in zip(segs.dst.tolist(), segs.src.tolist(), segs.nbytes.tolist(), strict=True):
            self.rt.memcpy(d, s, n, stream)
            self.num_copy_calls += 1
        return "per_segment"
