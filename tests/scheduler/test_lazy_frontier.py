"""The lazy store policy in its frontier mode (under pressure), one rule per test through a scripted
`StorePolicyView` (tests/lazy_view.py): when the mode starts (the first miss on content the CPU tier
evicted) and what it changes, how far ahead of the GPU eviction frontier a step stores (the lookahead), which
frontier blocks a step picks and how far it reads (the saved head: saved_head.py), the blocks it holds for a
finishing request, and where a completed store's blocks go back. The scheduler-level stories: test_lazy_policy.py; the admission window and deferrals:
test_lazy_policy_exact.py."""

from __future__ import annotations

from types import SimpleNamespace

from helpers import FakeRequest, lazy_under_pressure
from lazy_view import (
    BS,
    ScriptedView,
    dead_key_view,
    empty,
    hashed_keys,
    key,
    picks_per_step,
    state_of,
    unsaved,
)

from offload_connector.hashing import with_group_id
from scheduler_side.policies.lazy import LazyStorePolicy
from scheduler_side.request_state import LoadJob, RequestState


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


# ---- when the frontier mode starts ---------------------------------------------------------------------------
def test_the_cpu_tier_is_under_pressure_from_the_first_miss_on_content_it_evicted():
    """Found by mutation testing of scheduler_side/policies/lazy.py (docs/mutation.md)."""
    view = ScriptedView(num_gpu_blocks=2)
    policy = LazyStorePolicy(view)
    job = LoadJob([], [])
    a, b = state_of(3, request_id="a"), state_of(3, request_id="b")
    a.request.block_hashes[0] = b"a0"  # (distinct first blocks)
    b.request.block_hashes[0] = b"b0"

    def step() -> None:
        policy.pick_stores()
        policy.on_stores_emitted(None, [])

    step()
    assert not policy.on_load_complete(job)  # no pressure yet: CPU copies of loaded blocks are kept
    assert not policy.lends_load_slots() and not policy.gpu_copy_worthless_after_store
    for k in (b"a0", b"x", b"y"):
        policy.on_cpu_evicted(with_group_id(k))  # evictions alone change nothing
    step()
    assert not policy.under_pressure
    assert policy.may_admit(a, 0) and not policy.under_pressure  # "a0" was 3 evictions ago: beyond the 2 GPU blocks
    assert policy.may_admit(b, 1) and not policy.under_pressure  # a CPU hit up to block 1: its miss is block 1
    b.request.block_hashes[1] = b"y"
    assert policy.may_admit(b, 1) and policy.under_pressure  # it misses content evicted 1 eviction ago
    for _ in range(200):  # a quiet spell (no eviction for many steps) does not end it
        assert policy.on_load_complete(job) and policy.lends_load_slots() and policy.gpu_copy_worthless_after_store
        step()


def test_gpu_hits_name_their_cpu_copies_under_the_schedulers_group():
    """Found by mutation testing of scheduler_side/policies/lazy.py (docs/mutation.md)."""
    view = ScriptedView(group_id=3)
    state = state_of(3)
    assert LazyStorePolicy(view).on_allocated(state, 2) == []  # no pressure: the copies stay
    policy = lazy_under_pressure(view)
    assert policy.on_allocated(state, 2) == [with_group_id(h, 3) for h in state.request.block_hashes[:2]]
    assert policy.on_allocated(state, 0) == []


# ---- how far ahead a step stores: the lookahead --------------------------------------------------------------
def test_the_first_steps_lookahead_follows_exactly_what_it_allocated():
    """Found by mutation testing of scheduler_side/policies/lazy.py (docs/mutation.md)."""
    policy = lazy_under_pressure(ScriptedView(lazy_lookahead_blocks=None))
    assert policy.lookahead == 16  # the floor
    policy.on_blocks_allocated(10)
    policy.pick_stores()
    assert policy.lookahead == 20  # 2.0 x the peak of 10 blocks


def test_the_lookahead_follows_the_recent_peak_allocation():
    """Found by mutation testing of scheduler_side/policies/lazy.py (docs/mutation.md)."""
    view = ScriptedView(lazy_lookahead_blocks=None, frontier=unsaved(1, 200))
    policy = lazy_under_pressure(view)
    assert len(policy.pick_stores().gpu_ids) == 16  # the floor: nothing allocated yet
    policy.on_stores_emitted(None, [])
    policy.on_blocks_allocated(12)  # two admissions in one step
    policy.on_blocks_allocated(12)
    first = len(policy.pick_stores().gpu_ids)
    policy.on_stores_emitted(None, [])
    assert first == 2 * 24  # twice the step's allocations
    later = []
    for _ in range(3):  # quiet steps: the peak decays, never below the floor
        later.append(len(policy.pick_stores().gpu_ids))
        policy.on_stores_emitted(None, [])
    assert first > later[0] > later[1] > later[2] >= 16


def test_picks_weigh_less_while_store_events_outlast_a_step():
    """A picked block leaves the GPU frontier while its store is in flight; the policy learns how often the
    last event was still in flight at the next step and lets each pick count for less accordingly.

    Found by mutation testing of scheduler_side/policies/lazy.py (docs/mutation.md)."""
    view = ScriptedView(lazy_lookahead_blocks=10, frontier=unsaved(1, 200))
    policy = lazy_under_pressure(view)
    steps = [picks_per_step(policy, view, event_id) for event_id in range(3)]  # no event completes
    assert steps[0] == 10 and steps[0] < steps[1] < steps[2] < 2 * 10
    view.outstanding.clear()  # from now on every event completes within its step
    calm = []
    for event_id in range(3, 6):
        calm.append(len(policy.pick_stores().gpu_ids))
        policy.on_stores_emitted(event_id, [])
    assert steps[2] > calm[0] > calm[1] >= calm[2] >= 10


# ---- which frontier blocks a step picks, and what a completed store gives back --------------------------------
def test_a_step_picks_no_more_unsaved_blocks_than_the_cpu_tier_has_room_for():
    """Found by mutation testing of scheduler_side/policies/lazy.py (docs/mutation.md)."""
    for cpu_free in (0, 1, 2, 3):
        policy = lazy_under_pressure(ScriptedView(lazy_lookahead_blocks=6, frontier=unsaved(1, 6), cpu_free=cpu_free))
        assert policy.pick_stores().gpu_ids == list(range(1, cpu_free + 1)), cpu_free


def test_a_key_is_picked_once_even_if_two_free_blocks_hold_it():
    """Found by mutation testing of scheduler_side/policies/lazy.py (docs/mutation.md)."""
    frontier = [(1, b"same"), (2, b"same"), (3, b"other")]
    policy = lazy_under_pressure(ScriptedView(lazy_lookahead_blocks=6, frontier=frontier))
    assert policy.pick_stores().gpu_ids == [1, 3]


def test_the_frontier_scan_skips_dead_keys() -> None:
    """Found by mutation testing of scheduler_side/policies/lazy.py (docs/mutation.md)."""
    k = hashed_keys(3)
    policy = lazy_under_pressure(dead_key_view([(1, k[0]), (2, k[1]), (3, k[2])], dead={k[1]}))
    picks = policy.pick_stores()
    assert picks.keys == [k[0], k[2]] and picks.gpu_ids == [1, 3]


def test_held_blocks_take_their_cpu_room_first():
    """Found by mutation testing of scheduler_side/policies/lazy.py (docs/mutation.md)."""
    view = ScriptedView(lazy_lookahead_blocks=8, gpu_free=0, cpu_free=3)
    policy = lazy_under_pressure(view)
    assert policy.on_request_finished(finished(2)) == [10, 11]
    view.frontier = unsaved(1, 6)
    picks = policy.pick_stores()
    assert picks.gpu_ids == [10, 11, 1] and picks.release_gpu_ids == [10, 11]


def test_the_next_step_scans_on_from_where_the_last_one_stopped():
    """Blocks scanned and not picked stay the saved head: the next step reads only past them."""
    view = ScriptedView(lazy_lookahead_blocks=3, frontier=empty(1, 2) + unsaved(3, 4))
    policy = lazy_under_pressure(view)
    assert policy.pick_stores().gpu_ids == [3]  # 1, 2 (no key) cost 1 each, 3 its pick
    view.frontier = empty(1, 2) + unsaved(4, 3)  # 3 is being stored: out of the free queue
    policy.on_stores_emitted(1, [3])
    assert policy.pick_stores().gpu_ids == [4]  # 1, 2 are the saved head: only 1 of the budget is left
    policy.on_stores_emitted(2, [4])


def test_a_completed_store_joins_the_saved_head():
    """Stored blocks come back to the head of the free queue, saved: they count against the next budget."""
    view = ScriptedView(lazy_lookahead_blocks=3, frontier=empty(1, 1) + unsaved(2, 4))
    policy = lazy_under_pressure(view)
    assert policy.pick_stores().gpu_ids == [2, 3]
    policy.on_stores_emitted(1, [2, 3])
    view.frontier = [(2, key(2)), (3, key(3))] + empty(1, 1) + unsaved(4, 2)  # back at the head
    view.saved |= {key(2), key(3)}
    assert policy.stored_blocks_places(1) == [(1, [2, 3])]  # (the scheduler asks before it frees them)
    policy.on_store_complete(1)
    assert policy.pick_stores().gpu_ids == []  # 2, 3 and 1: the whole budget is saved
    policy.on_stores_emitted(None, [])


def test_a_failed_stores_blocks_do_not_join_the_saved_head():
    """A failed store's blocks go back to vLLM's place for them, unsaved (the scheduler asks no places)."""
    view = ScriptedView(lazy_lookahead_blocks=3, frontier=empty(1, 1) + unsaved(2, 4))
    policy = lazy_under_pressure(view)
    assert policy.pick_stores().gpu_ids == [2, 3]
    policy.on_stores_emitted(1, [2, 3])
    view.frontier = empty(1, 1) + unsaved(4, 2) + unsaved(2, 2)  # at the tail
    policy.on_store_complete(1)
    assert policy.pick_stores().gpu_ids == [4, 5]  # only 1 is saved: the budget reaches on past it


def test_an_unsaved_block_left_for_want_of_room_is_scanned_again():
    view = ScriptedView(lazy_lookahead_blocks=4, frontier=unsaved(1, 3), cpu_free=1)
    policy = lazy_under_pressure(view)
    assert policy.pick_stores().gpu_ids == [1]
    policy.on_stores_emitted(1, [1])
    view.frontier, view.saved = unsaved(2, 2), {key(1)}
    assert policy.pick_stores().gpu_ids == [2]  # not past it: 2 was never part of the saved head
    policy.on_stores_emitted(2, [2])


def test_the_scan_starts_from_the_head_again_once_the_engine_took_its_last_block():
    view = ScriptedView(lazy_lookahead_blocks=2, frontier=empty(1, 2) + unsaved(3, 2))
    policy = lazy_under_pressure(view)
    assert policy.pick_stores().gpu_ids == []
    policy.on_stores_emitted(None, [])
    view.frontier = unsaved(3, 2)  # the engine allocated 1 and 2 (a request the connector was not told of)
    assert policy.pick_stores().gpu_ids == [3, 4]
    policy.on_stores_emitted(1, [3, 4])


def test_blocks_the_engine_allocates_leave_the_saved_head():
    view = ScriptedView(lazy_lookahead_blocks=3, frontier=empty(1, 3) + unsaved(4, 3))
    policy = lazy_under_pressure(view)
    assert policy.pick_stores().gpu_ids == []
    policy.on_stores_emitted(None, [])
    state = state_of(2)
    state.gpu_block_ids = [1, 2]  # the engine gave the request the two blocks at the head
    policy.on_allocated(state, 0)
    view.frontier = empty(3, 1) + unsaved(4, 3)
    assert policy.pick_stores().gpu_ids == [4, 5]  # only 3 is left of the saved head


# ---- what a finishing request leaves held -------------------------------------------------------------------
def test_held_blocks_fill_exactly_the_cpu_room_left_by_earlier_holds():
    """Found by mutation testing of scheduler_side/policies/lazy.py (docs/mutation.md)."""
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
    """Found by mutation testing of scheduler_side/policies/lazy.py (docs/mutation.md)."""
    for gpu_free, held in ((7, [10, 11]), (8, []), (9, [])):
        policy = lazy_under_pressure(ScriptedView(lazy_lookahead_blocks=8, gpu_free=gpu_free, cpu_free=10))
        assert policy.on_request_finished(finished(2)) == held, gpu_free


def test_a_single_free_cpu_block_still_takes_one_hold():
    """Found by mutation testing of scheduler_side/policies/lazy.py (docs/mutation.md)."""
    policy = lazy_under_pressure(ScriptedView(lazy_lookahead_blocks=8, gpu_free=0, cpu_free=1))
    assert policy.on_request_finished(finished(3)) == [10]


def test_saved_and_null_blocks_are_skipped_not_the_end_of_the_scan():
    """Found by mutation testing of scheduler_side/policies/lazy.py (docs/mutation.md)."""
    state = finished(4, gpu_ids=[10, 0, 12, 13])
    view = ScriptedView(lazy_lookahead_blocks=8, gpu_free=0, saved={keys_of(state)[0]})
    assert lazy_under_pressure(view).on_request_finished(state) == [12, 13]


def test_holds_stop_at_the_last_hashed_or_computed_block():
    """Found by mutation testing of scheduler_side/policies/lazy.py (docs/mutation.md)."""
    view = ScriptedView(lazy_lookahead_blocks=8, gpu_free=0)
    assert lazy_under_pressure(view).on_request_finished(finished(4, hashed_blocks=2)) == [10, 11]
    assert lazy_under_pressure(view).on_request_finished(finished(4, computed_blocks=3)) == [10, 11, 12]


def test_held_blocks_are_stored_under_the_group_keys():
    """Found by mutation testing of scheduler_side/policies/lazy.py (docs/mutation.md)."""
    state = finished(2)
    view = ScriptedView(lazy_lookahead_blocks=8, gpu_free=0, group_id=5)
    policy = lazy_under_pressure(view)
    assert policy.on_request_finished(state) == [10, 11]
    picks = policy.pick_stores()
    assert picks.keys == keys_of(state, group=5) and picks.gpu_ids == [10, 11]


def request_state(block_keys_hashes: list[bytes], gpu_ids: list[int]):
    request = SimpleNamespace(request_id="r", block_hashes=block_keys_hashes, num_tokens=len(gpu_ids) * BS)
    return SimpleNamespace(request=request, gpu_block_ids=gpu_ids, num_computed_tokens=len(gpu_ids) * BS,
                           request_id="r")



def test_a_finishing_request_holds_no_dead_block() -> None:
    """Found by mutation testing of scheduler_side/policies/lazy.py (docs/mutation.md)."""
    raw = [bytes([i]) * 16 for i in range(3)]
    dead = {with_group_id(raw[1])}
    policy = lazy_under_pressure(dead_key_view([], dead=dead))  # no free GPU block: under the lookahead, holds
    held = policy.on_request_finished(request_state(raw, [5, 6, 7]))
    assert held == [5, 7]


def test_a_held_block_that_died_meanwhile_is_released_not_stored() -> None:
    """Found by mutation testing of scheduler_side/policies/lazy.py (docs/mutation.md)."""
    raw = [bytes([i]) * 16 for i in range(2)]
    view = dead_key_view([], dead=set())
    policy = lazy_under_pressure(view)
    assert policy.on_request_finished(request_state(raw, [5, 6])) == [5, 6]
    view.dead.add(with_group_id(raw[0]))  # e.g. its session closed before the next metadata
    picks = policy.pick_stores()
    assert picks.gpu_ids == [6] and sorted(picks.release_gpu_ids) == [5, 6]


def test_a_block_whose_cpu_copy_the_tier_dropped_leaves_the_saved_head_and_is_picked_again():
    view = ScriptedView(lazy_lookahead_blocks=3, frontier=unsaved(1, 5))
    view.saved = {key(1), key(2), key(3)}
    policy = lazy_under_pressure(view)
    assert policy.pick_stores().gpu_ids == []  # 1, 2, 3 saved: the saved head
    policy.on_stores_emitted(None, [])
    view.saved.discard(key(2))
    policy.on_cpu_copy_dropped(key(2))
    policy.on_cpu_copy_dropped(key(9))  # no GPU block holds it: nothing to do
    assert policy.pick_stores().gpu_ids == [2]  # and the scan charges it as it would: nothing further
    policy.on_stores_emitted(1, [2])


def test_the_cursor_blocks_dropped_copy_starts_the_scan_from_the_head():
    view = ScriptedView(lazy_lookahead_blocks=3, frontier=unsaved(1, 5))
    view.saved = {key(1), key(2), key(3)}
    policy = lazy_under_pressure(view)
    assert policy.pick_stores().gpu_ids == []
    policy.on_stores_emitted(None, [])
    view.saved.discard(key(3))
    policy.on_cpu_copy_dropped(key(3))
    assert policy.pick_stores().gpu_ids == [3]
    policy.on_stores_emitted(1, [3])


def test_an_allocations_dropped_copies_told_at_once_change_the_saved_head_as_told_one_by_one():
    def run(tell) -> list[list[int]]:
        view = ScriptedView(lazy_lookahead_blocks=5, frontier=unsaved(1, 8))
        view.saved = {key(i) for i in range(1, 6)}
        policy = lazy_under_pressure(view)
        assert policy.pick_stores().gpu_ids == []  # 1..5 saved: the saved head, cursor 5
        policy.on_stores_emitted(None, [])
        view.saved -= {key(2), key(4), key(5)}
        tell(policy, [key(2), key(9), key(4), key(5), key(3)])  # 5 is the cursor's: the scan starts again
        out = [policy.pick_stores().gpu_ids]
        policy.on_stores_emitted(1, out[-1])
        return out

    def one_by_one(policy, keys):
        for k in keys:
            policy.on_cpu_copy_dropped(k)

    assert run(one_by_one) == run(lambda policy, keys: policy.on_cpu_copies_evicted(keys)) == [[2, 4, 5]]


def test_stored_blocks_go_back_behind_the_block_before_them_while_it_is_still_saved():
    view = ScriptedView(lazy_lookahead_blocks=6, frontier=empty(1, 1) + unsaved(2, 2) + empty(4, 1) + unsaved(5, 2))
    policy = lazy_under_pressure(view)
    assert policy.pick_stores().gpu_ids == [2, 3, 5, 6]
    policy.on_stores_emitted(1, [2, 3, 5, 6])
    view.frontier = empty(1, 1) + empty(4, 1)  # the picks are out of the queue while they are stored
    assert policy.stored_blocks_places(1) == [(1, [2, 3]), (4, [5, 6])]
    view.frontier = [(1, None), (2, key(2)), (3, key(3)), (4, None), (5, key(5)), (6, key(6))]
    view.saved |= {key(2), key(3), key(5), key(6)}
    policy.on_store_complete(1)
    assert policy.pick_stores().gpu_ids == []  # all six are the saved head now, 6 (behind the cursor) its end
    policy.on_stores_emitted(None, [])
    view.frontier += unsaved(7, 1)
    policy.view.lazy_lookahead_blocks = 7
    assert policy.pick_stores().gpu_ids == [7]  # read on from 6


def test_a_stored_block_whose_neighbour_the_engine_took_goes_to_the_head():
    view = ScriptedView(lazy_lookahead_blocks=3, frontier=empty(1, 1) + unsaved(2, 1) + empty(3, 1))
    policy = lazy_under_pressure(view)
    assert policy.pick_stores().gpu_ids == [2]
    policy.on_stores_emitted(1, [2])
    state = state_of(1)
    state.gpu_block_ids = [1]
    policy.on_allocated(state, 0)  # the engine took 1
    view.frontier = empty(3, 1)
    assert policy.stored_blocks_places(1) == [(None, [2])]
