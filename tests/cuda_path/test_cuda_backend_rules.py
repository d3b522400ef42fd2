"""The CUDA backend's failure paths and device rules, on the simulated device (no GPU needed).

Each test is one defect found by reading the CUDA path against CUDA, cuda-bindings and cupy (issue 29):
a failed launch that kept its argument-ring entries, a driver error code that escaped `submit`, a grid over
every SM, a kernel launched where the device cannot read host memory at its host address, a driver call
before the device was made current, a pageable copy stalling the engine thread, and the simulator calling
a queue of already-satisfied waits a deadlock. The real runtime's side of the same defects (driver error
names, failIdx, retained contexts, the kernel's grid and stream) is in test_cuda_runtime_fakes.py.
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest
import torch
from cudasim_helpers import make_kv, round_trip, sim_worker

from offload_connector.metadata import TransferMetadata
from worker_side.backends.base import CopyJob
from worker_side.backends.cuda.api import CudaError
from worker_side.backends.cuda.arg_ring import ArgRing
from worker_side.errors import WorkerInvariantError
from worker_side.testing.cuda_sim import SimCudaRuntime
from worker_side.testing.sim_streams import SimWork

pytestmark = pytest.mark.cudasim

KERNEL_ALWAYS = dict(kernel_max_segment_bytes=1 << 30, kernel_directions=("load", "store"), kernel_min_segments=1)


def store_meta(event: int, gpu: list[int], cpu: list[int]) -> TransferMetadata:
    return TransferMetadata(store_event=event, store_gpu_blocks=gpu, store_cpu_blocks=cpu)


def load_meta(event: int, gpu: list[int], cpu: list[int]) -> TransferMetadata:
    return TransferMetadata(load_event=event, load_gpu_blocks=gpu, load_cpu_blocks=cpu, load_event_reqs=[f"r{event}"])


# ---- 1. a failed launch gives its argument-ring entries back ----------------------------------------------
def test_failed_launches_give_their_ring_entries_back() -> None:
    """40 stores whose launches fail (each would hold 4 of the ring's 64 entries): all fail, and the next
    store still goes by the kernel, with the whole ring free once it completed."""
    rt = SimCudaRuntime(seed=0, burst=0)
    kv = make_kv(rt, "kv_first")
    w = sim_worker(rt, kv, 12, ring_entries=64, **KERNEL_ALWAYS)
    ring = w.backend.paths.rings["store"]
    rt.fail_kernel_launches = 40
    failed = []
    for event in range(1, 41):
        w.start_store(store_meta(event, [1, 2], [event % 30 + 1, event % 30 + 2]))
        assert ring.num_free == 64, f"store {event}: a failed launch kept ring entries"
        rt.drain()
        failed += w.get_finished().failed_store_events
    assert failed == list(range(1, 41)) and w.backend.num_failed_submissions == 40
    launches = rt.calls["launch_block_copy"]
    w.start_store(store_meta(41, [3, 4], [5, 6]))
    assert rt.calls["launch_block_copy"] == launches + 1 and w.backend.num_jobs_by_path["kernel"] == 1
    rt.drain()
    assert w.get_finished().completed_store_events == [41]
    assert ring.num_free == ring.capacity == 64
    for cpu, gpu in ((5, 3), (6, 4)):
        assert torch.equal(w.host_pool[cpu], torch.cat([v.block_tensor(gpu) for v in w._views]))
    assert rt.faults == []
    w.shutdown()


def test_unwrite_restores_the_ring_exactly() -> None:
    ring = ArgRing(np.zeros(10, np.int64))
    first = ring.write(np.arange(3), np.arange(3))  # entries 0..5
    assert first is not None and ring.num_free == 4
    second = ring.write(np.arange(2), np.arange(2))  # entries 6..9
    assert second is not None and ring.num_free == 0
    ring.unwrite(second[1])  # its launch failed: 6..9 free again, the head back at 6
    assert ring.num_free == 4
    ring.release(first[1])  # job 1 completed: 0..5 free
    wrapped = ring.write(np.arange(3), np.arange(3))  # 6 entries do not fit in 6..9: skip them, take 0..5
    assert wrapped is not None and wrapped[1] == 4 + 6
    ring.unwrite(wrapped[1])  # the skipped tail comes back too
    assert ring.num_free == 10
    assert ring.write(np.arange(2), np.arange(2))[0] == ring._table[6:].ctypes.data  # where it was before
    with pytest.raises(WorkerInvariantError, match="our bug"):
        ring.unwrite(6)  # not what the most recent write took


# ---- 2. a driver error of any kind fails the job, never the engine ----------------------------------------
@pytest.mark.parametrize("kind", ["load", "store"])
def test_an_error_code_the_bindings_cannot_name_fails_the_job(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """cuda-bindings raise ValueError for a CUresult their enum lacks (723, 1000): the job fails, reported
    once, and the backend goes on."""
    rt = SimCudaRuntime(seed=1, burst=0)
    kv = make_kv(rt, "kv_first")
    w = sim_worker(rt, kv, 12, kernel_max_segment_bytes=0)

    def unknown_code(*args, **kwargs) -> None:
        raise ValueError("723 is not a valid CUresult")

    original = rt.memcpy_batch
    monkeypatch.setattr(rt, "memcpy_batch", unknown_code)
    w.begin_step()
    (w.start_load(load_meta(1, [3, 4], [5, 6])) if kind == "load" else w.start_store(store_meta(1, [3, 4], [5, 6])))
    rt.drain()
    report = w.get_finished()
    if kind == "load":
        assert report.finished_load_reqs == ["r1"] and sorted(report.failed_load_gpu_blocks) == [3, 4]
    else:
        assert report.failed_store_events == [1] and report.completed_store_events == []
    monkeypatch.setattr(rt, "memcpy_batch", original)
    w.start_store(store_meta(2, [7], [8]))
    rt.drain()
    assert w.get_finished().completed_store_events == [2]
    w.shutdown()


# ---- 3. the kernel's grid takes a few SMs, not all ---------------------------------------------------------
def test_kernel_grid_is_capped_at_a_few_sms() -> None:
    rt = SimCudaRuntime(seed=2, burst=0, num_sms=132, kernel_max_sms=12)
    kv = make_kv(rt, "LHBNC", num_layers=3)  # 3 layers x 2 heads: 6 planes
    w = sim_worker(rt, kv, 12, layout="LHBNC", **KERNEL_ALWAYS)
    w.start_store(store_meta(1, list(range(1, 12)), list(range(1, 12))))  # 66 chunks
    w.start_load(load_meta(2, [1], [20]))  # 6 chunks
    rt.drain()
    assert rt.kernel_grids == [12, 6]
    w.shutdown()


# ---- 5. one start-up line when the kernel is off -----------------------------------------------------------
def test_kernel_off_is_said_once_at_startup(caplog: pytest.LogCaptureFixture) -> None:
    rt = SimCudaRuntime(seed=3, supports_kernel=False)
    with caplog.at_level("INFO", logger="worker_side.backends.cuda.backend"):
        w = sim_worker(rt, make_kv(rt, "kv_first"), 12, **KERNEL_ALWAYS)
    lines = [r.getMessage() for r in caplog.records if "kernel off" in r.getMessage()]
    assert lines == ["offload: direct block-copy kernel off on device 0: switched off on the simulated device "
                     "(supports_kernel=False)"]
    assert w.backend.kernel_off_reason is not None and w.backend.policy.rules == {}
    w.shutdown()


# ---- 6. no kernel where the device cannot read registered host memory at its host address -------------------
def test_no_kernel_where_host_pointers_are_unusable(caplog: pytest.LogCaptureFixture) -> None:
    rt = SimCudaRuntime(seed=4, host_pointer_for_registered_mem=False)
    kv = make_kv(rt, "kv_first")
    with caplog.at_level("WARNING", logger="worker_side.backends.cuda.backend"):
        w = sim_worker(rt, kv, 12, **KERNEL_ALWAYS)
    round_trip(rt, w, kv, gpu=[1, 2, 3], cpu=[4, 5, 6], targets=[7, 8, 9])
    assert rt.calls["launch_block_copy"] == 0 and rt.faults == []
    assert w.backend.num_jobs_by_path["batch"] == 2
    lines = [r.getMessage() for r in caplog.records if "CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM" in r.getMessage()]
    assert len(lines) == 1 and "kernel off on device 0" in lines[0]
    w.shutdown()


# ---- 7. the device is current before the first driver call ------------------------------------------------
def test_the_first_driver_call_runs_on_the_kv_caches_device() -> None:
    """vLLM asks for the NUMA node, then binds: a rank-1 thread (device 0 current, CUDA's default) must make
    device 1 current before `device_of`, which would otherwise create a context on GPU 0."""
    rt = SimCudaRuntime(num_devices=2, seed=5)
    kv = make_kv(rt, "kv_first", device=1)
    seen: dict[str, object] = {}

    def rank1() -> None:
        w = sim_worker(rt, kv, 12, rank=1)
        seen["touched"] = set(rt.devices_touched[threading.get_ident()])
        seen["device_of"] = rt.calls["device_of"]
        w.shutdown()

    thread = threading.Thread(target=rank1)
    thread.start()
    thread.join()
    assert seen["device_of"] > 0 and seen["touched"] == {1}


# ---- 8. a pageable pool never stalls the engine thread ---------------------------------------------------
def test_pageable_copies_never_block_the_engine_thread() -> None:
    """Pinning failed: a store's device -> pageable copy waits for the forward it is fenced on. It must do
    so on the copy thread; the engine thread returns from `start_store` with the forward still queued."""
    rt = SimCudaRuntime(seed=6, burst=0, fail_register=True)
    kv = make_kv(rt, "kv_first")
    w = sim_worker(rt, kv, 12)
    assert not w.backend.pinned
    forward_ran = threading.Event()
    rt.launch_host_work(rt.compute_stream(), forward_ran.set)  # the forward, queued, not run
    w.start_store(store_meta(1, [1, 2], [3, 4]))
    w.start_load(load_meta(2, [5], [6]))
    engine = threading.get_ident()
    assert [op for thread, op in rt.host_blocked if thread == engine] == []
    w.wait_all()
    assert forward_ran.is_set() and rt.host_blocked, "the copy thread should have waited for the forward"
    report = w.get_finished()
    assert report.completed_store_events == [1] and report.finished_load_reqs == ["r2"]
    assert not report.failed_load_gpu_blocks and w.backend.num_jobs_by_path["pageable"] == 2
    for cpu, gpu in ((3, 1), (4, 2)):
        assert torch.equal(w.host_pool[cpu], torch.cat([v.block_tensor(gpu) for v in w._views]))
    w.shutdown()
    assert rt.registrations == {} and rt.faults == []


def test_pageable_store_after_load_keeps_its_order() -> None:
    """With a pageable pool the store that rewrites a slot its step's load reads still follows the load."""
    rt = SimCudaRuntime(seed=7, schedule="copy_lag", fail_register=True)
    kv = make_kv(rt, "kv_first")
    w = sim_worker(rt, kv, 12)
    w.start_store(store_meta(1, [1, 2], [3, 4]))
    w.wait_all()
    w.get_finished()
    expected = [torch.cat([v.block_tensor(b) for v in w._views]) for b in (1, 2)]
    w.begin_step()
    meta = TransferMetadata(load_event=2, load_gpu_blocks=[8, 9], load_cpu_blocks=[3, 4], load_event_reqs=["r"],
                            store_event=2, store_gpu_blocks=[5, 6], store_cpu_blocks=[3, 4], store_after_load=True)
    w.start_load(meta)
    w.start_store(meta)
    w.wait_all()
    for got, want in zip((8, 9), expected, strict=True):
        assert torch.equal(torch.cat([v.block_tensor(got) for v in w._views]), want)
    w.shutdown()


# ---- the simulator: satisfied waits are progress, not a deadlock -------------------------------------------
def test_a_queue_of_satisfied_waits_is_not_a_deadlock() -> None:
    rt = SimCudaRuntime(seed=8, burst=0)
    stream = rt.create_stream(low_priority=False)
    done = rt.create_event()
    rt.record_event(done, rt.compute_stream())  # nothing queued there: already complete
    for _ in range(3):
        rt.wait_event(stream, done)
    assert rt.num_queued == 3
    rt.synchronize_stream(stream)  # pops the three waits
    assert rt.num_queued == 0


def test_a_real_deadlock_is_still_reported() -> None:
    rt = SimCudaRuntime(seed=9, burst=0)
    stream = rt.create_stream(low_priority=False)
    rt._queues.push(stream, SimWork("wait", wait=(rt.compute_stream(), 5)))  # waits for work never queued
    with pytest.raises(CudaError, match="deadlock"):
        rt.synchronize_stream(stream)


def test_submit_failing_before_any_copy_is_one_failed_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fence that cannot be recorded: nothing is copied, the job is reported failed once."""
    rt = SimCudaRuntime(seed=10, burst=0)
    w = sim_worker(rt, make_kv(rt, "kv_first"), 12)
    original = rt.wait_event

    def broken(stream, event) -> None:
        raise CudaError("cuStreamWaitEvent failed: CUDA_ERROR_INVALID_HANDLE (simulated)")

    monkeypatch.setattr(rt, "wait_event", broken)
    w.backend.submit(CopyJob(99, "store", 1, np.array([1], np.int64), np.array([2], np.int64)))
    monkeypatch.setattr(rt, "wait_event", original)
    rt.drain()
    (result,) = w.backend.poll()
    assert result.job_id == 99 and result.failed_dst_ids == (2,) and "INVALID_HANDLE" in result.error
    w.shutdown()


def test_backend_logs_the_policy_it_uses(caplog: pytest.LogCaptureFixture) -> None:
    rt = SimCudaRuntime(seed=11)
    with caplog.at_level(logging.INFO, logger="worker_side.backends.cuda.backend"):
        w = sim_worker(rt, make_kv(rt, "kv_first"), 12, kernel_directions=("load",), kernel_min_segments=16,
                       kernel_max_segment_bytes=28 << 10)
    assert any(r.getMessage() == "offload: copy paths on device 0: load: kernel for segments averaging <= 28 KiB, "
               ">= 16 of them (else DMA); store: DMA" for r in caplog.records)
    w.shutdown()


def test_a_copy_thread_without_its_device_fails_its_jobs_in_order() -> None:
    """The copy thread could not make its device current: each job fails, none hangs a wait."""
    from worker_side.backends.cuda.pageable_copier import PageableCopier
    from worker_side.copy_plan import Segments

    class NoDevice:
        def get_device(self) -> int:
            raise CudaError("cudaGetDevice failed: cudaErrorNoDevice (simulated)")

    copier = PageableCopier(NoDevice(), device=1)  # type: ignore[arg-type]
    empty = Segments(*(np.zeros(0, np.int64) for _ in range(3)))
    tickets = [copier.submit(empty, stream=None, done=None, after=[]) for _ in range(3)]
    assert all(t.issued.wait(timeout=10) for t in tickets)
    assert all("could not make device 1 current" in t.error for t in tickets)
    copier.close()
