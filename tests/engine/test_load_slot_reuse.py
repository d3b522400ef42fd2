"""A store written into the CPU slot of a block its step's load reads (lazy, under CPU pressure).

Under CPU pressure the lazy policy forgets a loaded block's CPU copy once the load is done, so the slot can
take one of the same step's stores at once instead of that store evicting an older block: the metadata
says `store_after_load` and the worker starts that store only after the step's load read its sources.
The tests check the worker's ordering on the CPU backend (a stalled load holds the store back) and on the
simulated GPU under adversarial stream schedules, and plant the missing ordering as a bug: the load then
brings back the store's bytes, and the fake model's KV checks see wrong K/V. Metadata that forgets the flag
alone is caught by the worker's own check of the loads in flight (tests/worker/test_store_after_load_reads.py),
which orders the store anyway: the bug then needs that check gone too.
"""

from __future__ import annotations

import time

import msgspec
import pytest
from cudasim_helpers import caught, slots_swapped_on_sim
from remote_helpers import reference_outputs
from worker_helpers import block_bytes, make_worker, next_report, store

from offload_connector.config import OffloadConfig
from offload_connector.fake_engine import FakeEngine, StoreReadOverlapError
from offload_connector.fake_engine.model import IntegrityError
from offload_connector.fake_engine.workload import Workload, random_workload, run_workload, small_config
from offload_connector.metadata import TransferMetadata
from worker_side import CpuBackend, OffloadWorker
from worker_side.backends.cuda.backend import CudaBackend
from worker_side.errors import WorkerInvariantError
from worker_side.load_reads import LoadReads
from worker_side.testing.faults import FaultyBackend


def swap_step(event: int, after: bool = True) -> TransferMetadata:
    """CPU slots 3, 4 are loaded into GPU blocks 40, 41 while GPU blocks 5, 6 are stored into them."""
    return TransferMetadata(load_event=event, load_gpu_blocks=[40, 41], load_cpu_blocks=[3, 4],
                            load_event_reqs=["r"], store_event=event, store_gpu_blocks=[5, 6],
                            store_cpu_blocks=[3, 4], store_after_load=after)


def run_swap_with_a_stalled_load(after: bool) -> tuple[bool, bool]:
    """The load is stalled while the step's store is submitted; returns (the load brought back the old
    bytes, the slots hold the stored blocks) once both ran. Without `after` the worker's own check orders
    the store (and counts it), unless the test turned that check off."""
    faulty = FaultyBackend(CpuBackend(2), stall=lambda job: job.kind == "load")
    w, kv = make_worker(backend=faulty)
    w.start_store(store(0, [1, 2], [3, 4]))
    assert next_report(w).completed_store_events == [0]
    meta = swap_step(1, after)
    w.start_load(meta)
    w.start_store(meta)
    time.sleep(0.02)  # an unordered store has run by now
    ordered = after or w.num_stores_held_for_loads == 1
    assert sorted(faulty.held_job_ids()) == ([2, 3] if ordered else [2])  # the store waits behind the load
    faulty.release_all()
    w.wait_all()
    loaded = all(block_bytes(kv, 40 + i).equal(block_bytes(kv, 1 + i)) for i in range(2))
    stored = all(block_bytes(kv, 5 + i).equal(w.host_pool[3 + i]) for i in range(2))
    w.shutdown()
    return loaded, stored


def test_a_store_into_the_slots_a_load_reads_runs_after_the_load() -> None:
    assert run_swap_with_a_stalled_load(after=True) == (True, True)


def test_without_store_after_load_the_load_reads_the_stores_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted bug: the same step without the ordering, and no worker check of the loads in flight. The
    store overwrites the slots first."""
    monkeypatch.setattr(LoadReads, "readers", lambda self, cpu_block_ids: ())
    assert run_swap_with_a_stalled_load(after=False) == (False, True)


def test_store_after_load_without_a_load_is_a_scheduler_bug() -> None:
    w, _ = make_worker()
    with pytest.raises(WorkerInvariantError, match="has no load event"):
        w.start_store(TransferMetadata(store_event=0, store_gpu_blocks=[1], store_cpu_blocks=[3],
                                       store_after_load=True))
    w.shutdown()


@pytest.mark.cudasim
@pytest.mark.parametrize("wait", [True, False])
def test_on_the_simulated_gpu_the_store_stream_waits_for_the_load(monkeypatch: pytest.MonkeyPatch,
                                                                  wait: bool) -> None:
    """Twelve seeded schedules that let copies queue up and then run them in any order the streams allow:
    with the wait on the load's event every load brings back the old bytes; without it (the planted bug)
    some schedule lets the store go first."""
    if not wait:
        monkeypatch.setattr(CudaBackend, "_wait_for_jobs", lambda self, job_ids, stream: None)

    def swap(w: OffloadWorker) -> None:
        w.begin_step()
        meta = TransferMetadata(load_event=1, load_gpu_blocks=[7, 8], load_cpu_blocks=[3, 4], load_event_reqs=["r"],
                                store_event=1, store_gpu_blocks=[5, 6], store_cpu_blocks=[3, 4], store_after_load=True)
        w.start_load(meta)
        w.start_store(meta)

    wrong = sum(not slots_swapped_on_sim(seed, swap)[0] for seed in range(12))
    assert (wrong == 0) if wait else (wrong > 0), wrong


def lazy_config(num_gpu_blocks: int = 14, num_cpu_blocks: int = 12, **overrides) -> OffloadConfig:
    return small_config(num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks, store_policy="lazy",
                        **overrides)


def assert_outputs_unchanged(engine: FakeEngine, wl: Workload) -> None:
    """Every finished request's output equals a run without the connector (requests longer than the GPU
    pool are rejected: the others must all finish)."""
    reference = reference_outputs(wl)
    assert len(engine.outputs) + engine.stats.rejected_requests == len(wl.requests)
    for request_id, tokens in engine.outputs.items():
        assert tokens == reference[request_id], request_id


def test_lazy_stores_reuse_loaded_slots_and_every_read_is_right() -> None:
    reused = loaded = 0
    for seed in range(6):
        wl = random_workload(seed, num_requests=40)
        with FakeEngine(lazy_config()) as engine:
            run_workload(engine, wl)
            conn = engine.connector
            assert conn is not None
            reused += conn.stats.num_reused_load_slots
            loaded += conn.stats.num_loaded_blocks
            assert engine.check() == 0 and engine.stats.integrity_errors == 0
            assert_outputs_unchanged(engine, wl)
            conn.check_integrity()
    assert 0 < reused <= loaded, (reused, loaded)


def test_eager_keeps_loaded_copies_and_reuses_no_slot() -> None:
    """An inclusive tier keeps a loaded block's CPU copy (a hit for the next request): no slot is lent."""
    for seed in range(3):
        with FakeEngine(small_config(num_gpu_blocks=14, num_cpu_blocks=12)) as engine:
            run_workload(engine, random_workload(seed, num_requests=40))
            assert engine.connector is not None and engine.connector.stats.num_reused_load_slots == 0


class CountingFaulty(FaultyBackend):
    """Counts the jobs stalled only because they follow a stalled one (`job.after`)."""

    num_behind = 0

    def submit(self, job) -> None:
        super().submit(job)
        with self._lock:
            fate = self._fates.get(job.job_id)
            self.num_behind += bool(fate is not None and fate.behind)


def run_with_stalled_loads(seed: int) -> tuple[int, int, bool]:
    """Every other load stalls, mostly past its deadline (its request recomputes into the same blocks), and
    runs late. Returns (stores held behind a stalled load, loads given up on, a wrong K/V was read)."""
    cfg = lazy_config()
    cfg = msgspec.structs.replace(cfg, transfer=msgspec.structs.replace(cfg.transfer, load_timeout_s=0.005))
    wl = random_workload(seed, num_requests=40)
    backend = CountingFaulty(CpuBackend(2), stall=lambda job: job.kind == "load" and job.event_id % 2 == 0)
    with FakeEngine(cfg, backend=backend) as engine:
        try:
            for request_id, prompt, max_tokens in wl.requests:
                engine.add_request(request_id, prompt, max_tokens)
            for step in range(100_000):
                if not engine.has_unfinished():
                    break
                engine.step()
                if step % 7 == 6:
                    backend.release_all()
            backend.release_all()
            engine.drain()
        except IntegrityError:
            return backend.num_behind, 0, True
        conn = engine.connector
        assert conn is not None and conn.num_blocks_in_quarantine == 0
        wrong = engine.check() > 0 or engine.stats.integrity_errors > 0
        if not wrong:
            assert_outputs_unchanged(engine, wl)
        return backend.num_behind, conn.stats.num_load_timeouts, wrong


def test_stalled_and_expired_loads_hold_back_the_stores_into_their_slots() -> None:
    """The stores that took a stalled load's slots run after it, or its late copy would write a store's
    bytes into the blocks its request recomputed."""
    runs = [run_with_stalled_loads(seed) for seed in range(8)]
    assert not any(wrong for _, _, wrong in runs)
    assert sum(b for b, _, _ in runs) > 0 and sum(t for _, t, _ in runs) > 0, runs


def drop_store_after_load(monkeypatch: pytest.MonkeyPatch) -> None:
    start_store = OffloadWorker.start_store
    monkeypatch.setattr(OffloadWorker, "start_store",
                        lambda self, meta: start_store(self, msgspec.structs.replace(meta, store_after_load=False)))


def test_a_store_not_held_behind_a_stalled_load_corrupts_its_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted bug: the worker drops `store_after_load` and does not check its loads in flight."""
    drop_store_after_load(monkeypatch)
    monkeypatch.setattr(LoadReads, "readers", lambda self, cpu_block_ids: ())
    assert any(wrong for _, _, wrong in (run_with_stalled_loads(seed) for seed in range(8)))


def test_a_store_the_metadata_does_not_order_is_held_by_the_worker_and_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """Metadata without `store_after_load` (a scheduler bug): the workers' check of their loads in flight
    orders those stores after the stalled loads anyway, so no request reads wrong K/V, and the engine's
    check reports the overlap."""
    drop_store_after_load(monkeypatch)
    reported = 0
    for seed in range(8):
        try:
            _, _, wrong = run_with_stalled_loads(seed)
        except StoreReadOverlapError:
            reported += 1
        else:
            assert not wrong, seed
    assert reported > 0


@pytest.mark.cudasim
def test_a_missing_wait_for_the_load_is_an_integrity_error_in_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lazy replays on the simulated GPU with a small CPU tier: clean as built; with the store stream no
    longer waiting for the load (the planted bug) some run reads wrong K/V."""
    lazy = dict(store_policy="lazy", num_cpu_blocks=8, schedule="copy_lag")
    assert caught(range(1, 40, 2), **lazy) == []
    monkeypatch.setattr(CudaBackend, "_wait_for_jobs", lambda self, job_ids, stream: None)
    assert caught(range(1, 40, 2), **lazy), "no run noticed the store racing the load"


def test_a_scheduler_for_a_shared_host_pool_lends_no_loaded_slot() -> None:
    """Ranks sharing one host pool (MLA's latent under TP) do not order their copies against one another's:
    with `lend_load_slots=False` the same pressure-heavy workloads write no store into a slot loaded in the
    same step, and every output is still right."""
    loaded = 0
    for seed in range(3):
        wl = random_workload(seed, num_requests=40)
        with FakeEngine(lazy_config()) as engine:
            conn = engine.connector
            assert conn is not None and conn.stores.lend_load_slots
            conn.stores.lend_load_slots = False  # as OffloadScheduler(..., lend_load_slots=False) builds it
            run_workload(engine, wl)
            assert conn.stats.num_reused_load_slots == 0
            loaded += conn.stats.num_loaded_blocks
            assert engine.check() == 0 and engine.stats.integrity_errors == 0
            assert_outputs_unchanged(engine, wl)
            conn.check_integrity()
    assert loaded > 0
