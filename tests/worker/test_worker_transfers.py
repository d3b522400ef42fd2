"""OffloadWorker stories: interleaved jobs finishing out of order, failures, block-id bounds, shutdown, and
what the worker checks and reports (refused metadata, steps, polling before registration, transfer figures)."""

from __future__ import annotations

import time
import types

import pytest
import torch
from worker_helpers import (
    NUM_GPU_BLOCKS,
    block_bytes,
    cpu_worker,
    load,
    make_worker,
    next_report,
    random_bytes,
    store,
)

from offload_connector.metadata import TransferMetadata, WorkerReport
from worker_side import CpuBackend, WorkerClosedError, WorkerInvariantError
from worker_side import worker as worker_module
from worker_side.backends.base import CopyJob, JobResult
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


# ---- the worker's checks and reports ---------------------------------------------------------------------
def test_refused_metadata_names_the_event_the_side_and_exactly_the_bad_ids():
    """Found by mutation testing of worker_side/worker.py (docs/mutation.md)."""
    w = cpu_worker(num_cpu_blocks=8)
    w.register_kv_caches({"l": random_bytes((NUM_GPU_BLOCKS, 64), 10)})
    with pytest.raises(WorkerInvariantError, match=r"^store event 9: destination block ids \[0, 8\] outside \[1, 8\)"):
        w.start_store(TransferMetadata(store_event=9, store_gpu_blocks=[1, 2, 3], store_cpu_blocks=[1, 0, 8]))
    with pytest.raises(WorkerInvariantError, match=r"^load event 4: source block ids \[9\] outside \[1, 8\)"):
        w.start_load(TransferMetadata(load_event=4, load_gpu_blocks=[1], load_cpu_blocks=[9], load_event_reqs=["r"]))
    with pytest.raises(WorkerInvariantError, match=r"^store event 5: source block ids \[64\] outside \[1, 64\)"):
        w.start_store(TransferMetadata(store_event=5, store_gpu_blocks=[NUM_GPU_BLOCKS], store_cpu_blocks=[1]))
    assert w.num_in_flight == 0
    w.shutdown()


class StepCountingBackend(CpuBackend):
    def __init__(self) -> None:
        super().__init__(1)
        self.steps_begun = 0

    def begin_step(self) -> None:
        self.steps_begun += 1


def test_steps_reach_the_backend_only_between_registration_and_shutdown():
    """Found by mutation testing of worker_side/worker.py (docs/mutation.md)."""
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


def test_a_worker_polled_before_registration_reports_nothing():
    """Found by mutation testing of worker_side/worker.py (docs/mutation.md)."""
    w = cpu_worker()
    w.begin_step()
    assert w.get_finished().is_empty and w.get_finished(wait_for_loads=True).is_empty
    w.shutdown()



def test_an_unregistered_worker_has_no_gpu_blocks_and_reports_as_rank_0():
    """Found by mutation testing of worker_side/worker.py (docs/mutation.md)."""
    w = cpu_worker()
    assert w.num_gpu_blocks == 0
    assert w.get_finished() == WorkerReport(rank=0)
    w.shutdown()



class UnknownJobBackend(CpuBackend):
    def poll(self) -> list[JobResult]:
        return [JobResult(999)]


def test_a_backend_reporting_a_job_never_submitted_is_our_bug():
    """Found by mutation testing of worker_side/worker.py (docs/mutation.md)."""
    w = cpu_worker(backend=UnknownJobBackend(1))
    w.register_kv_caches({"l": random_bytes((NUM_GPU_BLOCKS, 64), 11)})
    with pytest.raises(WorkerInvariantError, match="job 999, which is not in flight"):
        w.get_finished()
    w.shutdown()


def test_waiting_for_this_steps_loads_never_waits_for_a_store():
    """Found by mutation testing of worker_side/worker.py (docs/mutation.md)."""
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
    """Found by mutation testing of worker_side/worker.py (docs/mutation.md)."""
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



def test_transfer_seconds_are_finish_minus_submit_and_never_negative(monkeypatch):
    """An empty load finishes at submission: its time is the clock between the two readings (clamped at 0
    when a backend's clock reads earlier than the worker's).

    Found by mutation testing of worker_side/worker.py (docs/mutation.md)."""
    w = cpu_worker()
    w.register_kv_caches({"l": torch.zeros(NUM_GPU_BLOCKS, 64, dtype=torch.uint8)})
    for readings, expected in (((10.0, 10.25), 0.25), ((10.0, 9.5), 0.0)):
        clock = iter(readings)
        monkeypatch.setattr(worker_module, "time", types.SimpleNamespace(perf_counter=lambda c=clock: next(c)))
        w.start_load(TransferMetadata(load_event=1, load_event_reqs=["r"]))
        report = w.get_finished()
        assert report.finished_load_reqs == ["r"] and report.load_seconds == expected and report.bytes_loaded == 0
    w.shutdown()
