"""No store job starts writing a host block that a load job in flight still reads.

The scheduler never sends such a store, save into a slot its step's load lent (`store_after_load`). The
worker checks the rest itself, over every copy in flight whatever step issued it: a store the metadata
did not order after such a load (a scheduler bug) starts after it anyway, and is counted
(`num_stores_held_for_loads`) and logged. Told on a stalled load: the copy that runs late must still read
the bytes that were there when it was issued.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
from cudasim_helpers import slots_swapped_on_sim
from worker_helpers import block_bytes, load, make_worker, next_report, store

from offload_connector.metadata import TransferMetadata
from worker_side import CpuBackend, OffloadWorker
from worker_side.load_reads import LoadReads
from worker_side.testing.faults import FaultyBackend


def stall_loads(event_ids: set[int]) -> FaultyBackend:
    return FaultyBackend(CpuBackend(2), stall=lambda job: job.kind == "load" and job.event_id in event_ids)


def store_over_a_stalled_load(second_store: TransferMetadata, load_timeout_s: float | None = None):
    """GPU blocks 1, 2 are stored into slots 3, 4; step 1 loads those slots into GPU blocks 40, 41 and its
    load stalls; step 2 stores `second_store`. Returns (the load brought back blocks 1 and 2, the slots hold
    the second store's blocks, stores held behind a load, the worker's report of step 2)."""
    faulty = stall_loads({1})
    w, kv = make_worker(backend=faulty)
    if load_timeout_s is not None:
        w.load_timeout_s = load_timeout_s
    w.start_store(store(0, [1, 2], [3, 4]))
    assert next_report(w).completed_store_events == [0]
    w.start_load(load(1, [40, 41], [3, 4], ["r"]))
    report = w.get_finished(wait_for_loads=False)
    if load_timeout_s is not None:  # reported failed at its deadline; its copy has not even started
        while not report.expired_load_events:
            time.sleep(load_timeout_s)
            report = w.get_finished(wait_for_loads=False)
        assert report.expired_load_events == [1] and report.failed_load_reqs == ["r"]
    else:
        assert report.is_empty
    w.start_store(second_store)
    time.sleep(0.02)  # a store not held back has run by now
    held = sorted(faulty.held_job_ids())
    faulty.release_all()
    w.wait_all()
    later = w.get_finished(wait_for_loads=False)
    loaded = all(block_bytes(kv, 40 + i).equal(block_bytes(kv, 1 + i)) for i in range(2))
    gpu = second_store.store_gpu_blocks
    stored = all(block_bytes(kv, g).equal(w.host_pool[c]) for g, c in zip(gpu, second_store.store_cpu_blocks,
                                                                            strict=True))
    count = w.num_stores_held_for_loads
    w.shutdown()
    return loaded, stored, count, held, later


def test_a_store_into_slots_an_earlier_steps_load_reads_starts_after_that_load(caplog):
    with caplog.at_level(logging.WARNING, logger="worker_side.worker"):
        loaded, stored, count, held, later = store_over_a_stalled_load(store(2, [5, 6], [4, 9]))
    assert held == [2, 3]  # the store waits behind the stalled load
    assert (loaded, stored, count) == (True, True, 1)
    assert later.completed_store_events == [2] and later.finished_load_reqs == ["r"]
    assert "store event 2 writes host blocks that load events [1] still read" in caplog.text


def test_without_the_check_the_late_load_reads_the_stores_bytes(monkeypatch):
    """The planted bug: the worker trusts the metadata. The store overwrites slot 4 before the stalled load
    reads it."""
    monkeypatch.setattr(LoadReads, "readers", lambda self, cpu_block_ids: ())
    loaded, stored, count, held, _ = store_over_a_stalled_load(store(2, [5, 6], [4, 9]))
    assert (loaded, stored, count, held) == (False, True, 0, [2])


def test_an_expired_load_holds_a_store_into_its_slots_until_its_copy_ends():
    """A load past its deadline was reported failed, but its copy still reads: a store into its slots
    waits for that copy, as the scheduler's quarantine of those slots would have it."""
    loaded, stored, count, held, later = store_over_a_stalled_load(store(2, [5, 6], [3, 4]), load_timeout_s=0.01)
    assert (loaded, stored, count, held) == (True, True, 1, [2, 3])
    assert later.ended_load_events == [1] and later.completed_store_events == [2]


def test_a_store_into_other_slots_runs_at_once_and_is_not_counted():
    loaded, stored, count, held, _ = store_over_a_stalled_load(store(2, [5, 6], [7, 8]))
    assert (loaded, stored, count, held) == (True, True, 0, [2])


def test_a_store_the_metadata_orders_after_its_steps_load_is_not_counted():
    """`store_after_load` orders the store after this step's load already: nothing to add, nothing counted;
    the same step without the flag is the scheduler's bug, ordered and counted."""
    for after in (True, False):
        faulty = stall_loads({1})
        w, kv = make_worker(backend=faulty)
        w.start_store(store(0, [1, 2], [3, 4]))
        assert next_report(w).completed_store_events == [0]
        meta = TransferMetadata(load_event=1, load_gpu_blocks=[40, 41], load_cpu_blocks=[3, 4],
                                load_event_reqs=["r"], store_event=1, store_gpu_blocks=[5, 6],
                                store_cpu_blocks=[3, 4], store_after_load=after)
        w.start_load(meta)
        w.start_store(meta)
        assert sorted(faulty.held_job_ids()) == [2, 3]
        faulty.release_all()
        w.wait_all()
        assert all(block_bytes(kv, 40 + i).equal(block_bytes(kv, 1 + i)) for i in range(2))
        assert w.num_stores_held_for_loads == (0 if after else 1)
        w.shutdown()


def test_a_finished_load_no_longer_holds_stores():
    w, _ = make_worker()
    w.start_store(store(0, [1, 2], [3, 4]))
    next_report(w)
    w.start_load(load(1, [40, 41], [3, 4], ["r"]))
    assert w.get_finished().finished_load_reqs == ["r"]  # the CPU backend waits for the step's loads
    w.start_store(store(1, [5], [3]))
    w.wait_all()
    assert w.get_finished().completed_store_events == [1] and w.num_stores_held_for_loads == 0
    w.shutdown()


def test_load_reads_counts_a_block_read_twice_and_forgets_a_finished_job():
    reads = LoadReads(10)
    reads.add(1, np.array([3, 3, 4]))
    reads.add(2, np.array([4, 5]))
    assert reads.readers(np.array([3])) == (1,) and reads.readers(np.array([4, 9])) == (1, 2)
    assert reads.readers(np.array([6, 7])) == () and reads.readers(np.array([], np.int64)) == ()
    reads.remove(1)
    assert reads.readers(np.array([3, 4])) == (2,) and reads.num_jobs == 1
    reads.remove(1)  # (no-op)
    reads.remove(2)
    assert reads.readers(np.array([3, 4, 5])) == () and reads.num_jobs == 0


def test_a_load_the_backend_refused_reads_nothing(monkeypatch):
    """A load whose submission failed is not in flight: a later store into its slots is not held."""
    w, _ = make_worker()

    def refuse(job):
        raise RuntimeError("refused")

    monkeypatch.setattr(w.backend, "submit", refuse)
    with pytest.raises(RuntimeError, match="refused"):
        w.start_load(load(1, [40], [3], ["r"]))
    monkeypatch.undo()
    w.start_store(store(1, [5], [3]))
    w.wait_all()
    assert w.get_finished().completed_store_events == [1] and w.num_stores_held_for_loads == 0
    w.shutdown()


@pytest.mark.cudasim
@pytest.mark.parametrize("check", [True, False])
def test_on_the_simulated_gpu_a_later_steps_store_waits_for_the_load(monkeypatch: pytest.MonkeyPatch,
                                                                      check: bool) -> None:
    """Twelve seeded schedules that let copies queue up and run in any order the streams allow: step 1 loads
    slots 3, 4 (its copy may still be queued at step 2), step 2 stores other blocks into them without
    `store_after_load`. With the worker's check every load brings back the old bytes; without it (the
    planted bug) some schedule lets the store go first."""
    if not check:
        monkeypatch.setattr(LoadReads, "readers", lambda self, cpu_block_ids: ())

    def load_then_store(w: OffloadWorker) -> None:
        w.begin_step()
        w.start_load(load(1, [7, 8], [3, 4], ["r"]))
        w.get_finished()  # (polls: the load may still be queued)
        w.begin_step()
        w.start_store(store(1, [5, 6], [3, 4]))

    runs = [slots_swapped_on_sim(seed, load_then_store) for seed in range(12)]
    wrong, held = sum(not right for right, _ in runs), sum(n for _, n in runs)
    assert (wrong == 0 and held > 0) if check else (wrong > 0 and held == 0), (wrong, held)
