"""Worker-side behaviours that no test pinned until mutation testing (docs/mutation.md) showed the gap.

Each test states a contract of the worker side (backend selection, pool and block bounds, copy plans over
mixed layouts, registration ranges, the CPU backend's results, the NUMA hint) and runs on any CPU machine.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import mmap
import os
import platform
import time

import numpy as np
import pytest
import torch

from offload_connector import load_config
from offload_connector.metadata import TransferMetadata
from worker_side import (
    BackendError,
    CpuBackend,
    HostPoolError,
    LayoutError,
    OffloadWorker,
    WorkerClosedError,
    WorkerInvariantError,
)
from worker_side.backends import cpu as cpu_backend
from worker_side.backends import select as backend_select
from worker_side.backends.base import CopyJob, JobResult
from worker_side.block_layout import tensor_block_view
from worker_side.copy_plan import CopyGeometry, coalesce_runs
from worker_side.host_memory import PAGE_BYTES, _mbind_preferred, allocate_host_buffer
from worker_side.host_pool import HostPool, check_pool_size, mem_available_bytes, rows_per_registration
from worker_side.testing.faults import FaultyBackend

NUM_GPU_BLOCKS = 16


def cpu_worker(num_cpu_blocks: int = 16, backend=None) -> OffloadWorker:
    return OffloadWorker(load_config({"num_cpu_blocks": num_cpu_blocks, "transfer": {"backend": "cpu"}}),
                         backend=backend)


def random_bytes(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)


# ---- backend selection ----------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the choice on a machine without CUDA")
def test_backend_names_without_cuda():
    assert backend_select.resolve_backend_name("auto") == "cpu"
    assert backend_select.resolve_backend_name("cpu") == "cpu"
    with pytest.raises(BackendError, match="torch sees no CUDA device"):
        backend_select.resolve_backend_name("cuda")
    with pytest.raises(BackendError, match="allowed: auto, cuda, cpu"):
        backend_select.resolve_backend_name("gpu")


class RecordingCudaBackend:
    def __init__(self, num_streams: int, **options) -> None:
        self.num_streams, self.options = num_streams, options


def test_backend_names_and_construction_with_cuda(monkeypatch):
    import worker_side.backends.cuda.backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(worker_side.backends.cuda.backend, "CudaBackend", RecordingCudaBackend)
    assert backend_select.resolve_backend_name("auto") == "cuda"
    assert backend_select.resolve_backend_name("cuda") == "cuda"
    assert backend_select.resolve_backend_name("cpu") == "cpu"
    for requested in ("auto", "cuda"):
        backend = backend_select.make_backend(load_config({"transfer": {"backend": requested, "num_streams": 3}}))
        assert isinstance(backend, RecordingCudaBackend) and backend.num_streams == 3
        assert backend.options == {"kernel_directions": ("load",), "kernel_max_segment_bytes": 28 << 10,
                                   "kernel_min_segments": 16, "kernel_max_sms": 12, "calibrate": True}
    transfer = {"backend": "cuda", "kernel_directions": ["store", "load"], "kernel_max_segment_bytes": "1MiB",
                "kernel_min_segments": 2, "kernel_max_sms": 4, "calibrate": False}
    backend = backend_select.make_backend(load_config({"transfer": transfer}))
    assert backend.options == {"kernel_directions": ("store", "load"), "kernel_max_segment_bytes": 1 << 20,
                               "kernel_min_segments": 2, "kernel_max_sms": 4, "calibrate": False}
    backend = backend_select.make_backend(load_config({"transfer": {"backend": "cpu", "num_streams": 3}}))
    assert isinstance(backend, CpuBackend) and backend.num_threads == 3
    backend.shutdown()


# ---- block ids at the edges -----------------------------------------------------------------------------
def test_block_reads_accept_every_row_and_refuse_the_one_past_the_end():
    w = cpu_worker(num_cpu_blocks=4)
    kv = {"l": random_bytes((NUM_GPU_BLOCKS, 64), 0)}
    w.register_kv_caches(kv)
    assert w.host_pool[0].numel() == 64  # the null block's row exists (never copied)
    assert w.host_pool[3].numel() == 64
    with pytest.raises(IndexError):
        w.host_pool[4]
    with pytest.raises(IndexError):
        w.host_pool[-1]
    view = tensor_block_view("l", kv["l"])
    assert torch.equal(view.block_tensor(0), kv["l"][0])
    assert torch.equal(view.block_tensor(NUM_GPU_BLOCKS - 1), kv["l"][-1])
    with pytest.raises(IndexError):
        view.block_tensor(NUM_GPU_BLOCKS)
    w.shutdown()


# ---- layouts ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape, num_gpu_blocks, layout, num_blocks, chunks, chunk_elems", [
    ((12, 4, 8), 12, None, 12, 1, 32),  # block-first, found by its size
    ((2, 5, 8), 2, None, 2, 1, 40),  # two blocks, and no K/V dim of 2 blocks after the first
    ((24, 12), 12, None, 12, 1, 24),  # kernel blocks: 2 rows per block, whatever the other dims hold
    ((2, 24, 8), 12, None, 12, 2, 16),  # K/V-first with kernel blocks
    ((2, 12, 8), 12, "kv_first", 12, 2, 8),  # K/V-first, 3D
])
def test_the_block_dim_is_found_from_the_block_count(shape, num_gpu_blocks, layout, num_blocks, chunks, chunk_elems):
    view = tensor_block_view("l", torch.zeros(shape), num_gpu_blocks, layout)
    assert (view.num_blocks, view.num_chunks, view.chunk_bytes) == (num_blocks, chunks, chunk_elems * 4)


@pytest.mark.parametrize("shape, num_gpu_blocks, layout, match", [
    ((2, 12), None, "kv_first", "kv_first needs shape"),  # a K/V dim, but nothing inside the blocks
    ((3, 12, 8), None, "kv_first", "kv_first needs shape"),
    ((7, 4), 5, None, "no block dim of size num_gpu_blocks=5"),
    ((2, 4, 8), 1, None, "is ambiguous"),  # both dims are multiples of one block
    ((2, 2, 8), 2, None, "is ambiguous"),  # two blocks, or K/V of two blocks
    ((12, 4), None, 42, "unknown KV cache layout hint 42"),  # neither a name nor an enum member
])
def test_layouts_that_cannot_be_told_apart_are_refused(shape, num_gpu_blocks, layout, match):
    with pytest.raises(LayoutError, match=match):
        tensor_block_view("l", torch.zeros(shape), num_gpu_blocks, layout)


# ---- registration ---------------------------------------------------------------------------------------
def test_cross_layer_cache_takes_the_given_block_count_and_is_block_first():
    # 1. kernel-block splitting: 2 rows per block when the engine says there are half as many blocks
    raw = random_bytes((2 * NUM_GPU_BLOCKS, 3, 8), 1)
    w = cpu_worker()
    w.register_cross_layer_kv_cache(raw, NUM_GPU_BLOCKS)
    assert w.num_gpu_blocks == NUM_GPU_BLOCKS and w.bytes_per_block == 2 * 3 * 8
    w.start_store(TransferMetadata(store_event=1, store_gpu_blocks=[5], store_cpu_blocks=[2]))
    w.wait_all()
    assert w.get_finished().completed_store_events == [1]
    assert torch.equal(w.host_pool[2], raw[10:12].reshape(-1))
    w.shutdown()
    # 2. two blocks whose first dim of 2 would read as K/V-first: cross-layer caches are block-first
    w = cpu_worker()
    w.register_cross_layer_kv_cache(random_bytes((2, 2, 4, 8), 2), 2)
    assert w.num_gpu_blocks == 2 and w.bytes_per_block == 2 * 4 * 8
    w.shutdown()


class StepCountingBackend(CpuBackend):
    def __init__(self) -> None:
        super().__init__(1)
        self.steps_begun = 0

    def begin_step(self) -> None:
        self.steps_begun += 1


def test_steps_reach_the_backend_only_between_registration_and_shutdown():
    backend = StepCountingBackend()
    w = cpu_worker(backend=backend)
    w.begin_step()  # 1. before registration: the backend has nothing bound yet
    assert backend.steps_begun == 0
    w.register_kv_caches({"l": random_bytes((NUM_GPU_BLOCKS, 64), 3)})
    w.begin_step()  # 2. registered: every step is fenced
    assert backend.steps_begun == 1
    w.shutdown()
    w.begin_step()  # 3. after shutdown: nothing more
    assert backend.steps_begun == 1


# ---- the worker's checks and reports -------------------------------------------------------------------
def test_refused_metadata_names_the_event_the_side_and_exactly_the_bad_ids():
    w = cpu_worker(num_cpu_blocks=8)
    w.register_kv_caches({"l": random_bytes((NUM_GPU_BLOCKS, 64), 10)})
    with pytest.raises(WorkerInvariantError, match=r"^store event 9: destination block ids \[0, 8\] outside \[1, 8\)"):
        w.start_store(TransferMetadata(store_event=9, store_gpu_blocks=[1, 2, 3], store_cpu_blocks=[1, 0, 8]))
    with pytest.raises(WorkerInvariantError, match=r"^load event 4: source block ids \[9\] outside \[1, 8\)"):
        w.start_load(TransferMetadata(load_event=4, load_gpu_blocks=[1], load_cpu_blocks=[9], load_event_reqs=["r"]))
    with pytest.raises(WorkerInvariantError, match=r"^store event 5: source block ids \[16\] outside \[1, 16\)"):
        w.start_store(TransferMetadata(store_event=5, store_gpu_blocks=[16], store_cpu_blocks=[1]))
    assert w.num_in_flight == 0
    w.shutdown()


def test_a_worker_polled_before_registration_reports_nothing():
    w = cpu_worker()
    w.begin_step()
    assert w.get_finished().is_empty and w.get_finished(wait_for_loads=True).is_empty
    w.shutdown()


class UnknownJobBackend(CpuBackend):
    def poll(self) -> list[JobResult]:
        return [JobResult(999)]


def test_a_backend_reporting_a_job_never_submitted_is_our_bug():
    w = cpu_worker(backend=UnknownJobBackend(1))
    w.register_kv_caches({"l": random_bytes((NUM_GPU_BLOCKS, 64), 11)})
    with pytest.raises(WorkerInvariantError, match="job 999, which is not in flight"):
        w.get_finished()
    w.shutdown()


def test_waiting_for_this_steps_loads_never_waits_for_a_store():
    # a held store would block forever: waiting for loads must not include it
    faulty = FaultyBackend(CpuBackend(1), hold=lambda job: job.kind == "store")
    w = cpu_worker(backend=faulty)
    w.register_kv_caches({"l": random_bytes((NUM_GPU_BLOCKS, 64), 12)})
    w.start_store(TransferMetadata(store_event=1, store_gpu_blocks=[1], store_cpu_blocks=[1]))
    w.start_load(TransferMetadata(load_event=2, load_gpu_blocks=[5], load_cpu_blocks=[3], load_event_reqs=["r"]))
    report = w.get_finished(wait_for_loads=True)
    assert report.finished_load_reqs == ["r"] and report.completed_store_events == []
    faulty.release_all()
    w.wait_all()
    assert w.get_finished().completed_store_events == [1]
    w.shutdown()


# ---- copy plans ------------------------------------------------------------------------------------------
def test_runs_are_cut_where_the_host_registrations_are_cut():
    src = np.arange(1, 11, dtype=np.int64)  # 1..10
    dst = np.arange(3, 13, dtype=np.int64)  # 3..12
    # 1. cut on the destination side (a store into the host pool): before ids 4, 8 and 12
    s, d, n = coalesce_runs(src, dst, cut_every=4)
    assert d.tolist() == [3, 4, 8, 12] and s.tolist() == [1, 2, 6, 10] and n.tolist() == [1, 4, 4, 1]
    # 2. cut on the source side (a load out of the host pool): before ids 4 and 8
    s, d, n = coalesce_runs(src, dst, cut_every=4, cut_src=True)
    assert s.tolist() == [1, 4, 8] and n.tolist() == [3, 4, 3]
    # 3. a geometry built with a cut applies it to every job
    views = [tensor_block_view("l", torch.zeros(16, 8, dtype=torch.uint8))]
    for cut_src, starts in ((False, [3, 4, 8, 12]), (True, [3, 6, 10])):
        geometry = CopyGeometry.build(views, views, cut_every=4, cut_src=cut_src)
        assert geometry.runs(src, dst)[1].tolist() == starts
        assert len(geometry.segments(src, dst)) == len(starts)


def mixed_views() -> list:
    """One tensor whose blocks are back to back (one segment per run) and one with padding between blocks
    (one segment per block): the two kinds of planes a geometry groups separately."""
    dense = random_bytes((NUM_GPU_BLOCKS, 2, 512), 4)
    padded = random_bytes((NUM_GPU_BLOCKS, 3, 512), 5)[:, :2]
    return [tensor_block_view("dense", dense), tensor_block_view("padded", padded)]


def test_plane_table_and_segment_count_agree_with_the_segments():
    views = mixed_views()
    host = [tensor_block_view(f"h{i}", torch.zeros(8, v.block_bytes, dtype=torch.uint8)) for i, v in enumerate(views)]
    geometry = CopyGeometry.build(views, host)
    assert geometry.num_planes == 2 and geometry.bytes_per_block == sum(v.block_bytes for v in views)
    table = geometry.plane_table()
    assert table.dtype == np.int64 and table.flags.c_contiguous and table.shape == (2, 5)
    by_base = {row[0]: row for row in table.tolist()}
    for v, h in zip(views, host, strict=True):
        assert by_base[v.base_ptr] == [v.base_ptr, h.base_ptr, v.block_stride, h.block_stride, v.chunk_bytes]
    src = np.array([1, 2, 3, 9], np.int64)
    dst = np.array([4, 5, 6, 2], np.int64)
    segments = geometry.segments(src, dst)
    assert geometry.num_segments(len(src), len(geometry.runs(src, dst)[0])) == len(segments) == 2 + 4
    assert segments.total_bytes == len(src) * geometry.bytes_per_block
    empty = geometry.segments(src[:0], dst[:0])
    assert len(empty) == 0 and empty.total_bytes == 0 and len(empty.dst) == len(empty.src) == 0


def test_a_run_of_blocks_is_one_segment_per_plane_when_both_sides_keep_blocks_adjacent():
    dense = tensor_block_view("dense", torch.zeros(NUM_GPU_BLOCKS, 2, 256, dtype=torch.uint8))
    kv_first = tensor_block_view("kv", torch.zeros(2, NUM_GPU_BLOCKS, 256, dtype=torch.uint8), NUM_GPU_BLOCKS)
    host = [tensor_block_view(f"h{i}", torch.zeros(8, 512, dtype=torch.uint8)) for i in range(2)]
    src, dst = np.arange(3, 9, dtype=np.int64), np.arange(1, 7, dtype=np.int64)  # one run of 6 blocks
    assert len(CopyGeometry.build([dense], host[:1]).segments(src, dst)) == 1
    host_kv = HostPool([kv_first], 8).views
    assert len(CopyGeometry.build([kv_first], host_kv).segments(src, dst)) == 2  # the K and the V plane
    padded = tensor_block_view("padded", torch.zeros(NUM_GPU_BLOCKS, 3, 256, dtype=torch.uint8)[:, :2])
    for pair in (([padded], host[:1]), (host[:1], [padded])):  # padding on either side: one per block
        assert len(CopyGeometry.build(*pair).segments(src, dst)) == 6


def test_a_geometry_refuses_tensors_that_do_not_pair_up():
    a = tensor_block_view("a", torch.zeros(4, 64, dtype=torch.uint8))
    b = tensor_block_view("b", torch.zeros(4, 32, dtype=torch.uint8))
    kv = tensor_block_view("kv", torch.zeros(2, 4, 32, dtype=torch.uint8), 4)
    with pytest.raises(ValueError):
        CopyGeometry.build([a, a], [a])
    with pytest.raises(WorkerInvariantError, match="geometry differ"):
        CopyGeometry.build([a], [b])  # same chunk count, other chunk size
    with pytest.raises(WorkerInvariantError, match="geometry differ"):
        CopyGeometry.build([kv], [a])  # same block bytes, other chunk count


def test_a_geometry_cuts_on_the_destination_side_unless_told_otherwise():
    views = [tensor_block_view("l", torch.zeros(16, 8, dtype=torch.uint8))]
    src, dst = np.arange(1, 7, dtype=np.int64), np.arange(2, 8, dtype=np.int64)
    assert CopyGeometry.build(views, views, 4).runs(src, dst)[1].tolist() == [2, 4]


def test_a_large_job_over_mixed_layouts_round_trips_bit_exact():
    # enough bytes that the CPU backend splits the job across both threads
    dense = random_bytes((64, 4096), 6)
    padded = random_bytes((64, 8192), 7)[:, :4096]
    kv = {"dense": dense, "padded": padded}
    w = cpu_worker(num_cpu_blocks=64, backend=CpuBackend(2, min_shard_bytes=4096))
    w.register_kv_caches(kv)
    before = {name: t.clone() for name, t in kv.items()}
    gpu = list(range(1, 41))
    cpu = list(range(24, 44)) + list(range(63, 43, -1))  # a run of 20 blocks on both sides, then no runs
    w.start_store(TransferMetadata(store_event=1, store_gpu_blocks=gpu, store_cpu_blocks=cpu))
    w.wait_all()
    assert w.get_finished().completed_store_events == [1]
    for g, c in zip(gpu, cpu, strict=True):
        assert torch.equal(w.host_pool[c], torch.cat([before["dense"][g], before["padded"][g]]))
    for t in kv.values():
        t.zero_()
    w.start_load(TransferMetadata(load_event=2, load_gpu_blocks=gpu, load_cpu_blocks=cpu, load_event_reqs=["r"]))
    assert w.get_finished().finished_load_reqs == ["r"]
    for name in kv:
        assert torch.equal(kv[name][1:41], before[name][1:41]) and not kv[name][41:].any()
    w.shutdown()


# ---- host pool registration ranges ------------------------------------------------------------------------
@pytest.mark.parametrize("chunk_sizes, num_blocks, limit", [
    ([PAGE_BYTES // 2] * 3, 1, 2 * PAGE_BYTES),  # one-page planes: two merge up to the limit exactly
    ([PAGE_BYTES // 2, PAGE_BYTES], 16, 4 * PAGE_BYTES),  # planes cut every few rows
    ([96, 200], 300, 16 * PAGE_BYTES),
    ([PAGE_BYTES], 8, 1 << 30),  # one range for everything
])
def test_registration_ranges_cover_each_plane_once_within_the_limit(chunk_sizes, num_blocks, limit):
    views = [tensor_block_view(f"l{i}", torch.zeros(4, c, dtype=torch.uint8)) for i, c in enumerate(chunk_sizes)]
    pool = HostPool(views, num_blocks + 1, available=None, max_registration_bytes=limit)
    ranges = pool.registration_ranges()
    base, end = pool.buffer.data_ptr(), pool.buffer.data_ptr() + pool.buffer_bytes
    for ptr, size in ranges:
        assert ptr % PAGE_BYTES == 0 and size % PAGE_BYTES == 0 and 0 < size <= limit
    for (p1, s1), (p2, s2) in zip(ranges, ranges[1:], strict=False):
        assert p1 + s1 <= p2  # ascending and disjoint
        assert not (p1 + s1 == p2 and s1 + s2 <= limit)  # merged whenever the limit allowed it
    # every byte of every block of every plane lies in exactly one range, and no range leaves the buffer
    assert ranges[0][0] >= base and ranges[-1][0] + ranges[-1][1] <= end + PAGE_BYTES
    for view in pool.views:
        for offset in view.chunk_offsets.tolist():
            for row in range(pool.num_blocks):
                first = view.base_ptr + offset + row * view.chunk_bytes
                last = first + view.chunk_bytes - 1
                holders = [(p, s) for p, s in ranges if p <= first < p + s]
                assert len(holders) == 1 and last < holders[0][0] + holders[0][1]


def test_pool_size_limits_are_inclusive():
    assert check_pool_size(2, 1024, available=None) == 2048  # the smallest pool: null block + one
    assert check_pool_size(2, 1, available=None) == 2
    assert check_pool_size(4, 1024, available=4096) == 4096  # exactly what is available
    with pytest.raises(HostPoolError, match="register non-empty KV caches"):
        check_pool_size(4, 0, available=None)


def never_allocate(nbytes: int) -> torch.Tensor:
    raise AssertionError("allocated despite a failed size check")


def test_the_pool_size_is_checked_against_the_given_or_else_the_machines_available_memory():
    views = [tensor_block_view("l", torch.zeros(4, PAGE_BYTES, dtype=torch.uint8))]
    with pytest.raises(HostPoolError, match="does not fit in available memory"):
        HostPool(views, 4, never_allocate, available=PAGE_BYTES)  # a tiny limit given: it is the one used
    machine = mem_available_bytes()
    if machine is not None:  # nothing given: the machine's MemAvailable
        with pytest.raises(HostPoolError, match="does not fit in available memory"):
            HostPool(views, machine // PAGE_BYTES + 2, never_allocate)


@pytest.mark.parametrize("wrong", [
    lambda n: torch.zeros(n - 1, dtype=torch.uint8),  # one byte short
    lambda n: torch.zeros(n, dtype=torch.float32),  # right count, wrong type
    lambda n: torch.zeros(n, dtype=torch.uint8, device="meta"),  # not host memory
])
def test_the_pool_refuses_a_buffer_that_is_not_what_it_asked_for(wrong):
    views = [tensor_block_view("l", torch.zeros(4, 64, dtype=torch.uint8))]
    with pytest.raises(HostPoolError, match="our bug"):
        HostPool(views, 4, wrong, available=None)


def test_rows_per_registration_only_when_a_plane_exceeds_the_limit():
    assert rows_per_registration([PAGE_BYTES], 4, max_bytes=4 * PAGE_BYTES) is None
    assert rows_per_registration([PAGE_BYTES], 5, max_bytes=4 * PAGE_BYTES) == 4
    assert rows_per_registration([PAGE_BYTES // 4, PAGE_BYTES], 9, max_bytes=4 * PAGE_BYTES) == 4
    # 96-byte rows make a page every 128 rows: the cut is the largest multiple of 128 within the limit
    assert rows_per_registration([96], 300, max_bytes=96 * 255) == 128
    assert rows_per_registration([96], 300, max_bytes=96 * 128) == 128
    with pytest.raises(HostPoolError, match="cannot fit a page-aligned registration"):
        rows_per_registration([96], 300, max_bytes=96 * 127)


def test_available_memory_is_read_from_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000 kB\nMemFree:         2000 kB\nMemAvailable:    5000 kB\n")
    assert mem_available_bytes(str(meminfo)) == 5000 * 1024
    meminfo.write_text("MemTotal:       16000 kB\n")
    assert mem_available_bytes(str(meminfo)) is None
    assert mem_available_bytes(str(tmp_path / "missing")) is None


def test_host_buffers_are_page_aligned_zeroed_and_never_empty():
    for nbytes in (1, PAGE_BYTES + 1):
        buffer = allocate_host_buffer(nbytes)
        assert buffer.numel() == nbytes and buffer.dtype == torch.uint8 and not buffer.any()
        assert buffer.data_ptr() % PAGE_BYTES == 0
    with pytest.raises(ValueError, match="positive size"):
        allocate_host_buffer(0)


# ---- the CPU backend's results ---------------------------------------------------------------------------
def bound_backend(num_threads: int = 1) -> tuple[CpuBackend, torch.Tensor]:
    kv = random_bytes((NUM_GPU_BLOCKS, 4096), 8)
    views = [tensor_block_view("l", kv)]
    backend = CpuBackend(num_threads, min_shard_bytes=1024)
    backend.bind(views, HostPool(views, 8))
    return backend, kv


def test_an_empty_job_submitted_to_the_backend_yields_one_result():
    backend, _ = bound_backend()
    empty = np.zeros(0, np.int64)
    backend.submit(CopyJob(7, "store", 3, empty, empty))
    backend.wait([7])
    results = backend.poll()
    assert [(r.job_id, r.ok) for r in results] == [(7, True)] and backend.poll() == []
    backend.shutdown()


def test_a_copy_that_raises_fails_every_destination_block_of_its_job(monkeypatch):
    def broken(segments):
        raise OSError("bad address")

    backend, _ = bound_backend(num_threads=2)
    monkeypatch.setattr(cpu_backend, "run_segments", broken)
    backend.submit(CopyJob(1, "store", 1, np.array([1, 2, 3], np.int64), np.array([5, 6, 7], np.int64)))
    backend.wait([1])
    (result,) = backend.poll()
    assert not result.ok and result.failed_dst_ids == (5, 6, 7) and "OSError: bad address" in result.error
    assert result.finished_at > 0
    backend.shutdown()


def test_the_backend_refuses_jobs_after_shutdown():
    backend, _ = bound_backend()
    backend.shutdown()
    backend.shutdown()  # idempotent
    with pytest.raises(WorkerClosedError):
        backend.submit(CopyJob(1, "store", 1, np.array([1], np.int64), np.array([2], np.int64)))


class TenSecondJobsBackend(CpuBackend):
    """Copies for real, and reports every job as finished exactly 10 s after it was submitted."""

    def __init__(self) -> None:
        super().__init__(1)
        self.submitted_at: dict[int, float] = {}

    def submit(self, job: CopyJob) -> None:
        self.submitted_at[job.job_id] = time.perf_counter()
        super().submit(job)

    def poll(self) -> list[JobResult]:
        return [JobResult(r.job_id, r.failed_dst_ids, r.error, self.submitted_at[r.job_id] + 10.0)
                for r in super().poll()]


def test_a_report_sums_the_bytes_and_seconds_of_every_job_it_covers():
    w = cpu_worker(backend=TenSecondJobsBackend())
    w.register_kv_caches({"l": random_bytes((NUM_GPU_BLOCKS, 64), 13)})
    start = time.perf_counter()
    w.start_store(TransferMetadata(store_event=1, store_gpu_blocks=[1, 2], store_cpu_blocks=[1, 2]))
    w.start_store(TransferMetadata(store_event=2, store_gpu_blocks=[3], store_cpu_blocks=[3]))
    w.wait_all()
    report = w.get_finished()
    slack = time.perf_counter() - start  # submission happened within this window
    assert sorted(report.completed_store_events) == [1, 2] and report.bytes_stored == 3 * 64
    assert 20.0 <= report.store_seconds <= 20.0 + 2 * slack
    start = time.perf_counter()
    w.start_load(TransferMetadata(load_event=3, load_gpu_blocks=[5, 6], load_cpu_blocks=[1, 2], load_event_reqs=["a"]))
    w.start_load(TransferMetadata(load_event=4, load_gpu_blocks=[7], load_cpu_blocks=[3], load_event_reqs=["b"]))
    w.wait_all()
    report = w.get_finished()
    slack = time.perf_counter() - start
    assert sorted(report.finished_load_reqs) == ["a", "b"] and report.bytes_loaded == 3 * 64
    assert 20.0 <= report.load_seconds <= 20.0 + 2 * slack
    w.shutdown()


@pytest.mark.skipif(importlib.util.find_spec("worker_side.backends._segcopy") is None,
                    reason="the C helper was not built (no compiler at install time)")
def test_the_built_c_helper_is_found_and_copies_segments():
    copy = cpu_backend._load_batch_copy()
    assert copy is not None
    src = random_bytes((4, 64), 9)
    dst = torch.zeros_like(src)
    dst_ptrs = np.array([dst.data_ptr() + 64 * 2, dst.data_ptr()], np.int64)
    src_ptrs = np.array([src.data_ptr(), src.data_ptr() + 64 * 3], np.int64)
    nbytes = np.array([64, 32], np.int64)
    i64p = ctypes.POINTER(ctypes.c_int64)
    copy(dst_ptrs.ctypes.data_as(i64p), src_ptrs.ctypes.data_as(i64p), nbytes.ctypes.data_as(i64p), 2)
    assert torch.equal(dst[2], src[0]) and torch.equal(dst[0, :32], src[3, :32])
    assert not dst[0, 32:].any() and not dst[1].any() and not dst[3].any()


def test_without_the_c_helper_the_loader_reports_none(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert cpu_backend._load_batch_copy() is None


# ---- the NUMA hint -----------------------------------------------------------------------------------------
def mbind_permitted() -> bool:
    """Whether this kernel and sandbox let a process set a memory policy at all (probed directly)."""
    number = {"x86_64": 237, "aarch64": 235}.get(platform.machine())
    if number is None or not os.path.exists("/sys/devices/system/node/node0"):
        return False
    region = mmap.mmap(-1, PAGE_BYTES)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(region))
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.syscall(ctypes.c_long(number), ctypes.c_void_p(addr), ctypes.c_ulong(PAGE_BYTES), ctypes.c_int(0),
                      None, ctypes.c_ulong(0), ctypes.c_uint(0))  # MPOL_DEFAULT: changes nothing
    return rc == 0


def absent_node() -> int | None:
    for node in range(1, 63):
        if not os.path.exists(f"/sys/devices/system/node/node{node}"):
            return node
    return None


@pytest.mark.skipif(not mbind_permitted(), reason="no NUMA memory policy here (platform, kernel or sandbox)")
def test_the_pool_prefers_an_existing_numa_node_and_reports_any_other(caplog):
    nbytes = 4 * PAGE_BYTES
    buffer = allocate_host_buffer(nbytes)
    assert _mbind_preferred(buffer.data_ptr(), nbytes, 0)
    for node in (-1, 64, absent_node()):
        if node is not None:
            assert not _mbind_preferred(buffer.data_ptr(), nbytes, node), node
    with caplog.at_level(logging.WARNING, logger="worker_side.host_memory"):
        assert allocate_host_buffer(nbytes, numa_node=0).numel() == nbytes
        assert not caplog.records
        assert allocate_host_buffer(nbytes, numa_node=64).numel() == nbytes
        assert [r.levelno for r in caplog.records] == [logging.WARNING] and "NUMA node 64" in caplog.text
