"""CUDA transfer backend: a load stream and a store stream (each with a helper), event fences, three paths.

Every CUDA call goes through the `CudaRuntime` seam (api.py): `TorchCudaRuntime` (runtime.py) on a GPU, the
simulated device (worker_side/testing/cuda_sim.py) in tests, where a missing fence is an integrity error.
This class binds to the KV cache and coordinates three parts, each owning its state:
- `fences` (fences.py): the step fence and the event pool; loads wait for the compute launched before
  this step's forward, stores for everything launched before them;
- `paths` (copy_paths.py): how a job's copies are issued (staged through a GPU ring (staging.py), one direct
  kernel launch, batched memcpy calls, or one memcpy per segment), with the copy geometry, the kernels'
  arguments, each direction's helper DMA stream and the staging ring;
- `_jobs` (inflight.py): the submitted, unreported jobs per direction, in submission order.

Per engine step (vLLM 0.32 order; docs/worker.md has the diagram): `begin_step()` before the forward is
launched; `submit(load)` on the load stream, which overlaps this step's forward; `submit(store)` on the
store stream (a staged store's gathers on the staging kernel stream), after the forward that wrote the blocks and after the completion of each job in `job.after`
(this step's load, when the store writes host blocks that load reads); `poll()` queries completion events
and never blocks (`sync_loads = False`): a request resumes in the step after its load completed. Stores have
their own stream, so a load the engine needs never queues behind a large store (it asks for the lowest
priority: in practice CUDA's default, which the compute stream has too). `submit` never raises for a failed
copy: a driver error of any kind (CudaError, or an error code the bindings cannot name) makes the job fail,
and its result says so; only our own invariant errors propagate.
Binding: the KV cache's device is taken from the tensors (`tensor_device`) and made current before any
driver call, so no context appears on another GPU. The kernels run only where the pool is pinned, the
device lets kernels read registered host memory at its host address (`can_use_host_pointer`) and the
runtime has them (`supports_kernel`); the direct kernel only where the configuration allows it
(`kernel_off_reason`), the staged path only where its ring could be had (`staged_off_reason`); each says
why not in one start-up line. The host pool's layout (`host_layout`) is `blocks` where staging is on or the
cache is block-outermost. With `calibrate`, a short calibration (calibration.py) then picks the policy for
this device; one line names the paths in force and the staging ring.
Host pool: pinned synchronously in `bind` (registration ranges from host_pool: page aligned, <= 64 GiB),
on the engine's thread with the KV cache's device current. If pinning fails the pool stays pageable: one
warning, `num_pin_failures` counts it, and every copy is a staged per-segment `memcpy` issued by a copy
thread of its own (pageable_copier.py: such a copy blocks its caller), on one stream; the engine runs.
Invariants: each job's result is returned once; ring space is released only after the job's completion
event fired; an event is reused only once nothing enqueued or pending refers to it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection

from worker_side.backends.base import CopyJob, JobKind, JobResult, TransferBackend
from worker_side.backends.cuda.api import CudaError, CudaRuntime, Stream
from worker_side.backends.cuda.calibration import calibrate_on_device
from worker_side.backends.cuda.copy_paths import CopyPaths, PartialSubmission, kernels_unusable
from worker_side.backends.cuda.fences import StepFences
from worker_side.backends.cuda.helper_stream import Helper
from worker_side.backends.cuda.host_pins import HostPins
from worker_side.backends.cuda.inflight import InFlight, InFlightJobs
from worker_side.backends.cuda.kernel_policy import KERNEL_MAX_SEGMENT_BYTES, KERNEL_MAX_SMS, KernelPolicy
from worker_side.backends.cuda.pageable_copier import PageableCopier, Ticket
from worker_side.backends.cuda.staging import STAGED_MAX_CTAS
from worker_side.block_layout import TensorBlockView
from worker_side.copy_plan import CopyGeometry
from worker_side.errors import BackendError, WorkerClosedError, WorkerInvariantError
from worker_side.host_pool import BLOCKS, PLANES, HostPool, merges_across_tensors

logger = logging.getLogger(__name__)

RING_ENTRIES = 1 << 16  # int64 block ids per stream (a job takes 2 per block)
WAIT_POLL_S = 0.0002  # a bounded wait for loads polls their events this often


class CudaBackend(TransferBackend):
    name = "cuda"
    sync_loads = False

    def __init__(self, num_streams: int = 2, runtime: CudaRuntime | None = None,
                 kernel_max_segment_bytes: int = KERNEL_MAX_SEGMENT_BYTES, ring_entries: int = RING_ENTRIES,
                 kernel_directions: Collection[JobKind] = ("load", "store"), kernel_min_segments: int = 1,
                 kernel_max_sms: int = KERNEL_MAX_SMS, calibrate: bool = False, staging_bytes: int = 0,
                 staged_max_ctas: int = STAGED_MAX_CTAS) -> None:
        """Constructed directly (tests, benchmarks) the kernel may take either direction from one segment
        on and nothing is staged; `make_backend` passes the configuration's values (the defaults: staged
        both ways, no direct kernel, calibrated). `kernel_max_sms` caps the grid of a runtime this backend
        creates (a given runtime keeps its own); `staged_max_ctas` the staged kernel's grid."""
        self._owns_runtime = runtime is None
        if runtime is None:
            from worker_side.backends.cuda.runtime import TorchCudaRuntime

            runtime = TorchCudaRuntime(kernel_max_sms=kernel_max_sms)  # BackendError without a CUDA device
        self.rt = runtime
        self.num_streams = max(1, num_streams)
        self.staging_bytes = staging_bytes
        self.staged_max_ctas = staged_max_ctas
        self.policy = KernelPolicy.make(kernel_directions, kernel_max_segment_bytes, kernel_min_segments,
                                        ("load", "store") if staging_bytes > 0 else ())
        self.calibrate = calibrate
        self.fences = StepFences(runtime)
        self.paths = CopyPaths(runtime, self.fences)
        self._jobs = InFlightJobs()
        self._ring_entries = ring_entries
        self._device: int | None = None
        self._streams: dict[JobKind, Stream] = {}
        self._pins = HostPins(runtime)  # the pool's ranges and the kernels' arguments, unpinned at shutdown
        self._copier: PageableCopier | None = None  # the pool is pageable: copies go through its thread
        self.pinned = False
        self.num_pin_failures = 0
        self.num_failed_submissions = 0  # jobs whose copies could not be submitted (reported failed)
        self.kernel_off_reason: str | None = None  # why the direct kernel is not used (None: it is, per policy)
        self.staged_off_reason: str | None = None  # why the staged path is not used (None: it is, per policy)
        self.calibration: list = []  # calibration.Measurement of the start-up calibration, if it ran
        self._closed = False

    @property
    def num_copy_calls(self) -> int:
        """memcpy / memcpy_batch / kernel-launch calls made so far (copy_paths.py)."""
        return self.paths.num_copy_calls

    @property
    def num_jobs_by_path(self) -> dict[str, int]:
        """Submitted jobs by the path they took: kernel, batch, per_segment or pageable."""
        return self.paths.num_jobs_by_path

    @property
    def kernel_max_segment_bytes(self) -> int:
        """The largest average segment the kernel takes, over directions (0: the kernel takes nothing)."""
        return max((r.max_segment_bytes for r in self.policy.rules.values()), default=0)

    @kernel_max_segment_bytes.setter
    def kernel_max_segment_bytes(self, value: int) -> None:
        """Every direction with a rule (or both, when none has one) gets this bound; 0 turns the kernel off."""
        kinds = list(self.policy.rules) or ["load", "store"]
        min_segments = min((r.min_segments for r in self.policy.rules.values()), default=1)
        self.policy = KernelPolicy.make(kinds, value, min_segments, self.policy.staged)

    # ---- binding ----------------------------------------------------------------------------------
    def _resolve_device(self, device_views: list[TensorBlockView]) -> int:
        """The KV tensors' device, made current *before* any driver call (which runs in, and may create, the
        current device's context), then checked against the driver."""
        hints = {self.rt.tensor_device(v.tensor) for v in device_views}
        if len(hints) != 1 or None in hints:
            raise BackendError(f"the cuda backend needs KV tensors on one CUDA device; got devices {hints} "
                               "(None: host memory); allowed: transfer.backend cpu for host tensors")
        self._device = hints.pop()
        self._use_device()
        devices = {self.rt.device_of(v.base_ptr, 1) for v in device_views}
        if devices != {self._device}:
            raise BackendError(f"the KV tensors say device {self._device} but the driver places their memory on "
                               f"{devices} (None: host memory); allowed: KV tensors in one CUDA device's memory")
        return self._device

    def _use_device(self) -> None:
        """Make the KV cache's device current on the calling thread (a no-op when it already is)."""
        if self._device is not None and self.rt.get_device() != self._device:
            self.rt.set_device(self._device)

    def numa_node(self, device_views: list[TensorBlockView]) -> int | None:
        return self.rt.numa_node(self._resolve_device(device_views))

    def host_layout(self, device_views: list[TensorBlockView]) -> str:
        """`blocks` (each CPU block one range) where the staged path is configured and its kernel can run here,
        or where the engine's blocks are contiguous across tensors (their chunks merge: vLLM's block-outermost
        layouts); else `planes`, where DMA moves a run of blocks as one segment per chunk."""
        if merges_across_tensors(device_views):
            return BLOCKS
        if self.staging_bytes > 0 and kernels_unusable(self.rt, self._resolve_device(device_views)) is None:
            return BLOCKS
        return PLANES

    def bind(self, device_views: list[TensorBlockView], pool: HostPool) -> None:
        device = self._resolve_device(device_views)
        rows = pool.rows_per_registration
        self.paths.geometry = {"store": CopyGeometry.build(device_views, pool.views, rows),
                               "load": CopyGeometry.build(pool.views, device_views, rows, cut_src=True)}
        self.pinned = self._pin(pool.registration_ranges())
        load_stream = self.rt.create_stream(low_priority=False)
        separate = self.num_streams > 1 and self.pinned  # pageable: one copy thread, one stream, `after` by order
        self._streams = {"load": load_stream,
                         "store": self.rt.create_stream(low_priority=True) if separate else load_stream}
        if not self.pinned:
            self._copier = PageableCopier(self.rt, device)
        elif separate:  # a second DMA stream per direction (copy_paths.dma, staging.py)
            self.paths.helpers = {kind: Helper.make(self.rt, low_priority=kind == "store") for kind in ("load", "store")}
        unusable = "the host pool is not pinned" if not self.pinned else kernels_unusable(self.rt, device)
        wanted = bool(self.policy.rules) or self.staging_bytes > 0
        if unusable is None and wanted:
            unusable = self.paths.add_kernel_args(self._pins, self._streams["store"] is self._streams["load"],
                                                  self._ring_entries)
        self.kernel_off_reason = ("transfer.kernel_directions is empty or transfer.kernel_max_segment_bytes is 0"
                                  if not self.policy.rules else unusable)
        self.staged_off_reason = ("transfer.staging_bytes is 0" if self.staging_bytes <= 0 else
                                  f"its kernel cannot run here: {unusable}" if unusable is not None else
                                  self.paths.add_staging(device_views, pool, self.staging_bytes,
                                                         self.staged_max_ctas))
        if self.kernel_off_reason is not None:
            log = logger.info if not self.policy.rules else logger.warning
            log("offload: direct block-copy kernel off on device %d: %s", device, self.kernel_off_reason)
            self.policy = KernelPolicy({}, self.policy.staged)
        if self.staged_off_reason is not None:
            log = logger.info if self.staging_bytes <= 0 else logger.warning
            log("offload: staged copies off on device %d: %s", device, self.staged_off_reason)
            self.policy = self.policy.without_staged()
        if self.calibrate and (self.policy.rules or self.policy.staged):
            self._calibrate(device, min(v.num_blocks for v in device_views), pool.num_blocks)
        logger.info("offload: copy paths on device %d: %s%s", device, self.policy.describe(), self.paths.staging_line())

    def _pin(self, ranges: list[tuple[int, int]]) -> bool:
        try:
            self._pins.pin(ranges)
        except CudaError as exc:
            self.num_pin_failures += 1
            logger.warning("offload host pool: pinning failed (%s); continuing with pageable memory: "
                           "copies are staged and slower. Check the memlock limit and free RAM.", exc)
            return False
        return True

    def _calibrate(self, device: int, num_device_blocks: int, num_host_blocks: int) -> None:
        """Adopt the policy this device measures faster (calibration.py); on any failure keep the configured
        one. Runs before any request; waits for every copy it made."""
        t0 = time.perf_counter()
        try:
            self.policy, self.calibration = calibrate_on_device(self.rt, self.paths, self.fences, self.policy,
                                                                self._streams["load"], num_device_blocks,
                                                                num_host_blocks)
        except Exception as exc:  # a device we cannot time: the configured policy stays
            logger.warning("offload: calibration on device %d failed (%s: %s); keeping %s", device,
                           type(exc).__name__, exc, self.policy.describe())
            return
        logger.info("offload: calibrated on device %d in %.0f ms over %d shapes", device,
                    (time.perf_counter() - t0) * 1e3, len(self.calibration))

    # ---- steps and jobs -----------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Record the fence this step's loads wait on: all compute launched before this step's forward."""
        if self._closed or self._device is None:
            return
        self._use_device()
        self.fences.begin_step()

    def end_step(self) -> None:
        self.fences.end_step()

    def submit(self, job: CopyJob) -> None:
        if self._closed or self._device is None:
            raise WorkerClosedError(f"job {job.job_id}: cuda backend closed or not bound")
        if job.job_id in self._jobs:
            raise WorkerInvariantError(f"job id {job.job_id} submitted twice (our bug)")
        self._use_device()
        stream = done_stream = self._streams[job.kind]
        entry = InFlight(job, None, 0)
        try:
            if self._copier is not None:
                self.fences.order(job.kind, stream)
                entry.done = self.fences.event()
                segs = self.paths.segments(job.kind, job.src_ids, job.dst_ids)
                entry.ticket = self._copier.submit(segs, stream, entry.done, self._jobs.done_events(job.after))
                self.paths.num_jobs_by_path["pageable"] += 1
                entry.path = "pageable"
            else:  # the path places the job's fence (copy_paths.py)
                self._wait_for_jobs(job.after, stream)
                entry.ring_entries, done_stream, entry.path = self.paths.enqueue(job, stream, self.policy)
        except WorkerInvariantError:
            raise
        except Exception as exc:  # CudaError, or what the bindings raise for a code they cannot name
            if isinstance(exc, PartialSubmission):  # copies enqueued before the error still read their ids
                entry.ring_entries, exc = exc.entries, exc.cause
            entry.error = f"{type(exc).__name__}: {exc}"
            self.num_failed_submissions += 1
            logger.warning("offload: %s job %d (%d blocks) failed at submission: %s", job.kind, job.job_id,
                           job.num_blocks, entry.error)
        if entry.ticket is None:
            self._record_done(entry, done_stream)
        self._jobs.add(entry)

    def _wait_for_jobs(self, job_ids: tuple[int, ...], stream: Stream) -> None:
        """Make `stream` wait for the completion events of these jobs still in flight (a store into host
        blocks a load still reads)."""
        for event in self._jobs.done_events(job_ids):
            self.rt.wait_event(stream, event)

    def _record_done(self, entry: InFlight, stream: Stream) -> None:
        """Record the job's completion event; where even that fails, wait for the stream here instead, so the
        job is never reported while its copies may still run."""
        try:
            if entry.done is None:
                entry.done = self.fences.event()
            self.rt.record_event(entry.done, stream)
        except Exception as exc:
            entry.error = entry.error or f"{type(exc).__name__}: {exc}"
            entry.ticket = Ticket(error=entry.error)
            try:
                self.rt.synchronize_stream(stream)
            except Exception:
                pass
            entry.ticket.issued.set()

    # ---- completions --------------------------------------------------------------------------------
    def _finish(self, f: InFlight) -> JobResult:
        self.fences.reuse(f.done)
        if f.ring_entries:
            self.paths.release(f.job.kind, f.ring_entries)  # the job completed: the kernel has read its ids
        error = f.error or (f.ticket.error if f.ticket is not None else None)
        failed = tuple(int(i) for i in f.job.dst_ids) if error else ()
        return JobResult(f.job.job_id, failed, error, time.perf_counter(), path=f.path)

    def _complete(self, f: InFlight) -> bool:
        return f.issued() and self.rt.query_event(f.done)

    def poll(self) -> list[JobResult]:
        if self._device is None:
            return []
        self._use_device()
        return [self._finish(f) for f in self._jobs.completed(self._complete)]  # a stream completes in order

    def wait(self, job_ids: Collection[int] | None = None, timeout: float | None = None) -> None:
        if self._device is None:
            return
        self._use_device()
        waiting = self._jobs.select(job_ids)
        if timeout is None:
            for f in waiting:
                if f.ticket is not None:
                    f.ticket.issued.wait()
                self.rt.synchronize_event(f.done)
            return
        deadline = time.perf_counter() + timeout  # a bounded wait polls: CUDA has no timed event wait
        while not all(self._complete(f) for f in waiting) and time.perf_counter() < deadline:
            time.sleep(WAIT_POLL_S)

    def shutdown(self) -> None:
        """Let every submitted copy finish (CUDA cannot cancel them), then unpin and release the runtime's
        contexts (when this backend created the runtime). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._device is None:
            return
        if self._copier is not None:
            self._copier.close()
        self._use_device()
        streams = [*self._streams.values(), *(h.stream for h in self.paths.helpers.values()),
                   *(self.paths.staged.streams if self.paths.staged else ())]
        for stream in {id(s): s for s in streams}.values():
            self.rt.synchronize_stream(stream)
        self._pins.release()
        if self._owns_runtime:
            self.rt.close()
