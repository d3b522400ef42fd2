"""Scheduler-side rules the fresh mutation run (docs/mutation.md) found unpinned: which blocks the lazy policy
holds for a finishing request, ARC's one adaptation per lookup, and the store-in-flight answer the lazy
policy's estimate reads. Through the lazy tests' scripted `StorePolicyView` or a real scheduler."""

from __future__ import annotations

from helpers import FakeRequest, admit, lazy_under_pressure, make_scheduler, report, step_done
from lazy_view import ScriptedView, unsaved

from offload_connector.hashing import with_group_id
from scheduler_side.request_state import RequestState

BS = 4


def finished(num_blocks: int, gpu_ids: list[int] | None = None, computed_blocks: int | None = None,
             hashed_blocks: int | None = None) -> RequestState:
    """A finishing request with `num_blocks` full blocks (all computed unless told), on GPU blocks 10, 11..."""
    request = FakeRequest("r", list(range(num_blocks * BS)), BS)
    if hashed_blocks is not None:
        request.block_hashes = request.block_hashes[:hashed_blocks]
    ids = gpu_ids if gpu_ids is not None else [10 + i for i in range(num_blocks)]
    computed = num_blocks if computed_blocks is None else computed_blocks
    return RequestState(request, gpu_block_ids=ids, num_computed_tokens=computed * BS)


def keys_of(state: RequestState, group: int = 0) -> list[bytes]:
    return [with_group_id(h, group) for h in state.request.block_hashes]


# ---- what a finishing request leaves held -----------------------------------------------------------------
def test_held_blocks_fill_exactly_the_cpu_room_left_by_earlier_holds():
    view = ScriptedView(lazy_lookahead_blocks=8, gpu_free=2, cpu_free=5)
    policy = lazy_under_pressure(view)
    assert policy.on_request_finished(finished(3)) == [10, 11, 12]
    second = finished(4, gpu_ids=[20, 21, 22, 23])
    second.request = FakeRequest("s", [100 + t for t in range(4 * BS)], BS)
    assert policy.on_request_finished(second) == [20, 21]  # room 5 - 3 held
    assert policy.num_held_blocks == 5
    third = finished(1, gpu_ids=[30])
    third.request = FakeRequest("t", [200 + t for t in range(BS)], BS)
    assert policy.on_request_finished(third) == []  # no room left: nothing held


def test_nothing_is_held_once_the_gpu_free_queue_reaches_the_lookahead():
    for gpu_free, held in ((7, [10, 11]), (8, []), (9, [])):
        policy = lazy_under_pressure(ScriptedView(lazy_lookahead_blocks=8, gpu_free=gpu_free, cpu_free=10))
        assert policy.on_request_finished(finished(2)) == held, gpu_free


def test_a_single_free_cpu_block_still_takes_one_hold():
    policy = lazy_under_pressure(ScriptedView(lazy_lookahead_blocks=8, gpu_free=0, cpu_free=1))
    assert policy.on_request_finished(finished(3)) == [10]


def test_saved_and_null_blocks_are_skipped_not_the_end_of_the_scan():
    state = finished(4, gpu_ids=[10, 0, 12, 13])
    view = ScriptedView(lazy_lookahead_blocks=8, gpu_free=0, saved={keys_of(state)[0]})
    assert lazy_under_pressure(view).on_request_finished(state) == [12, 13]


def test_holds_stop_at_the_last_hashed_or_computed_block():
    view = ScriptedView(lazy_lookahead_blocks=8, gpu_free=0)
    assert lazy_under_pressure(view).on_request_finished(finished(4, hashed_blocks=2)) == [10, 11]
    assert lazy_under_pressure(view).on_request_finished(finished(4, computed_blocks=3)) == [10, 11, 12]


def test_held_blocks_are_stored_under_the_group_keys():
    state = finished(2)
    view = ScriptedView(lazy_lookahead_blocks=8, gpu_free=0, group_id=5)
    policy = lazy_under_pressure(view)
    assert policy.on_request_finished(state) == [10, 11]
    picks = policy.pick_stores()
    assert picks.keys == keys_of(state, group=5) and picks.gpu_ids == [10, 11]


# ---- ARC: one adaptation per lookup -----------------------------------------------------------------------
def test_arc_adapts_its_target_once_per_lookup_however_many_ghosts_it_misses():
    """Megiddo & Modha: a lookup is one reference; three missed seen-once ghosts move p one step."""
    sched, gpu = make_scheduler(num_gpu_blocks=64, num_cpu_blocks=7, eviction="arc")

    def run(req_id: str, tokens: list[int]) -> None:
        req = FakeRequest(req_id, tokens, BS)
        _, _, ids = admit(sched, gpu, req)
        meta = sched.build_connector_meta([step_done(req_id, ids, len(tokens))])
        sched.update_connector_output(report(completed_store_events=[meta.store_event]))
        assert sched.request_finished(req) == (False, None)
        gpu.free([gpu.blocks[i] for i in reversed(ids)])

    first, second = list(range(13)), [1000 + t for t in range(25)]  # 3 blocks, then 6 evicting them
    run("a", first)
    run("b", second)
    q = sched.cpu_pool.free_queue
    ghosts = [with_group_id(h, 0) for h in FakeRequest("k", first, BS).block_hashes]
    assert all(g in q.b1 for g in ghosts)
    p_before, b1, b2 = q.p, len(q.b1), len(q.b2)
    again = FakeRequest("again", first, BS)
    assert sched.get_num_new_matched_tokens(again, 0) == (0, False)
    assert q.p == min(6.0, p_before + max(1.0, b2 / max(1, b1 - 1)))
    assert not any(g in q.b1 for g in ghosts)  # all three were noted as reused
    sched.request_finished(again)


# ---- the lazy policy's in-flight estimate reads the real answer -------------------------------------------
def test_a_store_event_is_outstanding_until_its_completion_is_reported():
    sched, gpu = make_scheduler(num_cpu_blocks=8)
    req = FakeRequest("a", list(range(9)), BS)
    _, _, ids = admit(sched, gpu, req)
    meta = sched.build_connector_meta([step_done("a", ids, 9)])
    view = sched.policy.view
    assert view.is_store_outstanding(meta.store_event)
    sched.update_connector_output(report(completed_store_events=[meta.store_event]))
    assert not view.is_store_outstanding(meta.store_event)


# ---- admission and the frontier a store event restores ------------------------------------------------------
def test_a_request_with_nothing_left_to_allocate_is_never_deferred():
    view = ScriptedView(lazy_lookahead_blocks=1, frontier=unsaved(1, 8))
    state = RequestState(FakeRequest("r", list(range(2 * BS)), BS), num_gpu_hit_blocks=2)
    assert lazy_under_pressure(view).may_admit(state, 0)


def test_a_completed_store_restores_the_frontier_up_to_its_last_stored_block():
    frontier = unsaved(1, 3)
    for event_id, stored, restored in ((1, [3], 3), (2, [2], 2), (3, [1], 1), (4, [], 0)):
        policy = lazy_under_pressure(ScriptedView(lazy_lookahead_blocks=3, frontier=frontier))
        assert policy.pick_stores().gpu_ids == [1, 2, 3]
        policy.on_stores_emitted(event_id, stored)
        assert policy.on_store_complete(event_id) == frontier[:restored], stored


# ---- how many blocks a step picks: the CPU room ---------------------------------------------------------------
def test_a_step_picks_no_more_unsaved_blocks_than_the_cpu_tier_has_room_for():
    for cpu_free in (0, 1, 2, 3):
        policy = lazy_under_pressure(ScriptedView(lazy_lookahead_blocks=6, frontier=unsaved(1, 6), cpu_free=cpu_free))
        assert policy.pick_stores().gpu_ids == list(range(1, cpu_free + 1)), cpu_free


def test_held_blocks_take_their_cpu_room_first():
    view = ScriptedView(lazy_lookahead_blocks=8, gpu_free=0, cpu_free=3)
    policy = lazy_under_pressure(view)
    assert policy.on_request_finished(finished(2)) == [10, 11]
    view.frontier = unsaved(1, 6)
    picks = policy.pick_stores()
    assert picks.gpu_ids == [10, 11, 1] and picks.release_gpu_ids == [10, 11]


def test_a_key_is_picked_once_even_if_two_free_blocks_hold_it():
    frontier = [(1, b"same"), (2, b"same"), (3, b"other")]
    policy = lazy_under_pressure(ScriptedView(lazy_lookahead_blocks=6, frontier=frontier))
    assert policy.pick_stores().gpu_ids == [1, 3]


def test_the_first_steps_lookahead_follows_exactly_what_it_allocated():
    policy = lazy_under_pressure(ScriptedView(lazy_lookahead_blocks=None))
    assert policy.lookahead == 16  # the floor
    policy.on_blocks_allocated(10)
    policy.pick_stores()
    assert policy.lookahead == 20  # 2.0 x the peak of 10 blocks
