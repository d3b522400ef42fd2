"""More worker-side contracts that only mutation testing (docs/mutation.md) showed no test pinned: layer names
in layout errors, KV sharing, the reported transfer time, runs cut by registrations, segment counts, jobs
spread over the copy threads, byte views on any device, and the NUMA syscall's arguments (mbind(2)).
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading
import time
import types

import numpy as np
import pytest
import torch

from offload_connector import load_config
from offload_connector.metadata import TransferMetadata, WorkerReport
from worker_side import CpuBackend, LayoutError, OffloadWorker, WorkerClosedError, host_memory
from worker_side import worker as worker_module
from worker_side.backends import cpu as cpu_backend
from worker_side.backends.base import CopyJob
from worker_side.block_layout import _byte_view, tensor_block_view
from worker_side.copy_plan import CopyGeometry, Segments, coalesce_runs, split_segments
from worker_side.host_memory import PAGE_BYTES, _mbind_preferred, allocate_host_buffer

NUM_GPU_BLOCKS = 16


def cpu_worker(num_cpu_blocks: int = 8, backend=None) -> OffloadWorker:
    return OffloadWorker(load_config({"num_cpu_blocks": num_cpu_blocks, "transfer": {"backend": "cpu"}}),
                         backend=backend)


# ---- registration ---------------------------------------------------------------------------------------
def test_a_layout_error_names_the_tensor_it_refuses():
    w = cpu_worker()
    with pytest.raises(LayoutError, match="'model.layers.7.attn'"):
        w.register_kv_caches({"model.layers.7.attn": torch.empty(0)})
    with pytest.raises(LayoutError, match="'cross_layer'"):
        w.register_cross_layer_kv_cache(torch.empty(0))
    w.shutdown()


def test_layers_after_a_shared_kv_cache_are_still_registered():
    """KV sharing: a tensor registered under two names is copied once; the layers after it still count."""
    shared, own = torch.zeros(NUM_GPU_BLOCKS, 64, dtype=torch.uint8), torch.zeros(NUM_GPU_BLOCKS, 32, dtype=torch.uint8)
    w = cpu_worker()
    w.register_kv_caches({"a": shared, "b": shared, "c": own})
    assert w.bytes_per_block == 64 + 32
    own[3] = 7
    w.start_store(TransferMetadata(store_event=1, store_gpu_blocks=[3], store_cpu_blocks=[2]))
    w.wait_all()
    assert w.get_finished().completed_store_events == [1]
    assert torch.equal(w.host_pool[2], torch.cat([shared[3], own[3]]))
    w.shutdown()


# ---- the reported transfer time -------------------------------------------------------------------------
def test_transfer_seconds_are_finish_minus_submit_and_never_negative(monkeypatch):
    """An empty load finishes at submission: its time is the clock between the two readings (clamped at 0
    when a backend's clock reads earlier than the worker's)."""
    w = cpu_worker()
    w.register_kv_caches({"l": torch.zeros(NUM_GPU_BLOCKS, 64, dtype=torch.uint8)})
    for readings, expected in (((10.0, 10.25), 0.25), ((10.0, 9.5), 0.0)):
        clock = iter(readings)
        monkeypatch.setattr(worker_module, "time", types.SimpleNamespace(perf_counter=lambda c=clock: next(c)))
        w.start_load(TransferMetadata(load_event=1, load_event_reqs=["r"]))
        report = w.get_finished()
        assert report.finished_load_reqs == ["r"] and report.load_seconds == expected and report.bytes_loaded == 0
    w.shutdown()


# ---- copy plans -----------------------------------------------------------------------------------------
def test_runs_end_at_id_gaps_as_well_as_at_registration_cuts():
    src, dst = np.array([1, 2, 5, 6, 7, 8], np.int64), np.array([1, 2, 3, 4, 5, 6], np.int64)
    starts_s, starts_d, lengths = coalesce_runs(src, dst, cut_every=4)
    assert starts_s.tolist() == [1, 5, 6] and starts_d.tolist() == [1, 3, 4] and lengths.tolist() == [2, 1, 3]
    starts_s, _, lengths = coalesce_runs(src, dst, cut_every=4, cut_src=True)
    assert starts_s.tolist() == [1, 5, 8] and lengths.tolist() == [2, 3, 1]


def test_the_segment_count_matches_the_segments_for_planes_of_several_chunks():
    src = tensor_block_view("s", torch.zeros(2, NUM_GPU_BLOCKS, 16), layout="kv_first")
    dst = tensor_block_view("d", torch.zeros(2, NUM_GPU_BLOCKS, 16), layout="kv_first")
    geometry = CopyGeometry.build([src], [dst])
    ids_s, ids_d = np.array([1, 2, 3, 9], np.int64), np.array([4, 5, 6, 11], np.int64)
    segments = geometry.segments(ids_s, ids_d)
    assert geometry.num_segments(num_blocks=4, num_runs=2) == len(segments) == 4  # 2 runs x 2 chunks
    assert isinstance(geometry.num_segments(4, 2), int)


def test_a_geometry_without_planes_copies_nothing():
    segments = CopyGeometry.build([], []).segments(np.array([1, 2], np.int64), np.array([3, 4], np.int64))
    assert len(segments) == 0 and segments.total_bytes == 0


def test_a_big_job_is_spread_over_every_copy_thread(monkeypatch):
    """Above `min_shard_bytes` a job is cut into one shard per copy thread, so the threads copy in parallel."""
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


def test_a_byte_view_stays_on_the_tensors_device():
    view = _byte_view(torch.empty(4, 8, device="meta"))
    assert view.device.type == "meta" and view.dtype == torch.uint8 and view.shape == (128,)


# ---- the NUMA hint: mbind(2) ----------------------------------------------------------------------------
class RecordingLibc:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def syscall(self, *args):
        self.calls.append(args)
        return 0


@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"), reason="mbind is wired for x86-64 and aarch64")
@pytest.mark.parametrize("node", [0, 5, 63])
def test_mbind_gets_a_preferred_policy_a_mask_it_reads_exactly_and_no_flags(monkeypatch, node):
    """mbind(addr, len, MPOL_PREFERRED, nodemask, maxnode, flags): the kernel reads maxnode - 1 bits of the
    mask, so maxnode is its size in bits + 1 (fewer drops the top node; more reads past the mask); no
    MPOL_MF_* flag (a preference must never fail because pages sit elsewhere)."""
    libc = RecordingLibc()
    monkeypatch.setattr(host_memory.ctypes, "CDLL", lambda *a, **k: libc)
    assert _mbind_preferred(4096, 8192, node)
    [args] = libc.calls
    assert len(args) == 7
    number, addr, nbytes, mode, mask_ref, maxnode, flags = args
    assert (number.value, addr.value, nbytes.value, mode.value) == ({"x86_64": 237, "aarch64": 235}[platform.machine()],
                                                                     4096, 8192, 1)
    mask = mask_ref._obj
    assert mask.value == 1 << node
    assert maxnode.value - 1 == 8 * ctypes.sizeof(mask)
    assert (flags.value if flags is not None else 0) == 0  # None is passed as 0


@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64") or not os.path.exists("/sys/devices/system/node/node0")
                    or os.path.exists("/sys/devices/system/node/node63"), reason="needs Linux NUMA info without node 63")
def test_an_absent_top_node_is_reported_not_silently_dropped():
    """With maxnode 64 the kernel never saw bit 63: the call succeeded as 'allocate locally'."""
    buffer = allocate_host_buffer(4 * PAGE_BYTES)
    assert not _mbind_preferred(buffer.data_ptr(), 4 * PAGE_BYTES, 63)


# ---- before registration, disagreeing tensors, shutdown -------------------------------------------------
def test_an_unregistered_worker_has_no_gpu_blocks_and_reports_as_rank_0():
    w = cpu_worker()
    assert w.num_gpu_blocks == 0
    assert w.get_finished() == WorkerReport(rank=0)
    w.shutdown()


def test_tensors_that_disagree_on_block_count_or_device_are_refused():
    w = cpu_worker()
    with pytest.raises(LayoutError, match="disagree on block count"):
        w.register_kv_caches({"a": torch.zeros(16, 64), "b": torch.zeros(8, 64)})
    with pytest.raises(LayoutError, match="device"):
        w.register_kv_caches({"a": torch.zeros(16, 64), "b": torch.zeros(16, 64, device="meta")})
    w.shutdown()


def test_a_cpu_backend_refuses_jobs_before_it_is_bound():
    backend = CpuBackend(num_threads=1)
    with pytest.raises(WorkerClosedError, match="before bind"):
        backend.submit(CopyJob(1, "store", 1, np.array([1], np.int64), np.array([1], np.int64)))
    backend.shutdown()


def test_shutdown_lets_the_running_copy_finish_and_fails_the_queued_ones(monkeypatch):
    """One copy thread, held inside job 1's copy; job 2 waits in the queue. Shutdown: job 1 completes, job 2
    fails (every block listed) without being copied."""
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


# ---- shards ---------------------------------------------------------------------------------------------
def segments_of(sizes: list[int]) -> Segments:
    nbytes = np.array(sizes, np.int64)
    starts = np.concatenate(([0], np.cumsum(nbytes)[:-1]))
    return Segments(dst=10_000 + starts, src=20_000 + starts, nbytes=nbytes)


def shard_sizes(shards: list[Segments]) -> list[list[int]]:
    return [s.nbytes.tolist() for s in shards]


def test_shards_cut_segments_into_equal_bytes_only_above_the_minimum_piece():
    one = split_segments(segments_of([1000]), 2, min_piece=1)
    assert shard_sizes(one) == [[500], [500]]
    assert [s.dst.tolist() for s in one] == [[10_000], [10_500]] and [s.src.tolist() for s in one] == [[20_000], [20_500]]
    assert shard_sizes(split_segments(segments_of([100, 100, 100]), 2, min_piece=1)) == [[100, 100], [100]]
    assert shard_sizes(split_segments(segments_of([100] * 4), 4, min_piece=1)) == [[100]] * 4
    assert shard_sizes(split_segments(segments_of([100, 100]), 2, min_piece=200)) == [[100, 100]]  # at the minimum
    assert shard_sizes(split_segments(segments_of([100, 100]), 2, min_piece=1000)) == [[100, 100]]
    assert shard_sizes(split_segments(segments_of([1000]), 1, min_piece=1)) == [[1000]]
    assert split_segments(segments_of([]), 2) == []


# ---- tensor views ---------------------------------------------------------------------------------------
def test_a_view_keeps_its_name_and_refuses_empty_blocks_naming_the_tensor():
    assert tensor_block_view("layer.3", torch.zeros(NUM_GPU_BLOCKS, 8)).name == "layer.3"
    with pytest.raises(LayoutError, match="'layer.3': need a non-empty"):
        tensor_block_view("layer.3", torch.zeros(NUM_GPU_BLOCKS, 0))
    with pytest.raises(LayoutError, match="'layer.4': layout kv_first"):
        tensor_block_view("layer.4", torch.zeros(3, NUM_GPU_BLOCKS, 8), layout="kv_first")


def strided(shape: tuple[int, ...], strides: tuple[int, ...]) -> torch.Tensor:
    return torch.zeros(4096).as_strided(shape, strides)


def test_views_accept_dense_blocks_whatever_the_strides_of_size_1_dims():
    assert tensor_block_view("x", torch.zeros(NUM_GPU_BLOCKS, 8).unsqueeze(1)).chunk_bytes == 32
    one = tensor_block_view("x", strided((1, 8), (4, 1)))  # one block: its stride is never used
    assert (one.num_blocks, one.chunk_bytes, one.chunk_offsets.tolist()) == (1, 32, [0])


def test_views_place_every_chunk_of_several_outer_dims():
    view = tensor_block_view("x", strided((NUM_GPU_BLOCKS, 2, 2, 8), (8, 128, 256, 1)), layout="block_first")
    assert view.chunk_offsets.tolist() == [0, 512, 1024, 1536] and view.chunk_bytes == 32
    kv = tensor_block_view("x", strided((2, NUM_GPU_BLOCKS, 8), (128, 8, 1)), layout="kv_first")
    assert kv.chunk_offsets.tolist() == [0, 512]


@pytest.mark.parametrize(("shape", "strides", "layout"), [
    ((2, 8), (4, 1), None),  # two blocks sharing bytes
    ((NUM_GPU_BLOCKS, 2, 4), (4, 4, 1), None),  # a dim stepping by the block stride
    ((2, NUM_GPU_BLOCKS, 8), (120, 8, 1), "kv_first"),  # V starts inside K's last block
    ((NUM_GPU_BLOCKS, 2, 2, 8), (8, 128, 200, 1), "block_first"),  # the second outer dim inside the first
])
def test_views_refuse_tensors_whose_blocks_share_bytes(shape, strides, layout):
    with pytest.raises(LayoutError, match="overlap"):
        tensor_block_view("x", strided(shape, strides), layout=layout)


def test_a_worker_alone_gets_the_whole_cpu_budget():
    """world_size defaults to 1: the pool holds cpu_bytes // bytes_per_block blocks."""
    w = OffloadWorker(load_config({"cpu_bytes": 64 * 10, "transfer": {"backend": "cpu"}}))
    w.register_kv_caches({"l": torch.zeros(NUM_GPU_BLOCKS, 64, dtype=torch.uint8)})
    assert w.num_cpu_blocks == 10
    w.shutdown()


def test_the_pool_views_keep_the_layer_names():
    w = cpu_worker()
    w.register_kv_caches({"k.0": torch.zeros(NUM_GPU_BLOCKS, 64, dtype=torch.uint8),
                          "k.1": torch.zeros(NUM_GPU_BLOCKS, 32, dtype=torch.uint8)})
    assert [v.name for v in w.host_pool.views] == ["k.0", "k.1"]
    w.shutdown()


def vm_flags(addr: int) -> list[str]:
    """The kernel's VmFlags of the mapping holding `addr` (/proc/self/smaps)."""
    mapping = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                mapping = lo <= addr < hi
            elif line.startswith("VmFlags:") and mapping:
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps") or not os.path.exists("/sys/kernel/mm/transparent_hugepage"),
                    reason="needs Linux with transparent huge pages")
def test_the_pool_buffer_is_private_and_advised_for_huge_pages():
    """Private (a forked process never shares the pool's writes) and MADV_HUGEPAGE ('hg') from its first byte."""
    buffer = allocate_host_buffer(3 << 20)
    flags = vm_flags(buffer.data_ptr())
    assert "hg" in flags and "sh" not in flags, flags
