"""The scheduler's counters (`SchedulerStats`): each adds up over steps and reports, and the snapshot
follows the field order."""

from __future__ import annotations

from helpers import (
    FakeRequest,
    admit,
    finish,
    make_scheduler,
    put_under_pressure,
    report,
    step_done,
    store_and_finish,
)

from offload_connector.hashing import with_group_id
from scheduler_side.stats import FIELDS, SchedulerStats

BS = 4


def test_stats_values_and_snapshot_follow_the_field_order():
    """Found by mutation testing of scheduler_side/stats.py (docs/mutation.md)."""
    stats = SchedulerStats()
    for i, name in enumerate(FIELDS):
        setattr(stats, name, i + 1)
    assert stats.values() == tuple(range(1, len(FIELDS) + 1))
    assert stats.snapshot() == {name: i + 1 for i, name in enumerate(FIELDS)}
    assert list(stats.snapshot()) == list(FIELDS) and FIELDS[0] == "num_lookups"


def test_transfer_figures_add_up_over_reports():
    """Found by mutation testing of scheduler_side/completions.py (docs/mutation.md)."""
    sched, _ = make_scheduler(block_size=BS, world_size=2)
    sched.update_connector_output([report(rank=0, bytes_stored=100, bytes_loaded=10, store_seconds=1.5, load_seconds=0.5),
                                   report(rank=1, bytes_stored=50, bytes_loaded=5, store_seconds=0.5, load_seconds=0.25)])
    s = sched.stats
    assert (s.bytes_stored, s.bytes_loaded, s.store_seconds, s.load_seconds) == (150, 15, 2.0, 0.75)


def test_failed_load_blocks_add_up_over_reports() -> None:
    """Found by mutation testing of scheduler_side/completions.py (docs/mutation.md)."""
    sched, _ = make_scheduler(block_size=BS)
    sched.update_connector_output(report(failed_load_gpu_blocks=[3, 4]))
    sched.update_connector_output(report(failed_load_gpu_blocks=[5]))
    assert sched.stats.num_failed_load_blocks == 3


def test_stores_skipped_for_a_pinned_full_cpu_pool_add_up():
    """Found by mutation testing of scheduler_side/stores.py (docs/mutation.md)."""
    sched, gpu = make_scheduler(num_cpu_blocks=3, block_size=BS)  # 2 usable CPU blocks
    a = FakeRequest("A", list(range(9)), BS)
    _, _, a_ids = admit(sched, gpu, a)
    meta = sched.build_connector_meta([step_done("A", a_ids, 9)])  # pins both CPU blocks (in flight)
    assert len(meta.store_gpu_blocks) == 2
    for n, name in enumerate(("B", "C")):
        req = FakeRequest(name, [100 * (n + 1) + t for t in range(13)], BS)  # 3 full blocks each
        _, _, ids = admit(sched, gpu, req)
        assert sched.build_connector_meta([step_done(name, ids, 13)]).store_event is None
        assert sched.stats.num_store_skipped_blocks == 3 * (n + 1)


def test_stores_the_cpu_tier_cannot_take_are_counted_as_skipped() -> None:
    """Found by mutation testing of scheduler_side/stores.py (docs/mutation.md)."""
    sched, gpu = make_scheduler(num_cpu_blocks=3, block_size=BS)  # 2 usable CPU blocks
    req = FakeRequest("A", list(range(17)), BS)  # 4 full blocks
    _, _, ids = admit(sched, gpu, req)
    meta = sched.build_connector_meta([step_done("A", ids, 17)])
    assert len(meta.store_gpu_blocks) == 2 and sched.stats.num_store_skipped_blocks == 2
    sched.update_connector_output(report(completed_store_events=[meta.store_event]))
    finish(sched, gpu, req, ids)


def test_lookup_counters_add_up():
    """Found by mutation testing of scheduler_side/lookups.py (docs/mutation.md)."""
    sched, gpu = make_scheduler(block_size=BS, max_store_wait_steps=0)
    a = FakeRequest("A", list(range(9)), BS)
    _, _, ids = admit(sched, gpu, a)
    sched.build_connector_meta([step_done("A", ids, 9)])  # A's store stays in flight
    for name in ("B", "C"):  # neither may wait for it: both time out at once
        req = FakeRequest(name, list(range(9)), BS)
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        sched.request_finished(req)
    assert sched.stats.num_lookups == 3 and sched.stats.num_store_wait_timeouts == 2


def test_lazy_deferred_lookups_add_up():
    """Found by mutation testing of scheduler_side/lookups.py (docs/mutation.md)."""
    sched, gpu = make_scheduler(num_gpu_blocks=12, num_cpu_blocks=20, block_size=BS,
                                store_policy="lazy", lazy_lookahead_blocks=1)
    put_under_pressure(sched)  # lazy's frontier mode
    a = FakeRequest("A", list(range(8)), BS)
    _, _, a_ids = admit(sched, gpu, a)
    sched.build_connector_meta([step_done("A", a_ids, 8)])
    for gpu_id, h in zip(a_ids, a.block_hashes, strict=True):
        gpu.cache(gpu.blocks[gpu_id], with_group_id(h))
    finish(sched, gpu, a, a_ids)  # A's two cached blocks are the tail of the GPU free queue
    gpu.touch([gpu.blocks[i] for i in range(3, 11)])  # the frontier is now 11, then A's two
    for name in ("B", "C"):  # each would allocate all three: deferred, once each
        assert sched.get_num_new_matched_tokens(FakeRequest(name, list(range(100, 111)), BS), 0) == (None, False)
    assert sched.stats.num_deferred_lookups == 2


def test_admission_counters_add_up():
    """Found by mutation testing of scheduler_side/allocations.py (docs/mutation.md)."""
    sched, gpu = make_scheduler(block_size=BS)
    store_and_finish(sched, gpu, FakeRequest("A", list(range(13)), BS))  # 3 blocks on the CPU
    admitted = []
    for name, gpu_hit_tokens in (("B", 4), ("C", 0)):  # B: one GPU-hit block, then two CPU hits
        req = FakeRequest(name, list(range(13)), BS)
        hit, _, ids = admit(sched, gpu, req, gpu_hit_tokens)
        admitted.append((req, ids))
        assert hit == (8 if gpu_hit_tokens else 12)
    assert sched.stats.num_hit_tokens == 8 + 12
    assert sched.stats.num_lookup_tokens == (13 + 13) + (13 - 4)  # A's, B's after its GPU hit, C's
    meta = sched.build_connector_meta([])
    sched.update_connector_output(report(finished_load_reqs=meta.load_event_reqs))
    for req, ids in admitted:
        finish(sched, gpu, req, ids)
    assert sched.is_idle()


def test_events_are_numbered_consecutively_and_counted_over_steps():
    """Store events are numbered 0, 1, 2, ... (a completion above the last one is refused as never issued);
    load events likewise; the counters add up over steps.

    Found by mutation testing of scheduler_side/transfers.py (docs/mutation.md)."""
    # room for two blocks; max_store_wait_steps 0: two requests of a step both load (neither waits)
    sched, gpu = make_scheduler(num_cpu_blocks=3, block_size=BS, max_store_wait_steps=0)
    store_ids, load_ids = [], []
    for n in range(3):  # each story stores 2 blocks, evicting the previous story's two from step 2 on
        req = FakeRequest(f"S{n}", [100 * n + t for t in range(9)], BS)
        _, _, ids = admit(sched, gpu, req)
        meta = sched.build_connector_meta([step_done(req.request_id, ids, 9)])
        store_ids.append(meta.store_event)
        sched.update_connector_output(report(completed_store_events=[meta.store_event]))
        finish(sched, gpu, req, ids)
    assert store_ids == [0, 1, 2]
    assert sched.stats.num_cpu_evictions == sched.cpu_pool.num_evictions == 4
    for n in range(3):  # hits on S2's two blocks: two requests in the first step, then one per step
        reqs = [FakeRequest(f"L{n}{k}", [200 + t for t in range(9)], BS) for k in range(2 if n == 0 else 1)]
        admitted = [(r, admit(sched, gpu, r)[2]) for r in reqs]
        meta = sched.build_connector_meta([])
        load_ids.append(meta.load_event)
        sched.update_connector_output(report(finished_load_reqs=meta.load_event_reqs))
        for r, ids in admitted:
            finish(sched, gpu, r, ids)
    assert load_ids == [0, 1, 2]
    assert sched.stats.num_loaded_blocks == 4 + 2 + 2
