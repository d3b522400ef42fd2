"""How the CUDA backend issues one job's copies: staged, one block-copy kernel launch, or DMA.

A part of the CUDA backend (backend.py), on the engine thread with the KV cache's device current. It owns
the copy geometry of each direction (`CopyGeometry`, fixed at bind), where the kernels are on their
registered arguments (kernel_args.py: the plane tables and one block-id ring per stream), and where the
staging ring could be had the staged path (staging.py).
`enqueue(job, stream, policy)` takes the path `policy` (kernel_policy.py) picks:
- "staged": the job's block ids (GPU ids and staging-ring positions) into the argument ring, then one
  gather or scatter launch and one batched DMA call per chunk of the ring's slot size, the two overlapping
  across chunks (staging.py); a full argument ring sends the job by DMA;
- "kernel": one launch, which reads the direction's plane table and the job's block ids (written into the
  ring, held until the job completed: the backend gives them back with `release`) and finds every chunk
  itself, so the host's work is O(blocks), never O(blocks x layers); a full ring sends the job by DMA;
- "batch": `memcpy_batch` calls of at most `BATCH_SEGMENTS` segments (the first of `FIRST_BATCH`), taking
  turns on the direction's copy stream and its helper (`dma`); "per_segment": one `memcpy` per segment,
  where the driver lacks the batched call.
Each job gets one fence (fences.py `order`), placed by its path on the stream that must follow the compute:
a staged store's kernel stream, else `stream`. `num_copy_calls` counts the launches and memcpy calls made, `num_jobs_by_path` the path each job took (the
backend counts "pageable" jobs, which its copy thread issues). A driver error propagates to the backend,
which fails the job; a launch that raises keeps no ring entries (kernel_args.py).
"""

from __future__ import annotations

import numpy as np

from worker_side.backends.base import CopyJob, JobKind
from worker_side.backends.cuda.api import CudaError, CudaRuntime, Stream
from worker_side.backends.cuda.arg_ring import ArgRing
from worker_side.backends.cuda.fences import StepFences
from worker_side.backends.cuda.helper_stream import Helper
from worker_side.backends.cuda.host_pins import HostPins
from worker_side.backends.cuda.kernel_args import KernelArgs
from worker_side.backends.cuda.kernel_policy import KernelPolicy
from worker_side.backends.cuda.staging import StagedPath, StagingPlan
from worker_side.block_layout import TensorBlockView
from worker_side.copy_plan import CopyGeometry, Segments
from worker_side.errors import WorkerInvariantError
from worker_side.host_pool import BLOCKS, HostPool

FIRST_BATCH = 8  # segments in a job's first batched DMA call: the copy engines start after it returned
BATCH_SEGMENTS = 64  # segments in each further call


class PartialSubmission(Exception):
    """A job failed after some of its copies were enqueued: they hold `entries` argument-ring entries until
    the job's completion event (recorded after them) fires. `cause` is the driver's error."""

    def __init__(self, entries: int, cause: Exception) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.entries, self.cause = entries, cause


def kernels_unusable(rt: CudaRuntime, device: int) -> str | None:
    """Why `device` cannot run our kernels over a pinned pool, or None. The device attribute is checked before
    the runtime compiles anything."""
    if not rt.can_use_host_pointer(device):
        return ("CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM is 0: its kernels cannot read "
                "registered host memory at its host address")
    if not rt.supports_kernel:
        return rt.kernel_error or "the runtime has no block-copy kernel"
    return None


PATHS = ("staged", "kernel", "batch", "per_segment", "pageable")


class CopyPaths:
    def __init__(self, rt: CudaRuntime, fences: StepFences) -> None:
        self.rt, self.fences = rt, fences
        self.geometry: dict[JobKind, CopyGeometry] = {}  # set at bind
        self.kernel_args: KernelArgs | None = None  # set at bind, where the kernel is on
        self.staged: StagedPath | None = None  # set at bind, where the staging ring could be had
        self.helpers: dict[JobKind, Helper] = {}  # set at bind, where copies have streams of their own
        self.num_copy_calls = 0  # memcpy / memcpy_batch / kernel-launch calls made (engine thread)
        self.num_jobs_by_path = dict.fromkeys(PATHS, 0)  # the path each submitted job took

    def add_kernel_args(self, pins: HostPins, shared_stream: bool, ring_entries: int) -> str | None:
        """Pin the kernels' arguments (kernel_args.py, `pins` keeps the registration); why that failed, or None."""
        try:
            self.kernel_args = KernelArgs(self.rt, self.geometry, shared_stream, ring_entries)
        except CudaError as exc:
            return f"its arguments could not be pinned ({exc})"
        pins.keep(self.kernel_args.ptr)
        return None

    def add_staging(self, device_views: list[TensorBlockView], pool: HostPool, staging_bytes: int,
                    max_ctas: int) -> str | None:
        """Set up the staged path over a `blocks` pool (its ring allocated now); why it is off, or None."""
        if pool.layout != BLOCKS:
            return f"the host pool's layout is {pool.layout!r} (our bug: staging needs {BLOCKS!r})"
        plan = StagingPlan.fit(staging_bytes, pool.bytes_per_block)
        if isinstance(plan, str):
            return plan
        try:
            self.staged = StagedPath(self.rt, device_views, pool, plan, self.fences, max_ctas, self.helpers)
        except CudaError as exc:
            return f"its {plan.describe()} could not be had ({exc}); copies go by DMA"
        return None

    def staging_line(self) -> str:
        """What the start-up line says of the staging ring (empty without one)."""
        return "" if self.staged is None else f"; staging ring {self.staged.plan.describe()}"

    @property
    def rings(self) -> dict[JobKind, ArgRing]:
        """The kernel's argument ring per direction (empty where the kernel is off)."""
        return self.kernel_args.rings if self.kernel_args is not None else {}

    def release(self, kind: JobKind, num_entries: int) -> None:
        """Give back the ring entries of a `kind` job that completed (the kernel has read its ids)."""
        self.rings[kind].release(num_entries)

    def segments(self, kind: JobKind, src_ids: np.ndarray, dst_ids: np.ndarray) -> Segments:
        return self.geometry[kind].segments(src_ids, dst_ids)

    def enqueue(self, job: CopyJob, stream: Stream, policy: KernelPolicy) -> tuple[int, Stream, str]:
        """Submit the job's copies by the policy's path; returns the ring entries it holds until it completes,
        the stream to record its completion on (`stream`, except for a staged load) and the path (`PATHS`)."""
        if self.staged is not None and policy.use_staged(job.kind, len(job.src_ids)):
            staged = self.stage(job, stream)
            if staged is not None:  # None: the argument ring is full; this job goes another way
                self.num_jobs_by_path["staged"] += 1
                return (*staged, "staged")
        entries, path = self._enqueue_direct(job, stream, policy)
        return entries, stream, path

    def stage(self, job: CopyJob, stream: Stream) -> tuple[int, Stream] | None:
        """The job by the staged path: (ring entries held, completion stream), None when the ring is full.
        The staged path places the job's fence (staging.py)."""
        if self.staged is None or self.kernel_args is None:
            raise WorkerInvariantError(f"{job.kind} job: staged path without its ring or arguments (our bug)")
        ring = self.kernel_args.rings[job.kind]
        ids = self.staged.plan_job(job)
        written = ring.write(*self.staged.kernel_ids(job.kind, ids))
        if written is None:
            return None
        ptr, entries = written
        before = self.staged.num_chunks
        try:
            done_stream = self.staged.enqueue(job, ids, stream, ptr)
        except Exception as exc:
            if self.staged.num_chunks == before:  # no kernel was launched: nothing reads the ids
                ring.unwrite(entries)
                raise
            raise PartialSubmission(entries, exc) from exc  # launched kernels read the ids until the job ends
        finally:
            self.num_copy_calls += 2 * (self.staged.num_chunks - before)
        return entries, done_stream

    def _enqueue_direct(self, job: CopyJob, stream: Stream, policy: KernelPolicy) -> tuple[int, str]:
        self.fences.order(job.kind, stream)  # the job's one fence: every copy of it is on `stream`
        geometry = self.geometry[job.kind]
        src_ids, dst_ids = job.src_ids, job.dst_ids
        runs = geometry.runs(src_ids, dst_ids)
        num_segments = geometry.num_segments(len(src_ids), len(runs[2]))
        if job.kind in self.rings and policy.use_kernel(job.kind, num_segments,
                                                        len(src_ids) * geometry.bytes_per_block):
            entries = self.launch(job.kind, src_ids, dst_ids, stream)
            if entries is not None:  # None: the ring is full; this job goes by DMA below
                self.num_jobs_by_path["kernel"] += 1
                return entries, "kernel"
        path = self.dma(job.kind, src_ids, dst_ids, runs, stream)
        self.num_jobs_by_path[path] += 1
        return 0, path

    def issue(self, kind: JobKind, path: str, src_ids: np.ndarray, dst_ids: np.ndarray,
              stream: Stream) -> tuple[int, Stream]:
        """One calibration job by `path` ("staged" | "kernel" | "dma"): the ring entries it holds and the
        stream its end is recorded on."""
        if path == "staged":
            staged = self.stage(CopyJob(0, kind, 0, src_ids, dst_ids), stream)
            if staged is None:
                raise WorkerInvariantError("calibration: the argument ring is full while nothing else runs (our bug)")
            return staged
        if path == "kernel":
            entries = self.launch(kind, src_ids, dst_ids, stream)
            if entries is None:
                raise WorkerInvariantError("calibration: the argument ring is full while nothing else runs (our bug)")
            return entries, stream
        self.dma(kind, src_ids, dst_ids, self.geometry[kind].runs(src_ids, dst_ids), stream)
        return 0, stream

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
        """The job's segments by the copy engines: batched calls, or one call per segment. Its path.

        The driver starts a batched call's copies only once the call returned, and a call costs about 1 us
        per segment (measured on an H200 host): so the first call takes `FIRST_BATCH` segments and the others
        `BATCH_SEGMENTS` each, and where this direction has a helper stream the calls take turns on the two
        (two copy engines overlap their per-segment costs), joined to `stream` on both sides (helper_stream.py):
        to everyone else the job is on `stream`."""
        segs = self.geometry[kind].segments(src_ids, dst_ids, runs)
        rt = self.rt
        if not rt.supports_batch:
            for d, s, n in zip(segs.dst.tolist(), segs.src.tolist(), segs.nbytes.tolist(), strict=True):
                rt.memcpy(d, s, n, stream)
                self.num_copy_calls += 1
            return "per_segment"
        dst, src, nbytes = (a.astype(np.uint64) for a in (segs.dst, segs.src, segs.nbytes))
        cuts = [0, *range(min(FIRST_BATCH, len(nbytes)), len(nbytes), BATCH_SEGMENTS), len(nbytes)]
        helper = self.helpers.get(kind) if len(cuts) > 2 else None
        streams = [stream] if helper is None else [stream, helper.stream]
        if helper is not None:
            helper.follow(rt, stream)
        for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:], strict=True)):
            rt.memcpy_batch(dst[a:b], src[a:b], nbytes[a:b], streams[i % len(streams)])
            self.num_copy_calls += 1
        if helper is not None:
            helper.rejoin(rt, stream)
        return "batch"
