"""Which requests the connector tracks, and from when: a finish or preemption of a request it never saw
changes nothing, an allocation without a lookup starts tracking, an unknown scheduled request hides none
after it, a request preempted and recomputed stores from its first block, and a GPU hit ending mid-block
gets no CPU hit."""

from __future__ import annotations

from helpers import FakeRequest, admit, finish, make_scheduler, report, step_done, store_and_finish

BS = 4


def test_finish_and_preemption_of_an_unknown_request_change_nothing():
    """Found by mutation testing of scheduler_side/scheduler.py (docs/mutation.md)."""
    sched, _ = make_scheduler(block_size=BS)
    assert sched.request_finished(FakeRequest("ghost", list(range(9)), BS)) == (False, None)
    sched.request_preempted("ghost")
    assert not sched.has_request("ghost") and sched.is_idle()


def test_an_allocation_without_a_lookup_starts_tracking_the_request():
    """Found by mutation testing of scheduler_side/scheduler.py (docs/mutation.md)."""
    sched, gpu = make_scheduler(block_size=BS)
    a = FakeRequest("A", list(range(9)), BS)
    ids = [b.block_id for b in gpu.allocate(3)]
    sched.update_state_after_alloc(a, ids, 0)
    assert sched.has_request("A") and sched.phase_of("A").value == "running"
    meta = sched.build_connector_meta([step_done("A", ids, 9)])
    assert meta.store_gpu_blocks == ids[:2]


def test_an_unknown_scheduled_request_does_not_hide_the_ones_after_it():
    """Found by mutation testing of scheduler_side/stores.py (docs/mutation.md)."""
    sched, gpu = make_scheduler(block_size=BS)
    a = FakeRequest("A", list(range(9)), BS)
    _, _, ids = admit(sched, gpu, a)
    meta = sched.build_connector_meta([step_done("never-looked-up", [50, 51], 9), step_done("A", ids, 9)])
    assert meta.store_gpu_blocks == ids[:2]


def test_a_preempted_request_recomputed_without_a_lookup_stores_from_its_first_block():
    """Found by mutation testing of scheduler_side/stores.py (docs/mutation.md)."""
    # eager: A's first store failed; preempted, then re-allocated straight away (no lookup in between)
    sched, gpu = make_scheduler(block_size=BS)
    a = FakeRequest("A", list(range(9)), BS)
    _, _, ids = admit(sched, gpu, a)
    meta = sched.build_connector_meta([step_done("A", ids, 9)])
    sched.update_connector_output(report(failed_store_events=[meta.store_event]))
    sched.request_preempted("A")
    gpu.free([gpu.blocks[i] for i in reversed(ids)])
    new_ids = [b.block_id for b in gpu.allocate(3)]
    sched.update_state_after_alloc(a, new_ids, 0)
    meta = sched.build_connector_meta([step_done("A", new_ids, 9, replace=True)])
    assert meta.store_gpu_blocks == new_ids[:2]
    sched.update_connector_output(report(completed_store_events=[meta.store_event]))
    finish(sched, gpu, a, new_ids)
    assert sched.is_idle()


def test_a_partial_gpu_hit_gets_no_cpu_hit():
    """Found by mutation testing of scheduler_side/lookups.py (docs/mutation.md)."""
    sched, gpu = make_scheduler(block_size=BS)
    store_and_finish(sched, gpu, FakeRequest("A", list(range(13)), BS))  # 3 blocks on the CPU
    b = FakeRequest("B", list(range(13)), BS)
    assert sched.get_num_new_matched_tokens(b, 6) == (0, False)  # the CPU run would start mid-block
    assert sched.phase_of("B").value == "looked up"
    sched.update_state_after_alloc(b, [blk.block_id for blk in gpu.allocate(4)], 0)
    assert sched.phase_of("B").value == "running"
