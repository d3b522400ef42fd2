"""OffloadWorker stories: interleaved jobs finishing out of order, failures, pool bounds, shutdown."""

from __future__ import annotations

import pytest
import torch
from worker_helpers import NUM_GPU_BLOCKS, block_bytes, load, make_worker, next_report, store

from offload_connector import ConfigError, load_config
from worker_side import CpuBackend, HostPoolError, OffloadWorker, WorkerClosedError, WorkerInvariantError
from worker_side.host_pool import HostPool, check_pool_size
from worker_side.testing.faults import FaultyBackend


def test_interleaved_jobs_complete_out_of_order():
    faulty = FaultyBackend(CpuBackend(2), hold=lambda job: True)
    w, kv = make_worker(backend=faulty)
    # 1. four store events and a load event in flight together
    for e in range(4):
        w.start_store(store(e, [1 + 4 * e + i for i in range(4)], [1 + 4 * e + i for i in range(4)]))
    expected = {e: [block_bytes(kv, 1 + 4 * e + i) for i in range(4)] for e in range(4)}
    # 2. nothing is reported while held, and get_finished never blocks on stores
    assert w.get_finished(wait_for_loads=False).is_empty
    # 3. release in reverse order, one at a time
    for job_id, event in zip(sorted(faulty.held_job_ids(), reverse=True), [3, 2, 1, 0], strict=True):
        faulty.release(job_id)
        assert next_report(w).completed_store_events == [event]
    for e in range(4):
        for i in range(4):
            assert torch.equal(w.host_pool[1 + 4 * e + i], expected[e][i])
    # 4. loads of two events back into fresh GPU blocks, released out of order
    w.start_load(load(10, [40, 41], [5, 6], ["a"]))
    w.start_load(load(11, [50, 51, 52], [13, 14, 15], ["b", "c"]))
    held = sorted(faulty.held_job_ids())
    faulty.release(held[1])
    assert next_report(w).finished_load_reqs == ["b", "c"]
    faulty.release(held[0])
    assert w.get_finished(wait_for_loads=True).finished_load_reqs == ["a"]
    assert torch.equal(block_bytes(kv, 52), expected[3][2]) and torch.equal(block_bytes(kv, 40), expected[1][0])
    assert w.num_in_flight == 0
    w.shutdown()


def test_many_random_jobs_all_reported_once():
    w, kv = make_worker(num_cpu_blocks=64, backend=FaultyBackend(CpuBackend(2), delay_s=lambda j: 0.001 * (j.job_id % 3)))
    for e in range(30):
        base = 1 + (e * 7) % 50
        w.start_store(store(e, list(range(base, base + 5)), [1 + (e * 2 + k) % 63 for k in range(0, 10, 2)]))
    w.wait_all()
    done = w.get_finished(wait_for_loads=False).completed_store_events
    assert sorted(done) == list(range(30))
    w.shutdown()


def test_failed_load_reports_blocks_and_still_finishes_request():
    faulty = FaultyBackend(CpuBackend(2), fail_loads=[7])
    w, kv = make_worker(backend=faulty)
    w.start_store(store(1, [1, 2, 3], [1, 2, 3]))
    w.wait_all()
    w.get_finished()
    stale = block_bytes(kv, 20).clone()
    w.start_load(load(7, [20, 21], [1, 2], ["r1", "r2"]))
    report = w.get_finished()
    assert report.finished_load_reqs == ["r1", "r2"]
    assert sorted(report.failed_load_gpu_blocks) == [20, 21] and report.bytes_loaded == 0
    assert torch.equal(block_bytes(kv, 20), stale)  # never half-written by the injected failure
    w.shutdown()


def test_partially_failed_load_reports_only_failed_blocks():
    w, kv = make_worker(backend=FaultyBackend(CpuBackend(2), fail_load_gpu_blocks=[31]))
    w.start_store(store(1, [1, 2], [4, 5]))
    w.wait_all()
    w.get_finished()
    w.start_load(load(2, [30, 31], [4, 5], ["r"]))
    report = w.get_finished()
    assert report.finished_load_reqs == ["r"] and report.failed_load_gpu_blocks == [31]
    assert torch.equal(block_bytes(kv, 30), block_bytes(kv, 1)) and report.bytes_loaded == w.bytes_per_block
    w.shutdown()


def test_failed_store_is_never_completed():
    w, _ = make_worker(backend=FaultyBackend(CpuBackend(2), fail_stores=[2], seed=1))
    for e in (1, 2, 3):
        w.start_store(store(e, [e], [e]))
    w.wait_all()
    report = w.get_finished()
    assert sorted(report.completed_store_events) == [1, 3] and report.failed_store_events == [2]
    assert report.bytes_stored == 2 * w.bytes_per_block
    w.shutdown()


def test_pool_is_exact_and_ids_outside_it_are_refused():
    w, _ = make_worker(num_cpu_blocks=8)
    assert w.host_pool.nbytes == 8 * w.bytes_per_block and w.num_cpu_blocks == 8
    for bad in ([8], [0], [3, 3]):
        with pytest.raises(WorkerInvariantError):
            w.start_store(store(1, list(range(1, 1 + len(bad))), bad))
    assert w.num_in_flight == 0 and w.get_finished().is_empty
    w.shutdown()


def test_pool_sized_from_cpu_bytes_and_world_size():
    w = OffloadWorker(load_config({"cpu_bytes": "1MiB", "transfer": {"backend": "cpu"}}), world_size=2)
    w.register_kv_caches({"l": torch.zeros(NUM_GPU_BLOCKS, 1024, dtype=torch.float16)})  # 2 KiB blocks
    assert w.num_cpu_blocks == (1 << 20) // 2 // 2048 and w.host_pool.nbytes == (1 << 19)
    w.shutdown()


def test_pool_errors_before_allocating():
    with pytest.raises(ConfigError, match="fewer than 2 blocks"):
        OffloadWorker(load_config({"cpu_bytes": 4096, "transfer": {"backend": "cpu"}})).register_kv_caches(
            {"l": torch.zeros(4, 1024, dtype=torch.float32)})
    with pytest.raises(HostPoolError, match="available memory"):
        check_pool_size(1000, 1 << 20, available=1 << 20)
    with pytest.raises(HostPoolError, match=">= 2"):
        check_pool_size(1, 1024, available=None)

    def never(nbytes: int) -> torch.Tensor:
        raise AssertionError("allocated despite a failed size check")

    from worker_side.block_layout import tensor_block_view
    with pytest.raises(HostPoolError):
        HostPool([tensor_block_view("l", torch.zeros(4, 1024))], 1 << 30, never, available=1 << 30)


def test_shutdown_with_transfers_in_flight():
    w, _ = make_worker(backend=FaultyBackend(CpuBackend(1), delay_s=0.01))
    for e in range(20):
        w.start_store(store(e, [1 + e], [1 + e]))
    w.start_load(load(99, [60], [1], ["r"]))
    w.shutdown()
    w.shutdown()  # idempotent
    with pytest.raises(WorkerClosedError):
        w.start_store(store(100, [1], [2]))
    w.wait_all()
    report = w.get_finished(wait_for_loads=False)
    assert report.finished_load_reqs == ["r"]
    assert sorted(report.completed_store_events + report.failed_store_events) == list(range(20))


def test_empty_events_finish_immediately():
    w, _ = make_worker()
    w.start_load(load(5, [], [], ["zero"]))
    w.start_store(store(6, [], []))
    report = w.get_finished()
    assert report.finished_load_reqs == ["zero"] and report.completed_store_events == [6]
    assert w.get_finished().is_empty  # reported once: never again on a later call
    w.shutdown()


def test_auto_backend_is_cpu_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    w = OffloadWorker(load_config({"num_cpu_blocks": 4}))
    assert w.backend.name == "cpu"
    w.shutdown()


def test_a_pool_too_big_for_the_machine_is_explained_in_gib():
    """Issue 12 item 7: the message quoted raw byte counts; issue 30: and a 32 KiB block as "0.03 MiB"."""
    with pytest.raises(HostPoolError, match=r"1,048,576 blocks x 1 MiB = 1 TiB does not fit in available memory \(1 GiB"):
        check_pool_size(1 << 20, 1 << 20, available=1 << 30)
    with pytest.raises(HostPoolError, match=r"x 32 KiB = 10 TiB does not fit"):
        check_pool_size(10 * 2**40 // 2**15, 2**15, available=1 << 30)
