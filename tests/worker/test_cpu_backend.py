"""The CPU backend (worker_side/backends/cpu.py): its segment copy (the compiled helper and the pure-Python
fallback copy the same bytes), jobs spread over its copy threads, one result per job (a failed copy fails
every destination block), and its refusals before `bind` and after `shutdown`."""

from __future__ import annotations

import ctypes
import importlib.util
import threading
import time

import numpy as np
import pytest
import torch
from worker_helpers import cpu_worker, random_bytes

from offload_connector.metadata import TransferMetadata
from worker_side import CpuBackend, WorkerClosedError
from worker_side.backends import cpu as cpu_backend
from worker_side.backends.base import CopyJob
from worker_side.block_layout import tensor_block_view
from worker_side.copy_plan import Segments
from worker_side.host_pool import HostPool

NUM_GPU_BLOCKS = 16


@pytest.mark.parametrize("compiled", [True, False])
def test_run_segments_copies_exact_bytes(monkeypatch, compiled):
    if compiled and cpu_backend._batch_copy is None:
        pytest.skip("the C helper was not built (no compiler at install time)")
    if not compiled:
        monkeypatch.setattr(cpu_backend, "_batch_copy", None)
    src = torch.randint(0, 255, (64, 100), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    rows = np.array([3, 7, 8, 60], dtype=np.int64)
    to = np.array([0, 1, 63, 5], dtype=np.int64)
    segs = Segments(dst.data_ptr() + to * 100, src.data_ptr() + rows * 100, np.full(4, 100, np.int64))
    cpu_backend.run_segments(segs)
    assert torch.equal(dst[torch.from_numpy(to)], src[torch.from_numpy(rows)])
    untouched = sorted(set(range(64)) - set(to.tolist()))
    assert not dst[untouched].any()


def test_the_c_helper_is_built_where_ci_installs():
    # .ci/run installs with a compiler present; a silent fallback there would hide a build break.
    import os
    if os.environ.get("CI") == "true":
        assert cpu_backend._batch_copy is not None


@pytest.mark.skipif(importlib.util.find_spec("worker_side.backends._segcopy") is None,
                    reason="the C helper was not built (no compiler at install time)")
def test_the_built_c_helper_is_found_and_copies_segments():
    """Found by mutation testing of worker_side/backends/cpu.py (docs/mutation.md)."""
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
    """Found by mutation testing of worker_side/backends/cpu.py (docs/mutation.md)."""
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert cpu_backend._load_batch_copy() is None


def bound_backend(num_threads: int = 1) -> tuple[CpuBackend, torch.Tensor]:
    kv = random_bytes((NUM_GPU_BLOCKS, 4096), 8)
    views = [tensor_block_view("l", kv)]
    backend = CpuBackend(num_threads, min_shard_bytes=1024)
    backend.bind(views, HostPool(views, 8))
    return backend, kv


def test_an_empty_job_submitted_to_the_backend_yields_one_result():
    """Found by mutation testing of worker_side/backends/cpu.py (docs/mutation.md)."""
    backend, _ = bound_backend()
    empty = np.zeros(0, np.int64)
    backend.submit(CopyJob(7, "store", 3, empty, empty))
    backend.wait([7])
    results = backend.poll()
    assert [(r.job_id, r.ok) for r in results] == [(7, True)] and backend.poll() == []
    backend.shutdown()


def test_a_copy_that_raises_fails_every_destination_block_of_its_job(monkeypatch):
    """Found by mutation testing of worker_side/backends/cpu.py (docs/mutation.md)."""
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
    """Found by mutation testing of worker_side/backends/cpu.py (docs/mutation.md)."""
    backend, _ = bound_backend()
    backend.shutdown()
    backend.shutdown()  # idempotent
    with pytest.raises(WorkerClosedError):
        backend.submit(CopyJob(1, "store", 1, np.array([1], np.int64), np.array([2], np.int64)))



def test_a_cpu_backend_refuses_jobs_before_it_is_bound():
    """Found by mutation testing of worker_side/backends/cpu.py (docs/mutation.md)."""
    backend = CpuBackend(num_threads=1)
    with pytest.raises(WorkerClosedError, match="before bind"):
        backend.submit(CopyJob(1, "store", 1, np.array([1], np.int64), np.array([1], np.int64)))
    backend.shutdown()


def test_shutdown_lets_the_running_copy_finish_and_fails_the_queued_ones(monkeypatch):
    """One copy thread, held inside job 1's copy; job 2 waits in the queue. Shutdown: job 1 completes, job 2
    fails (every block listed) without being copied.

    Found by mutation testing of worker_side/backends/cpu.py (docs/mutation.md)."""
    started, release, copied = threading.Event(), threading.Event(), []
    real = cpu_backend.run_segments

    def held(segments):
        started.set()
        release.wait()
        copied.append(segments.total_bytes)
        real(segments)

    monkeypatch.setattr(cpu_backend, "run_segments", held)
    backend = CpuBackend(num_threads=1)
    w = cpu_worker(backend=backend)
    w.register_kv_caches({"l": torch.ones(NUM_GPU_BLOCKS, 64, dtype=torch.uint8)})
    w.start_store(TransferMetadata(store_event=1, store_gpu_blocks=[1], store_cpu_blocks=[1]))
    assert started.wait(10)
    w.start_store(TransferMetadata(store_event=2, store_gpu_blocks=[2, 3], store_cpu_blocks=[2, 3]))
    stopper = threading.Thread(target=w.shutdown)
    stopper.start()
    while not backend._closed:  # shutdown() has marked the backend closed and now joins the thread
        time.sleep(0.001)
    release.set()
    stopper.join()
    results = {r.job_id: r for r in backend.poll()}
    assert copied == [64] and results[1].ok
    assert results[2].failed_dst_ids == (2, 3) and "shutdown" in results[2].error
    assert torch.equal(w.host_pool[1], torch.ones(64, dtype=torch.uint8))
    assert not w.host_pool[2].any()


def test_a_big_job_is_spread_over_every_copy_thread(monkeypatch):
    """Above `min_shard_bytes` a job is cut into one shard per copy thread, so the threads copy in parallel.

    Found by mutation testing of worker_side/backends/cpu.py (docs/mutation.md)."""
    shards: list[int] = []
    lock = threading.Lock()
    real = cpu_backend.run_segments

    def recording(segments):
        with lock:
            shards.append(segments.total_bytes)
        real(segments)

    monkeypatch.setattr(cpu_backend, "run_segments", recording)
    w = cpu_worker(backend=CpuBackend(num_threads=2, min_shard_bytes=64))
    kv = torch.arange(NUM_GPU_BLOCKS * 64, dtype=torch.int32).to(torch.uint8).reshape(NUM_GPU_BLOCKS, 64)
    w.register_kv_caches({"l": kv})
    w.start_store(TransferMetadata(store_event=1, store_gpu_blocks=[1, 2, 3, 4], store_cpu_blocks=[1, 2, 3, 4]))
    w.wait_all()
    assert w.get_finished().completed_store_events == [1]
    assert sorted(shards) == [128, 128]
    assert all(torch.equal(w.host_pool[i], kv[i]) for i in range(1, 5))
    w.shutdown()



def test_a_large_job_over_mixed_layouts_round_trips_bit_exact():
    """Found by mutation testing of worker_side/backends/cpu.py (docs/mutation.md)."""
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
