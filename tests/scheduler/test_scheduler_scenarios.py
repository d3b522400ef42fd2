"""Scheduler-side scenarios, each one request's story as in seed 004, asserting on public behaviour."""

import logging

import pytest
from helpers import FakeRequest, admit, assert_idle, finish, free_ids, make_scheduler, report, step_done

from offload_connector.hashing import with_group_id
from scheduler_side import SchedulerError

BS = 16


def test_seed_004_story():
    sched, gpu = make_scheduler(num_gpu_blocks=100, num_cpu_blocks=50, block_size=BS)
    # Request A: one full block and a partial one; only the full block has a hash.
    a = FakeRequest("A", list(range(20)), BS)
    assert len(a.block_hashes) == 1
    # 1. admit A: the CPU cache is empty.
    hit, is_async, a_ids = admit(sched, gpu, a)
    assert (hit, is_async, a_ids) == (0, False, [1, 2])
    # 2. A's prefill completes this step: its full block is stored GPU[1] -> CPU[1].
    meta = sched.build_connector_meta([step_done("A", a_ids, 20)])
    assert (meta.store_event, meta.store_gpu_blocks, meta.store_cpu_blocks) == (0, [1], [1])
    assert meta.load_event is None
    # 3. the store completes: CPU[1] is registered and free (evictable), GPU[1] released.
    sched.update_connector_output(report(completed_store_events=[0]))
    key_a = with_group_id(a.block_hashes[0])
    assert sched.cpu_pool.lookup(key_a).block_id == 1 and sched.cpu_pool.blocks[1].ref_cnt == 0
    # 4. A finishes; its GPU copy is gone (our test GPU pool keeps no prefix cache).
    finish(sched, gpu, a, a_ids)
    # Request B shares A's first full block, then has one more full block and a partial one.
    b = FakeRequest("B", list(range(16)) + list(range(100, 120)), BS)
    assert b.block_hashes[0] == a.block_hashes[0] and len(b.block_hashes) == 2
    # 5. CPU hit of one block: CPU[1] pinned (out of the free queue).
    hit, is_async, b_ids = admit(sched, gpu, b)
    assert (hit, is_async) == (16, True)
    assert sched.cpu_pool.blocks[1].ref_cnt == 1 and 1 not in free_ids(sched.cpu_pool)
    # 6. the load: CPU[1] -> B's first GPU block, one load event; B does not run this step.
    meta = sched.build_connector_meta([])
    assert (meta.load_event, meta.load_gpu_blocks, meta.load_cpu_blocks) == (0, [b_ids[0]], [1])
    assert meta.load_event_reqs == ["B"] and meta.store_event is None
    assert gpu.blocks[b_ids[0]].ref_cnt == 1  # the request's alone: it lives, so nobody else gets it
    # 7. the load completes: the CPU block's protection is released.
    sched.update_connector_output(report(finished_load_reqs=["B"]))
    assert sched.cpu_pool.blocks[1].ref_cnt == 0 and gpu.blocks[b_ids[0]].ref_cnt == 1
    # 8. B computes the rest: only its new full block is stored.
    meta = sched.build_connector_meta([step_done("B", b_ids, 36)])
    assert (meta.store_gpu_blocks, meta.store_cpu_blocks) == ([b_ids[1]], [2])
    sched.update_connector_output(report(completed_store_events=[meta.store_event]))
    finish(sched, gpu, b, b_ids)
    # Final state: both hashes cached on the CPU, both blocks free, 1 older than 2.
    assert sched.cpu_pool.lookup(key_a).block_id == 1
    assert sched.cpu_pool.lookup(with_group_id(b.block_hashes[1])).block_id == 2
    assert free_ids(sched.cpu_pool)[-2:] == [1, 2]
    assert sched.stats.num_stored_blocks == 2 and sched.stats.num_loaded_blocks == 1
    assert_idle(sched, gpu)


def store_prefix(sched, gpu, req):
    """Admit `req`, compute all of it, complete its stores, finish it."""
    _, _, ids = admit(sched, gpu, req)
    meta = sched.build_connector_meta([step_done(req.request_id, ids, req.num_tokens)])
    if meta.store_event is not None:
        sched.update_connector_output(report(completed_store_events=[meta.store_event]))
    finish(sched, gpu, req, ids)


def test_hit_is_capped_so_one_token_is_computed():
    sched, gpu = make_scheduler(block_size=BS)
    store_prefix(sched, gpu, FakeRequest("A", list(range(32)), BS))
    again = FakeRequest("B", list(range(32)), BS)
    assert sched.get_num_new_matched_tokens(again, 0) == (16, True)  # not 32: one token must be computed
    sched.request_finished(again)
    assert_idle(sched, gpu)


def test_partial_hit_and_miss_after_gpu_hit():
    sched, gpu = make_scheduler(block_size=BS)
    store_prefix(sched, gpu, FakeRequest("A", list(range(48)), BS))
    diverging = FakeRequest("B", list(range(32)) + [999] * 20, BS)
    assert sched.get_num_new_matched_tokens(diverging, 0) == (32, True)
    assert sched.get_num_new_matched_tokens(diverging, 16) == (16, True)  # starts after the GPU hit
    assert sched.get_num_new_matched_tokens(diverging, 32) == (0, False)
    sched.request_finished(diverging)
    assert_idle(sched, gpu)


def test_stale_pending_hit_is_dropped():
    sched, gpu = make_scheduler(block_size=BS)
    store_prefix(sched, gpu, FakeRequest("A", list(range(40)), BS))
    b = FakeRequest("B", list(range(40)), BS)
    for _ in range(3):  # the engine could not schedule B, and asks again each step
        assert sched.get_num_new_matched_tokens(b, 0) == (32, True)
    assert all(blk.ref_cnt <= 1 for blk in sched.cpu_pool.blocks[1:])
    sched.update_state_after_alloc(b, [], 0)  # allocated without the external tokens
    assert_idle(sched, gpu)


def test_preempt_then_resume_from_cpu():
    sched, gpu = make_scheduler(block_size=BS)
    a = FakeRequest("A", list(range(50)), BS)
    _, _, ids = admit(sched, gpu, a)
    # 1. a first chunk of 32 tokens computes: two blocks stored.
    meta = sched.build_connector_meta([step_done("A", ids, 32)])
    assert meta.store_gpu_blocks == ids[:2]
    # 2. preempted while the store is in flight: the engine frees A's blocks; ours keep two alive.
    sched.request_preempted("A")
    gpu.free([gpu.blocks[i] for i in reversed(ids)])
    assert [gpu.blocks[i].ref_cnt for i in ids] == [1, 1, 0, 0]
    sched.update_connector_output(report(completed_store_events=[meta.store_event]))
    # 3. resumed: the two stored blocks come back from the CPU.
    hit, is_async, ids2 = admit(sched, gpu, a)
    assert (hit, is_async) == (32, True)
    meta = sched.build_connector_meta([])
    assert meta.load_gpu_blocks == ids2[:2]
    sched.update_connector_output(report(finished_load_reqs=["A"]))
    meta = sched.build_connector_meta([step_done("A", ids2, 50, replace=True)])
    assert meta.store_gpu_blocks == ids2[2:3]  # only the third full block is new
    sched.update_connector_output(report(completed_store_events=[meta.store_event]))
    finish(sched, gpu, a, ids2)
    assert_idle(sched, gpu)


def b_loading_a_prefix():
    """A's 2 full blocks are on the CPU; B (same 40 tokens) was admitted and its load sent this step."""
    sched, gpu = make_scheduler(block_size=BS)
    store_prefix(sched, gpu, FakeRequest("A", list(range(40)), BS))
    b = FakeRequest("B", list(range(40)), BS)
    _, _, ids = admit(sched, gpu, b)
    return sched, gpu, b, ids, sched.build_connector_meta([])


def test_abort_while_loading():
    sched, gpu, b, ids, meta = b_loading_a_prefix()
    # 1. aborted with the load in flight: the engine frees its blocks, the load's references remain.
    finish(sched, gpu, b, ids)
    assert [gpu.blocks[i].ref_cnt for i in ids[:2]] == [1, 1]
    assert all(i not in free_ids(gpu) for i in meta.load_gpu_blocks)
    # 2. the load completes later: everything is released, the request's state is gone.
    sched.update_connector_output(report(finished_load_reqs=["B"]))
    assert not sched.has_request("B")
    assert_idle(sched, gpu)


def test_request_id_reused_while_the_old_load_is_in_flight_waits():
    sched, gpu, b, ids, _ = b_loading_a_prefix()
    finish(sched, gpu, b, ids)  # aborted while loading
    again = FakeRequest("B", list(range(40)), BS)  # a new request under the same id
    assert sched.get_num_new_matched_tokens(again, 0) == (None, False)  # ask again: no crash
    sched.update_connector_output(report(finished_load_reqs=["B"]))
    assert sched.get_num_new_matched_tokens(again, 0) == (32, True)
    sched.update_state_after_alloc(again, [], 0)
    assert_idle(sched, gpu)


@pytest.mark.parametrize("second", ["same request again", "a new request under its id"])
def test_a_second_finish_while_the_load_runs_keeps_the_load(second):
    sched, gpu, b, ids, meta = b_loading_a_prefix()
    # 1. B finishes (aborted) with its load in flight: the load takes its own GPU references.
    finish(sched, gpu, b, ids)
    # 2. request_finished again for B's id: called twice, or a new request under the id (it waits for the
    #    old load at its lookup) aborted while that load still runs.
    if second == "a new request under its id":
        again = FakeRequest("B", list(range(40)), BS)
        assert sched.get_num_new_matched_tokens(again, 0) == (None, False)
        assert sched.request_finished(again) == (False, None)
    else:
        assert sched.request_finished(b) == (False, None)
    # 3. the load is still accounted for: its blocks stay referenced, the scheduler is not idle.
    assert not sched.is_idle() and sched.num_inflight_transfers == 1
    assert [gpu.blocks[i].ref_cnt for i in meta.load_gpu_blocks] == [1, 1]
    assert sched.cpu_pool.num_held_blocks() == 2
    sched.check_integrity()
    # 4. the load completes: every reference goes back.
    sched.update_connector_output(report(finished_load_reqs=["B"]))
    assert not sched.has_request("B")
    assert_idle(sched, gpu)


def test_abort_before_metadata_still_sends_the_load():
    sched, gpu = make_scheduler(block_size=BS)
    store_prefix(sched, gpu, FakeRequest("A", list(range(40)), BS))
    b = FakeRequest("B", list(range(40)), BS)
    _, _, ids = admit(sched, gpu, b)
    finish(sched, gpu, b, ids)
    meta = sched.build_connector_meta([])
    assert meta.load_event_reqs == ["B"]
    sched.update_connector_output(report(finished_load_reqs=["B"]))
    assert_idle(sched, gpu)


@pytest.mark.parametrize("failed", [False, True])
def test_finish_while_storing(failed):
    sched, gpu = make_scheduler(block_size=BS)
    a = FakeRequest("A", list(range(40)), BS)
    _, _, ids = admit(sched, gpu, a)
    meta = sched.build_connector_meta([step_done("A", ids, 40)])
    finish(sched, gpu, a, ids)
    assert [gpu.blocks[i].ref_cnt for i in meta.store_gpu_blocks] == [1, 1]
    key = "failed_store_events" if failed else "completed_store_events"
    sched.update_connector_output(report(**{key: [meta.store_event]}))
    b = FakeRequest("B", list(range(40)), BS)
    assert sched.get_num_new_matched_tokens(b, 0) == ((0, False) if failed else (32, True))
    sched.request_finished(b)
    assert_idle(sched, gpu)


def test_lookup_waits_for_a_store_in_flight():
    sched, gpu = make_scheduler(block_size=BS)
    a = FakeRequest("A", list(range(40)), BS)
    _, _, ids = admit(sched, gpu, a)
    meta = sched.build_connector_meta([step_done("A", ids, 40)])
    b = FakeRequest("B", list(range(40)), BS)
    assert sched.get_num_new_matched_tokens(b, 0) == (None, False)
    sched.update_connector_output(report(completed_store_events=[meta.store_event]))
    assert sched.get_num_new_matched_tokens(b, 0) == (32, True)
    sched.request_finished(b)
    finish(sched, gpu, a, ids)
    assert_idle(sched, gpu)


def test_cpu_pool_full_of_pinned_blocks_skips_stores():
    sched, gpu = make_scheduler(num_cpu_blocks=3, block_size=BS)
    store_prefix(sched, gpu, FakeRequest("A", list(range(40)), BS))  # fills both usable CPU blocks
    pinned = FakeRequest("P", list(range(40)), BS)
    assert sched.get_num_new_matched_tokens(pinned, 0) == (32, True)  # pins both
    c = FakeRequest("C", list(range(500, 540)), BS)
    _, _, ids = admit(sched, gpu, c)
    meta = sched.build_connector_meta([step_done("C", ids, 40)])
    assert meta.store_event is None and sched.stats.num_store_skipped_blocks == 2
    finish(sched, gpu, c, ids)
    sched.request_finished(pinned)
    assert_idle(sched, gpu)


def test_store_evicts_lru_cpu_blocks():
    sched, gpu = make_scheduler(num_cpu_blocks=3, block_size=BS)
    old = FakeRequest("A", list(range(40)), BS)
    store_prefix(sched, gpu, old)
    store_prefix(sched, gpu, FakeRequest("C", list(range(500, 540)), BS))
    assert sched.get_num_new_matched_tokens(FakeRequest("D", list(range(40)), BS), 0) == (0, False)
    kinds = [e.kind for e in sched.take_events()]
    assert kinds.count("stored") == 4 and kinds.count("removed") == 2
    assert sched.stats.num_cpu_evictions == 2


def test_tensor_parallel_events_need_every_rank():
    sched, gpu = make_scheduler(block_size=BS, world_size=2)
    a = FakeRequest("A", list(range(40)), BS)
    _, _, ids = admit(sched, gpu, a)
    meta = sched.build_connector_meta([step_done("A", ids, 40)])
    sched.update_connector_output([report(rank=0, completed_store_events=[meta.store_event])])
    b = FakeRequest("B", list(range(40)), BS)
    assert sched.get_num_new_matched_tokens(b, 0) == (None, False)  # rank 1 has not reported yet
    sched.update_connector_output([report(rank=1, completed_store_events=[meta.store_event])])
    _, _, b_ids = admit(sched, gpu, b)
    meta = sched.build_connector_meta([])
    cpu_id = meta.load_cpu_blocks[0]
    sched.update_connector_output([report(rank=1, finished_load_reqs=["B"])])
    assert sched.cpu_pool.blocks[cpu_id].ref_cnt == 1  # rank 0 still copying: the source stays pinned
    finish(sched, gpu, b, b_ids)  # aborted while loading: the engine drops its references
    assert gpu.blocks[b_ids[0]].ref_cnt == 1  # the load's own, until rank 0 is done writing it
    sched.update_connector_output([report(rank=0, finished_load_reqs=["B"])])
    assert gpu.blocks[b_ids[0]].ref_cnt == 0 and sched.cpu_pool.blocks[cpu_id].ref_cnt == 0
    finish(sched, gpu, a, ids)
    assert_idle(sched, gpu)


def test_a_rank_reporting_twice_completes_nothing(caplog):
    """TP 2: rank 0's report delivered twice (or an event listed twice) must not stand in for rank 1's:
    the store's CPU blocks stay un-hit-able and the load's blocks stay pinned until rank 1 reports."""
    sched, gpu = make_scheduler(block_size=BS, world_size=2)
    a = FakeRequest("A", list(range(40)), BS)
    _, _, ids = admit(sched, gpu, a)
    meta = sched.build_connector_meta([step_done("A", ids, 40)])
    with caplog.at_level(logging.WARNING):
        sched.update_connector_output([report(rank=0, completed_store_events=[meta.store_event] * 2),
                                       report(rank=0, completed_store_events=[meta.store_event])])
    assert "repeated completion" in caplog.text
    b = FakeRequest("B", list(range(40)), BS)
    assert sched.get_num_new_matched_tokens(b, 0) == (None, False)  # still being stored on rank 1
    sched.update_connector_output(report(rank=1, completed_store_events=[meta.store_event]))
    _, _, b_ids = admit(sched, gpu, b)
    cpu_id = sched.build_connector_meta([]).load_cpu_blocks[0]
    sched.update_connector_output([report(rank=0, finished_load_reqs=["B", "B"])] * 2)
    assert sched.cpu_pool.blocks[cpu_id].ref_cnt == 1  # rank 1 may still be reading it
    finish(sched, gpu, b, b_ids)  # aborted while loading
    assert gpu.blocks[b_ids[0]].ref_cnt == 1  # rank 1 may still be writing it: nobody else may get it
    sched.update_connector_output(report(rank=1, finished_load_reqs=["B"]))
    assert gpu.blocks[b_ids[0]].ref_cnt == 0 and sched.cpu_pool.blocks[cpu_id].ref_cnt == 0
    finish(sched, gpu, a, ids)
    assert_idle(sched, gpu)


@pytest.mark.parametrize("bad", [dict(completed_store_events=[-1]), dict(failed_store_events=[-3]),
                                 dict(rank=2), dict(rank=-1)])
def test_negative_event_ids_and_unknown_ranks_are_refused(bad):
    sched, gpu = make_scheduler(block_size=BS, world_size=2)
    a = FakeRequest("A", list(range(40)), BS)
    _, _, ids = admit(sched, gpu, a)
    sched.build_connector_meta([step_done("A", ids, 40)])
    with pytest.raises(SchedulerError, match="never issued|allowed: 0..1"):
        sched.update_connector_output(report(**bad))


def test_a_live_request_id_reused_by_another_request_raises():
    """Adopting the new object would store its blocks under the old prompt's hashes (wrong KV later)."""
    sched, gpu = make_scheduler(block_size=BS)
    a = FakeRequest("A", list(range(40)), BS)
    _, _, ids = admit(sched, gpu, a)
    impostor = FakeRequest("A", list(range(100, 140)), BS)
    with pytest.raises(SchedulerError, match="different request object"):
        sched.get_num_new_matched_tokens(impostor, 0)
    with pytest.raises(SchedulerError, match="different request object"):
        sched.update_state_after_alloc(impostor, ids, 0)
    meta = sched.build_connector_meta([step_done("A", ids, 40)])  # A's state is unchanged
    assert meta.store_gpu_blocks == ids[:40 // BS]  # A's full blocks, under A's hashes
    sched.update_connector_output(report(completed_store_events=[meta.store_event]))
    finish(sched, gpu, a, ids)
    assert sched.get_num_new_matched_tokens(impostor, 0) == (0, False)  # A is finished: the id is free
    assert_idle(sched, gpu)


def test_failed_load_releases_blocks_and_counts():
    sched, gpu, b, ids, meta = b_loading_a_prefix()
    sched.update_connector_output(report(finished_load_reqs=["B"], failed_load_gpu_blocks=meta.load_gpu_blocks))
    assert sched.stats.num_failed_load_blocks == 2
    finish(sched, gpu, b, ids)
    assert_idle(sched, gpu)
    # the failed blocks are not offered again (the engine recomputed them; they are stored anew)
    assert sched.get_num_new_matched_tokens(FakeRequest("C", list(range(40)), BS), 0) == (0, False)


def test_misuse_raises_and_late_completions_are_ignored(caplog):
    sched, gpu = make_scheduler(block_size=BS)
    ghost = FakeRequest("G", list(range(40)), BS)
    with pytest.raises(SchedulerError, match="never looked up"):
        sched.update_state_after_alloc(ghost, [1, 2, 3], 16)
    with pytest.raises(SchedulerError, match="never issued"):
        sched.update_connector_output(report(completed_store_events=[7]))
    a = FakeRequest("A", list(range(40)), BS)
    _, _, ids = admit(sched, gpu, a)
    meta = sched.build_connector_meta([step_done("A", ids, 40)])
    sched.update_connector_output(report(completed_store_events=[meta.store_event]))
    with caplog.at_level(logging.WARNING):
        sched.update_connector_output(report(completed_store_events=[meta.store_event],
                                             finished_load_reqs=["nobody"]))
    assert "late completion" in caplog.text and "no load in flight" in caplog.text
    finish(sched, gpu, a, ids)
    assert_idle(sched, gpu)


def test_external_tokens_without_pending_hit_raise():
    sched, gpu = make_scheduler(block_size=BS)
    a = FakeRequest("A", list(range(40)), BS)
    assert sched.get_num_new_matched_tokens(a, 0) == (0, False)
    with pytest.raises(SchedulerError, match="no pending CPU hit"):
        sched.update_state_after_alloc(a, [1, 2, 3], 16)


def test_mismatched_allocation_raises_and_changes_nothing():
    sched, gpu = make_scheduler(block_size=BS)
    store_prefix(sched, gpu, FakeRequest("A", list(range(40)), BS))
    b = FakeRequest("B", list(range(40)), BS)
    assert sched.get_num_new_matched_tokens(b, 0) == (32, True)
    pinned = [blk.ref_cnt for blk in sched.cpu_pool.blocks]
    # 1. more external tokens than the hit offered, then too few GPU blocks for it: both refused
    with pytest.raises(SchedulerError, match="do not match"):
        sched.update_state_after_alloc(b, [1, 2, 3], 48)
    with pytest.raises(SchedulerError, match="cannot hold"):
        sched.update_state_after_alloc(b, [1], 32)
    # 2. nothing changed: the pending hit is intact and a correct allocation still loads it
    assert [blk.ref_cnt for blk in sched.cpu_pool.blocks] == pinned
    _, _, ids = admit(sched, gpu, b, gpu_hit_tokens=0)
    assert sched.build_connector_meta([]).load_gpu_blocks == ids[:2]


def test_eager_stores_only_what_the_forward_computes():
    sched, gpu = make_scheduler(block_size=BS)
    # B's first two blocks are a GPU hit that is not on the CPU (say, the CPU evicted it)
    b = FakeRequest("B", list(range(50)), BS)
    hit_tokens, _, ids = admit(sched, gpu, b, gpu_hit_tokens=32)
    assert hit_tokens == 0
    meta = sched.build_connector_meta([step_done("B", ids, 50)])
    assert meta.store_gpu_blocks == [ids[2]]  # the third block is the only one this step computed
    sched.update_connector_output(report(completed_store_events=[meta.store_event]))
    finish(sched, gpu, b, ids)
    assert_idle(sched, gpu)


def test_every_phase_move_is_checked():
    """The lifecycle's transitions: every phase allows exactly its listed moves; FINISHED allows none."""
    from scheduler_side.request_state import TRANSITIONS, Phase, RequestState

    assert set(TRANSITIONS) == set(Phase) and TRANSITIONS[Phase.FINISHED] == frozenset()
    state = RequestState(FakeRequest("R", list(range(8)), BS))
    for phase in Phase:
        for target in Phase:
            state.phase = phase
            if target in TRANSITIONS[phase]:
                state.move_to(target)
                assert state.phase is target
            else:
                with pytest.raises(SchedulerError, match="not a valid move"):
                    state.move_to(target)
                assert state.phase is phase


def test_allocation_while_loading_raises_and_changes_nothing():
    sched, gpu, b, ids, meta = b_loading_a_prefix()
    with pytest.raises(SchedulerError, match="while loading"):
        sched.update_state_after_alloc(b, ids, 0)
    sched.check_integrity()
    sched.update_connector_output(report(finished_load_reqs=["B"]))
    finish(sched, gpu, b, ids)
    assert_idle(sched, gpu)


def test_integrity_sees_a_phase_that_contradicts_the_transfers():
    sched, gpu, b, ids, meta = b_loading_a_prefix()
    from scheduler_side.request_state import Phase

    sched.transfers.requests["B"].phase = Phase.RUNNING  # but its load job is in flight
    with pytest.raises(SchedulerError, match="B is running with pending hit False and load True"):
        sched.check_integrity()


def test_lookup_waits_for_a_store_at_most_max_store_wait_steps():
    """A store that never completes cannot hold a request back: after the configured retries it computes."""
    sched, gpu = make_scheduler(block_size=BS, max_store_wait_steps=3)
    a = FakeRequest("A", list(range(40)), BS)
    _, _, ids = admit(sched, gpu, a)
    meta = sched.build_connector_meta([step_done("A", ids, 40)])
    b = FakeRequest("B", list(range(40)), BS)
    assert [sched.get_num_new_matched_tokens(b, 0) for _ in range(3)] == [(None, False)] * 3
    assert sched.get_num_new_matched_tokens(b, 0) == (0, False)  # waited enough: computes the prefix
    assert sched.stats.num_store_wait_timeouts == 1
    sched.request_finished(b)
    sched.update_connector_output(report(completed_store_events=[meta.store_event]))
    c = FakeRequest("C", list(range(40)), BS)
    assert sched.get_num_new_matched_tokens(c, 0) == (32, True)  # the store landed: a later request hits
    sched.request_finished(c)
    finish(sched, gpu, a, ids)
    assert_idle(sched, gpu)
