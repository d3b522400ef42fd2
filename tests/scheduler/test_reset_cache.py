"""Issue 16 (sleep mode): `OffloadScheduler.reset_cache` forgets the CPU tier, in flight or not.

vLLM calls it through `reset_prefix_cache(reset_connector=True)`: at every sleep (level >= 1) and after
weight updates. KV computed with the old weights must never be served afterwards, and nothing in flight
may be lost (a reference leaked or freed twice). One story per test, on the scheduler side alone.
"""

import pytest
from helpers import (
    FakeRequest,
    admit,
    assert_idle,
    finish,
    make_scheduler,
    put_under_pressure,
    report,
    step_done,
    store_and_finish,
)

from offload_connector.hashing import with_group_id
from scheduler_side import SchedulerError

BS = 4


def test_reset_cache_forgets_everything_stored_or_being_stored():
    """Found by mutation testing of scheduler_side/scheduler.py (docs/mutation.md)."""
    # max_store_wait_steps 0: C loads the blocks B's pending hit pins instead of waiting for that load
    sched, gpu = make_scheduler(num_gpu_blocks=40, num_cpu_blocks=20, block_size=BS, max_store_wait_steps=0)
    prefix = list(range(9))  # 2 full blocks
    store_and_finish(sched, gpu, FakeRequest("A", prefix, BS))
    # 1. B holds a pending hit on A's blocks; C's load from them is in flight; D's store is in flight
    b = FakeRequest("B", prefix, BS)
    assert sched.get_num_new_matched_tokens(b, 0) == (8, True)
    c = FakeRequest("C", prefix, BS)
    sched.get_num_new_matched_tokens(c, 0)  # drops nothing of B's: another request
    c_ids = [b.block_id for b in gpu.allocate(3)]
    sched.update_state_after_alloc(c, c_ids, 8)
    load_meta = sched.build_connector_meta([])
    d = FakeRequest("D", list(range(100, 109)), BS)
    _, _, d_ids = admit(sched, gpu, d)
    store_meta = sched.build_connector_meta([step_done("D", d_ids, 9)])
    assert load_meta.load_event is not None and store_meta.store_event is not None
    assert sched.has_live_requests()
    # 2. reset: B's hit is dropped (it looks up again), nothing is hit-able any more
    assert sched.reset_cache() is True
    assert sched.phase_of("B").value == "new"
    assert not sched.cpu_pool.cached
    # 3. the transfers finish: the store counts as failed and caches nothing; the load's blocks stay uncached
    sched.update_connector_output(report(completed_store_events=[store_meta.store_event],
                                         finished_load_reqs=["C"]))
    assert sched.stats.num_failed_store_blocks == 2 and sched.stats.num_stored_blocks == 2  # A's only
    assert not sched.cpu_pool.cached
    for req in (FakeRequest("A2", prefix, BS), FakeRequest("D2", list(range(100, 109)), BS)):
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        sched.request_finished(req)
    sched.request_finished(b)
    finish(sched, gpu, c, c_ids)
    finish(sched, gpu, d, d_ids)
    assert not sched.has_live_requests() and sched.is_idle()
    sched.check_integrity()


def test_reset_forgets_every_stored_block_and_publishes_removals():
    sched, gpu = make_scheduler(num_cpu_blocks=20, block_size=BS)
    a = FakeRequest("A", list(range(13)), BS)  # 3 full blocks
    # 1. A's blocks are stored: a second request with A's prompt would hit 3 blocks.
    store_and_finish(sched, gpu, a)
    assert len(sched.cpu_pool.cached) == 3
    sched.take_events()
    # 2. reset (the weights changed): nothing cached, every block free, one BlockRemoved per key.
    assert sched.reset_cache() is True
    assert not sched.cpu_pool.cached
    assert sorted(e.block_hash for e in sched.take_events() if e.kind == "removed") == sorted(
        with_group_id(h) for h in a.block_hashes)
    # 3. the same prompt again: a miss, computed from scratch.
    b = FakeRequest("B", list(range(13)), BS)
    assert sched.get_num_new_matched_tokens(b, 0) == (0, False)
    sched.request_finished(b)
    assert_idle(sched, gpu)


def test_store_in_flight_at_reset_is_never_hit_able():
    sched, gpu = make_scheduler(num_cpu_blocks=20, block_size=BS)
    a = FakeRequest("A", list(range(13)), BS)
    # 1. A's store is issued (KV computed with the old weights) but not complete at the reset.
    _, _, a_ids = admit(sched, gpu, a)
    meta = sched.build_connector_meta([step_done("A", a_ids, 13)])
    assert meta.store_event is not None
    assert sched.reset_cache() is True
    # 2. the store completes afterwards: its content is discarded, not committed.
    sched.update_connector_output(report(completed_store_events=[meta.store_event]))
    assert not sched.cpu_pool.cached and not sched.cpu_pool.reserved
    assert sched.stats.num_stored_blocks == 0 and sched.stats.num_failed_store_blocks == 3
    # 3. a request with A's prompt misses; every reference came back.
    finish(sched, gpu, a, a_ids)
    b = FakeRequest("B", list(range(13)), BS)
    assert sched.get_num_new_matched_tokens(b, 0) == (0, False)
    sched.request_finished(b)
    assert_idle(sched, gpu)


def test_load_in_flight_completes_and_its_blocks_are_not_cached_again():
    sched, gpu = make_scheduler(num_cpu_blocks=20, block_size=BS)
    store_and_finish(sched, gpu, FakeRequest("A", list(range(13)), BS))
    # 1. B hits A's 3 blocks; its load is issued.
    b = FakeRequest("B", list(range(13)), BS)
    hit, _, b_ids = admit(sched, gpu, b)
    assert hit == 12
    meta = sched.build_connector_meta([])
    assert meta.load_event_reqs == ["B"]
    # 2. reset while the load is in flight: its CPU blocks stay held (the copy reads them) but uncached.
    assert sched.reset_cache() is True
    assert not sched.cpu_pool.cached and sched.cpu_pool.num_held_blocks() == 3
    # 3. the load completes: B runs; the CPU blocks go back to the free queue, still not hit-able.
    sched.update_connector_output(report(finished_load_reqs=["B"]))
    assert sched.cpu_pool.num_held_blocks() == 0 and not sched.cpu_pool.cached
    finish(sched, gpu, b, b_ids)
    assert_idle(sched, gpu)


def test_pending_hit_is_dropped_and_looked_up_again():
    sched, gpu = make_scheduler(num_cpu_blocks=20, block_size=BS)
    store_and_finish(sched, gpu, FakeRequest("A", list(range(13)), BS))
    # 1. B is looked up (3 CPU blocks pinned) but the engine could not allocate it this step.
    b = FakeRequest("B", list(range(13)), BS)
    assert sched.get_num_new_matched_tokens(b, 0) == (12, True)
    # 2. reset: the pin is released; B's next lookup misses and it computes everything.
    assert sched.reset_cache() is True
    assert sched.cpu_pool.num_held_blocks() == 0
    hit, _, b_ids = admit(sched, gpu, b)
    assert hit == 0
    finish(sched, gpu, b, b_ids)
    assert_idle(sched, gpu)


def test_lazy_blocks_held_for_a_store_make_the_reset_report_failure():
    """Found by mutation testing of scheduler_side/scheduler.py (docs/mutation.md)."""
    sched, gpu = make_scheduler(num_gpu_blocks=4, num_cpu_blocks=8, block_size=BS,
                                store_policy="lazy", lazy_lookahead_blocks=8)
    put_under_pressure(sched)  # lazy's frontier mode
    a = FakeRequest("A", list(range(9)), BS)
    _, _, ids = admit(sched, gpu, a)
    sched.build_connector_meta([step_done("A", ids, 9)])
    finish(sched, gpu, a, ids)  # a nearly full GPU pool: the policy holds A's 2 blocks for the next store
    # 1. blocks held for the next store event (old weights): the reset cannot promise they are never
    #    stored, so it says so (vLLM's own GPU reset fails too: the blocks are in use).
    assert sched.reset_cache() is False
    # 2. one step later the store takes them; a second reset discards it (failed now) and succeeds.
    meta = sched.build_connector_meta([])
    assert len(meta.store_gpu_blocks) == 2
    assert sched.reset_cache() is True
    sched.update_connector_output(report(completed_store_events=[meta.store_event]))
    assert not sched.cpu_pool.cached
    assert_idle(sched, gpu)


def test_reset_in_the_middle_of_a_step_is_refused():
    sched, gpu = make_scheduler(num_cpu_blocks=20, block_size=BS)
    store_and_finish(sched, gpu, FakeRequest("A", list(range(13)), BS))
    b = FakeRequest("B", list(range(13)), BS)
    admit(sched, gpu, b)  # a load job created, not yet sent in build_connector_meta
    with pytest.raises(SchedulerError, match="middle of a step"):
        sched.reset_cache()
    assert len(sched.cpu_pool.cached) == 3  # unchanged
