"""The start-up calibration: time every available copy path on this device, then pick the policy.

Run once by the CUDA backend at bind (`register_kv_caches`), before any request, where
`transfer.calibrate` is on and a kernel path is available, on this model's own blocks (the job shapes it
produces). Each job is timed with timing events (from one recorded before it to one recorded after its
last copy, on whatever streams it uses), best of `REPS`, each waited for before the next.

The direct kernel, for each direction the configuration lets it take (kernel_policy.py), one job of each
shape both ways (kernel and DMA):
- segment size: runs of 1, 2, 4, ... blocks (each run one segment per plane where the layout coalesces);
  `max_segment_bytes` becomes the largest average segment size up to which the kernel was faster at every
  size measured; where it was slower even at the smallest, the direction goes to DMA only;
- segment count: 1, 2, 4, ... scattered blocks; `min_segments` becomes the smallest count from which the
  kernel was faster at every count measured (the size sweep's own count where none was).
The staged path, for each direction it may take: scattered jobs of 1, 4, 16, ... blocks up to one that fills
`STAGED_SLOTS` staging slots (its pipeline's steady state; at most `STAGED_JOB_BYTES`), staged and by the
direct policy just chosen (kernel rule or DMA); `staged[kind]` becomes the smallest count from which staged
was faster (or within `STAGED_TIE`: see `StagedMeasurement.staged_wins`) at every count measured, and where
it was slower at the largest the direction is not staged.
Budget: each timed job moves at most `JOB_BYTES`; at most about 150 jobs in all, tens of milliseconds on a
GPU. The jobs copy engine blocks 1..M to host blocks 1..M and back, pairing block i with block i, and the
first copy is a store of all of them: every later load writes back the bytes the block already holds, so
the KV cache is as it was (the host blocks are free: the scheduler has handed none out yet).
This module decides; the backend times (`TimeJob`). It never raises for a slow or odd device: the worst
result is "DMA only", which is what the copy engines did before the kernel existed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from worker_side.backends.base import JobKind
from worker_side.backends.cuda.api import CudaRuntime, Stream
from worker_side.backends.cuda.kernel_policy import KernelPolicy, KernelRule
from worker_side.copy_plan import CopyGeometry

if TYPE_CHECKING:
    from worker_side.backends.cuda.copy_paths import CopyPaths
    from worker_side.backends.cuda.fences import StepFences

RUN_LENGTHS = (1, 2, 4, 8, 16, 32)
BLOCK_COUNTS = (1, 2, 4, 8, 16, 32)
JOB_BYTES = 16 << 20
REPS = 3

STAGED_SLOTS = 8  # the staged path's largest calibration job fills this many slots: the pipeline's steady state
STAGED_JOB_BYTES = 64 << 20  # and moves at most this much
STAGED_TIE = 0.05
KERNEL_CALIBRATION_BLOCKS = 2 * max(RUN_LENGTHS)
TimeJob = Callable[[JobKind, str, np.ndarray, np.ndarray], float]  # (kind, "staged" | "kernel" | "dma", ...) -> s


@dataclass(frozen=True, slots=True)
class Measurement:
    kind: JobKind
    num_blocks: int
    num_segments: int
    avg_segment_bytes: int
    kernel_s: float
    dma_s: float

    @property
    def kernel_wins(self) -> bool:
        return self.kernel_s < self.dma_s


@dataclass(frozen=True, slots=True)
class StagedMeasurement:
    kind: JobKind
    num_blocks: int
    staged_s: float
    direct_s: float
    direct_path: str  # "kernel" or "dma": what the job takes when not staged

    @property
    def staged_wins(self) -> bool:
        """Staged was faster, or within `STAGED_TIE` of the direct path: a tie goes to staging, whose host
        work per job is a few calls per chunk where DMA's is about 1 us per segment (a 64-block store of a
        32-layer cache: 0.7 ms of the engine thread staged, 2.6 ms by DMA, on an H200 host)."""
        return self.staged_s <= self.direct_s * (1 + STAGED_TIE)


def num_calibration_blocks(num_device_blocks: int, num_host_blocks: int, bytes_per_block: int,
                           slot_blocks: int = 0) -> int:
    """M: blocks 1..M on both sides, enough for two runs of the longest run length within the budget, and
    with a staging ring of `slot_blocks`-block slots for scattered jobs of `STAGED_SLOTS` slots (every other
    block of 1..M) within `STAGED_JOB_BYTES`."""
    budget = max(2, 2 * JOB_BYTES // max(1, bytes_per_block))
    m = min(2 * max(RUN_LENGTHS), budget)
    if slot_blocks:
        m = max(m, 2 * min(STAGED_SLOTS * slot_blocks, max(1, STAGED_JOB_BYTES // max(1, bytes_per_block))))
    return max(0, min(num_device_blocks - 1, num_host_blocks - 1, m))


def _runs_of(ids: np.ndarray, run: int) -> np.ndarray:
    """Every other run of `run` consecutive ids: runs of `run` blocks with gaps between them."""
    return ids[((ids - 1) // run) % 2 == 0]


def _measure(kind: JobKind, geometry: CopyGeometry, ids: np.ndarray, time_job: TimeJob) -> Measurement:
    runs = geometry.runs(ids, ids)
    segments = geometry.num_segments(len(ids), len(runs[2]))
    total = len(ids) * geometry.bytes_per_block
    best = {path: min(time_job(kind, path, ids, ids) for _ in range(REPS)) for path in ("kernel", "dma")}
    return Measurement(kind, len(ids), segments, total // max(1, segments), best["kernel"], best["dma"])


def rule_from(sizes: list[Measurement], counts: list[Measurement]) -> KernelRule | None:
    """The rule the measurements support (see the module docstring), or None: DMA only."""
    by_size = sorted(sizes, key=lambda m: m.avg_segment_bytes)
    if not by_size or not by_size[0].kernel_wins:
        return None
    max_bytes = by_size[0].avg_segment_bytes
    for m in by_size[1:]:
        if not m.kernel_wins:
            break
        max_bytes = m.avg_segment_bytes
    min_segments = by_size[0].num_segments
    for m in sorted(counts, key=lambda m: m.num_segments, reverse=True):
        if not m.kernel_wins:
            break
        min_segments = min(min_segments, m.num_segments)
    return KernelRule(max_bytes, min_segments)


def staged_from(measured: list[StagedMeasurement]) -> int | None:
    """The smallest block count from which the staged path was faster at every count measured (None: it
    lost at the largest)."""
    by_count = sorted(measured, key=lambda m: m.num_blocks, reverse=True)
    if not by_count or not by_count[0].staged_wins:
        return None
    min_blocks = by_count[0].num_blocks
    for m in by_count[1:]:
        if not m.staged_wins:
            break
        min_blocks = m.num_blocks
    return 1 if min_blocks == by_count[-1].num_blocks else min_blocks


def calibrate(policy: KernelPolicy, geometry: dict[JobKind, CopyGeometry], num_blocks: int,
              time_job: TimeJob) -> tuple[KernelPolicy, list[Measurement | StagedMeasurement]]:
    """Measure and return the policy for this device (directions without a kernel rule or staged entry in
    `policy` keep what they have)."""
    ids = np.arange(1, num_blocks + 1, dtype=np.int64)
    if num_blocks < 2 or not (policy.rules or policy.staged):
        return policy, []
    time_job("store", "dma", ids, ids)  # host blocks 1..M now hold engine blocks 1..M: loads write back the same
    policy, measured = _calibrate_kernel(policy, geometry, ids[:KERNEL_CALIBRATION_BLOCKS], time_job)
    scattered = _runs_of(ids, 1)
    counts = sorted({*(4 ** i for i in range(8) if 4 ** i < len(scattered)), len(scattered)})
    for kind in ("store", "load"):
        if kind not in policy.staged:
            continue
        direct = "kernel" if kind in policy.rules else "dma"
        rows = []
        for n in counts:
            job = scattered[:n]
            staged_s = min(time_job(kind, "staged", job, job) for _ in range(REPS))
            path = direct if direct == "dma" or policy.use_kernel(kind, geometry[kind].num_segments(
                n, len(geometry[kind].runs(job, job)[2])), n * geometry[kind].bytes_per_block) else "dma"
            direct_s = min(time_job(kind, path, job, job) for _ in range(REPS))
            rows.append(StagedMeasurement(kind, n, staged_s, direct_s, path))
        measured += rows
        policy = policy.with_staged(kind, staged_from(rows))
    return policy, measured


def _calibrate_kernel(policy: KernelPolicy, geometry: dict[JobKind, CopyGeometry], ids: np.ndarray,
                      time_job: TimeJob) -> tuple[KernelPolicy, list[Measurement]]:
    """The direct kernel's rules (see the module docstring)."""
    num_blocks = len(ids)
    measured: list[Measurement] = []
    for kind in ("store", "load"):  # stores first (see above)
        if kind not in policy.rules:
            continue
        sizes, seen = [], set()
        for run in RUN_LENGTHS:
            if 2 * run > num_blocks:
                break
            job = _runs_of(ids, run)
            m = _measure(kind, geometry[kind], job, time_job)
            if m.avg_segment_bytes not in seen:  # a layout that never coalesces gives one size only
                seen.add(m.avg_segment_bytes)
                sizes.append(m)
        scattered = _runs_of(ids, 1)
        counts = [_measure(kind, geometry[kind], scattered[:n], time_job)
                  for n in BLOCK_COUNTS if n <= len(scattered)]
        measured += sizes + counts
        policy = policy.with_rule(kind, rule_from(sizes, counts))
    return policy, measured


class JobTimer:
    """Times one job at a time with a pair of timing events; `time_job` is a `TimeJob`.

    `issue(kind, path, src_ids, dst_ids, stream)` enqueues the job (its copies on `stream`, and for the
    staged path also on the staging kernel streams, which wait for the start event first) and returns the
    kernel-argument entries it holds and the stream its end is recorded on; the entries are given back
    (`release(kind, entries)`) once the job is waited for, or by `release_held` after a failure, once the
    caller waited for the streams."""

    def __init__(self, rt: CudaRuntime, stream: Stream,
                 issue: Callable[[JobKind, str, np.ndarray, np.ndarray, Stream], tuple[int, Stream]],
                 release: Callable[[JobKind, int], None], other_streams: Sequence[Stream] = ()) -> None:
        self.rt, self.stream, self._issue, self._release = rt, stream, issue, release
        self.other_streams = list(other_streams)
        self.start, self.end = rt.create_event(timing=True), rt.create_event(timing=True)
        self._held: list[tuple[JobKind, int]] = []

    def time_job(self, kind: JobKind, path: str, src_ids: np.ndarray, dst_ids: np.ndarray) -> float:
        self.rt.record_event(self.start, self.stream)
        for stream in self.other_streams:
            self.rt.wait_event(stream, self.start)
        entries, end_stream = self._issue(kind, path, src_ids, dst_ids, self.stream)
        if entries:
            self._held.append((kind, entries))
        self.rt.record_event(self.end, end_stream)
        self.rt.synchronize_event(self.end)
        self.release_held()
        return self.rt.elapsed_s(self.start, self.end)

    def release_held(self) -> None:
        for kind, entries in self._held:
            self._release(kind, entries)
        self._held = []



def calibrate_on_device(rt: CudaRuntime, paths: CopyPaths, fences: StepFences, policy: KernelPolicy, stream: Stream,
                        num_device_blocks: int,
                        num_host_blocks: int) -> tuple[KernelPolicy, list[Measurement | StagedMeasurement]]:
    """Time the backend's available paths (`calibrate`), its jobs issued by `paths` on `stream` after whatever
    the engine launched so far; the policy and the measurements. Where the device cannot be timed, the error
    propagates once every copy made has finished and every argument entry is given back."""
    geometry, staged = paths.geometry, paths.staged
    num_blocks = num_calibration_blocks(num_device_blocks, num_host_blocks, geometry["load"].bytes_per_block,
                                        staged.plan.slot_blocks if staged is not None and policy.staged else 0)
    timer = JobTimer(rt, stream, paths.issue, paths.release, staged.streams if staged is not None else ())
    try:
        fences.order("store", stream)  # after whatever the engine launched so far
        return calibrate(policy, geometry, num_blocks, timer.time_job)
    except BaseException:
        for s in [stream, *timer.other_streams]:
            rt.synchronize_stream(s)
        timer.release_held()
        raise
