"""The lazy policy saves exactly what the next allocations take (issue 17): an admission's window skips its
own free GPU hits, the lookahead leaves out what deferrals and prompt chunks already cover, a request still
allocating its prompt has the rest saved ahead, and a deferral lets a request through blind only the very
next step; and when an admission is deferred at all. Through the scripted `StorePolicyView` of
tests/lazy_view.py."""

from __future__ import annotations

from types import SimpleNamespace

from helpers import FakeRequest, lazy_under_pressure, make_scheduler, put_under_pressure, store_and_finish
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
from scheduler_side.policies.lazy import MAX_DEFERRALS, LazyStorePolicy
from scheduler_side.request_state import PendingHit, RequestState


def step(policy: LazyStorePolicy) -> list[int]:
    """One engine step's metadata: the GPU blocks picked for storing (nothing stays in flight)."""
    picks = policy.pick_stores()
    policy.on_stores_emitted(None, [])
    return picks.gpu_ids


def admitted(policy: LazyStorePolicy, num_blocks: int, new_blocks: int, request_id: str = "r"):
    """The engine allocated `new_blocks` blocks for an admitted request of `num_blocks` blocks."""
    state = state_of(num_blocks, request_id=request_id)
    state.gpu_block_ids = list(range(1000, 1000 + new_blocks))
    policy.on_allocated(state, 0)
    policy.on_blocks_allocated(new_blocks)
    return state


# ---- when an admission is deferred -------------------------------------------------------------------------
def test_an_admission_looks_exactly_as_far_as_the_blocks_it_allocates():
    """Found by mutation testing of scheduler_side/policies/lazy.py (docs/mutation.md)."""
    # 4 blocks, 1 a GPU hit and 1 a CPU hit: it allocates 3 (the CPU hit's block too), all of them harmless
    view = ScriptedView(frontier=empty(1, 3) + unsaved(10, 1))
    assert lazy_under_pressure(view).may_admit(state_of(4, gpu_hit_blocks=1), 1)
    # one block more and its allocation would evict the unsaved block: deferred
    view.frontier = empty(1, 2) + unsaved(10, 1)
    assert not lazy_under_pressure(view).may_admit(state_of(4, gpu_hit_blocks=1), 1)


def test_an_admission_looks_no_further_than_the_engines_step_bound():
    """Found by mutation testing of scheduler_side/policies/lazy.py (docs/mutation.md)."""
    view = ScriptedView(max_blocks_per_step=2, frontier=empty(1, 2) + unsaved(10, 5))
    assert lazy_under_pressure(view).may_admit(state_of(10), 0)  # only 2 blocks this step, both harmless
    view.max_blocks_per_step = 3
    assert not lazy_under_pressure(view).may_admit(state_of(10), 0)


def test_a_one_block_admission_that_would_evict_an_unsaved_block_is_deferred():
    """Found by mutation testing of scheduler_side/policies/lazy.py (docs/mutation.md)."""
    view = ScriptedView(frontier=unsaved(1, 1))
    assert not lazy_under_pressure(view).may_admit(state_of(1), 0)


def test_saved_blocks_do_not_defer_an_admission():
    """Found by mutation testing of scheduler_side/policies/lazy.py (docs/mutation.md)."""
    view = ScriptedView(frontier=unsaved(1, 3))
    view.saved = {k for _, k in view.frontier}
    assert lazy_under_pressure(view).may_admit(state_of(3), 0)


def test_an_admission_is_deferred_only_while_the_cpu_tier_can_take_what_it_would_evict():
    """Found by mutation testing of scheduler_side/policies/lazy.py (docs/mutation.md)."""
    view = ScriptedView(frontier=unsaved(1, 2), cpu_free=2)
    assert not lazy_under_pressure(view).may_admit(state_of(2), 0)  # exactly enough room
    view.cpu_free = 1
    assert lazy_under_pressure(view).may_admit(state_of(2), 0)  # deferring would be in vain


def test_the_next_store_covers_every_admission_deferred_this_step():
    """Found by mutation testing of scheduler_side/policies/lazy.py (docs/mutation.md)."""
    view = ScriptedView(lazy_lookahead_blocks=1, frontier=unsaved(1, 50))
    policy = lazy_under_pressure(view)
    assert not policy.may_admit(state_of(2, request_id="a"), 0)
    assert not policy.may_admit(state_of(3, request_id="b"), 0)
    assert len(policy.pick_stores().gpu_ids) == 1 + 2 + 3  # the lookahead plus both needs
    policy.on_stores_emitted(None, [])
    assert len(policy.pick_stores().gpu_ids) == 1  # needs are for one step only


def test_a_deferred_admission_needs_whole_blocks():
    """A 9-token prompt takes 3 blocks (the last one partly filled): the store after its deferral covers 3
    blocks of need, also while picks weigh less than a block each.

    Found by mutation testing of scheduler_side/policies/lazy.py (docs/mutation.md)."""
    view = ScriptedView(lazy_lookahead_blocks=1, frontier=unsaved(1, 200))
    policy = lazy_under_pressure(view)
    assert [picks_per_step(policy, view, event_id) for event_id in range(2)] == [1, 2]  # events outlast steps
    assert not policy.may_admit(RequestState(FakeRequest("r", list(range(9)), BS)), 0)
    assert len(policy.pick_stores().gpu_ids) == 7  # (1 + 3) blocks of budget at 0.512 of a block per pick


def test_a_request_with_nothing_left_to_allocate_is_never_deferred():
    """Found by mutation testing of scheduler_side/policies/lazy.py (docs/mutation.md)."""
    view = ScriptedView(lazy_lookahead_blocks=1, frontier=unsaved(1, 8))
    state = RequestState(FakeRequest("r", list(range(2 * BS)), BS), num_gpu_hit_blocks=2)
    assert lazy_under_pressure(view).may_admit(state, 0)


def test_dead_blocks_an_admission_would_evict_do_not_defer_it() -> None:
    """Deferring a request one step is worth it only to save blocks worth keeping: unsaved but dead
    frontier blocks are not a reason.

    Found by mutation testing of scheduler_side/policies/lazy.py (docs/mutation.md)."""
    k = hashed_keys(2)
    policy = lazy_under_pressure(dead_key_view([(1, k[0]), (2, k[1])], dead=set(k)))
    state = SimpleNamespace(num_deferrals=0, num_gpu_hit_blocks=0, request_id="R",
                            request=SimpleNamespace(num_tokens=2 * BS))
    assert policy.may_admit(state, 0) is True
    live = lazy_under_pressure(dead_key_view([(1, k[0]), (2, k[1])], dead=set()))
    assert live.may_admit(state, 0) is False  # the same frontier, alive: defer once and save it


# ---- the window an admission draws from ----------------------------------------------------------------------
def test_an_admissions_own_free_gpu_hits_do_not_count_as_blocks_it_takes():
    """Its GPU-hit blocks may be free at the frontier (saved there ahead): the allocation takes them out of
    the queue without evicting them, so the blocks it evicts lie beyond them, where an unsaved one defers it
    and the step's store covers the whole span."""
    state = state_of(4, gpu_hit_blocks=2)  # allocates 2 new blocks
    own = [with_group_id(h) for h in state.request.block_hashes[:2]]
    view = ScriptedView(frontier=[(1, own[0]), (2, own[1])] + empty(10, 1) + unsaved(20, 5), saved=set(own))
    policy = lazy_under_pressure(view)
    assert not policy.may_admit(state, 0)
    assert step(policy) == [20, 21]  # the lookahead of 1 plus a span of 4: blocks 1, 2, 10, 20, then 21


def test_saved_blocks_beyond_an_admissions_own_gpu_hits_let_it_through():
    state = state_of(4, gpu_hit_blocks=2)
    own = [with_group_id(h) for h in state.request.block_hashes[:2]]
    view = ScriptedView(frontier=[(1, own[0])] + unsaved(20, 2) + [(2, own[1])] + unsaved(30, 1))
    view.saved = {key(20), key(21)}
    assert lazy_under_pressure(view).may_admit(state, 0)  # takes 20 and 21 (saved); 30 stays


# ---- what the lookahead follows -------------------------------------------------------------------------------
def test_a_lone_admission_weighs_on_the_lookahead_only_through_a_mean():
    """In a step that runs at most one request, a deferral covers its admission exactly, so one long prompt
    does not make every later step save twice its size ahead: the step's largest admission enters a mean
    (a tenth of it the first step); the decode blocks still enter the peak."""
    view = ScriptedView(lazy_lookahead_blocks=None, frontier=unsaved(1, 500), cpu_free=1000)
    policy = lazy_under_pressure(view)
    admitted(policy, 100, 100)
    assert len(step(policy)) == 2 * 10  # not 2 x 100
    admitted(policy, 100, 100, "a")
    policy.on_blocks_allocated(5)  # a decode step elsewhere
    assert len(step(policy)) == 2 * (5 + (0.9 * 10 + 0.1 * 100))


def test_admissions_among_many_running_requests_count_in_the_peak():
    """With several requests running, their allocations move the frontier before a deferred request's turn
    the next step: the lookahead follows the whole step's allocations, admissions included."""
    view = ScriptedView(lazy_lookahead_blocks=None, frontier=unsaved(1, 500), cpu_free=1000)
    policy = lazy_under_pressure(view)
    a = admitted(policy, 100, 100, "a")
    b = admitted(policy, 30, 30, "b")
    for state in (a, b):
        policy.on_scheduled(state, 0)
    assert len(step(policy)) == 2 * 130


def test_a_prompt_still_being_allocated_is_saved_ahead_and_kept_out_of_the_lookahead():
    """A request in chunked prefill allocates the rest of its prompt over the next steps: the next store
    saves that much more of the frontier, and the chunk it then takes does not raise the lookahead."""
    view = ScriptedView(lazy_lookahead_blocks=None, frontier=unsaved(1, 500), cpu_free=1000)
    policy = lazy_under_pressure(view)
    state = state_of(60)
    state.gpu_block_ids = list(range(1000, 1020))  # 20 of its 60 blocks so far
    policy.on_scheduled(state, 20 * BS)
    assert len(step(policy)) == 16 + 40
    state.gpu_block_ids += list(range(1020, 1060))  # the next step takes the other 40
    policy.on_blocks_allocated(40)
    policy.on_scheduled(state, 60 * BS)
    assert len(step(policy)) == 16


def test_a_loading_requests_prompt_rest_is_saved_at_its_admission():
    """A CPU hit is loaded first; the rest of the prompt is allocated when the load is done (the next step):
    the admission's store saves it already."""
    view = ScriptedView(lazy_lookahead_blocks=None, frontier=unsaved(1, 500), cpu_free=1000)
    policy = lazy_under_pressure(view)
    state = state_of(50)
    state.gpu_block_ids = list(range(1000, 1030))  # 30 blocks to load into; 20 more come after the load
    state.pending_hit = PendingHit([], 0)
    policy.on_allocated(state, 0)
    policy.on_blocks_allocated(30)
    assert len(step(policy)) == 16 + 20


# ---- when a deferred request goes through ---------------------------------------------------------------------
def test_a_deferred_request_goes_through_blind_only_the_very_next_step():
    """The store of its deferral step saved its span for the next step's allocation. Looked up later (the
    engine did not reach it), other allocations have moved the frontier: it is checked again, and deferred
    again while it would evict unsaved blocks, up to MAX_DEFERRALS times."""
    view = ScriptedView(frontier=unsaved(1, 50))
    policy = lazy_under_pressure(view)
    state = state_of(3)
    assert not policy.may_admit(state, 0)
    state.num_deferrals += 1  # what the scheduler does on a deferral
    step(policy)
    step(policy)  # a step in which the engine did not look it up
    assert not policy.may_admit(state, 0)  # checked again: still unsaved blocks in its way
    state.num_deferrals += 1
    while state.num_deferrals < MAX_DEFERRALS:
        step(policy)
        step(policy)
        assert not policy.may_admit(state, 0)
        state.num_deferrals += 1
    step(policy)
    step(policy)
    assert policy.may_admit(state, 0)  # deferred enough
    fresh = state_of(3, request_id="f")
    assert not policy.may_admit(fresh, 0)
    fresh.num_deferrals += 1
    step(policy)
    assert policy.may_admit(fresh, 0)  # the next step: its span was saved


def test_a_deferred_request_asked_again_within_the_step_adds_no_second_span():
    view = ScriptedView(frontier=unsaved(1, 50))
    policy = lazy_under_pressure(view)
    state = state_of(3)
    assert not policy.may_admit(state, 0)
    assert not policy.may_admit(state, 0)  # still deferred: this step's store saves its span once
    assert len(step(policy)) == 1 + 3


# ---- what a deferral keeps --------------------------------------------------------------------------------------
def test_a_deferred_lookup_keeps_its_cpu_hit_from_the_stores_that_save_its_span():
    """The store that saves a deferred request's span evicts from the CPU tier's LRU end, where the request's
    own CPU hit may lie: the deferral makes that hit the most recently used, so it is still there when the
    request comes back (before, one agentic request found 676 blocks, was deferred and got 0)."""
    sched, gpu = make_scheduler(num_cpu_blocks=9)  # 8 usable CPU blocks
    a = FakeRequest("a", list(range(16)), 4)
    b = FakeRequest("b", list(range(100, 116)), 4)
    store_and_finish(sched, gpu, a)
    store_and_finish(sched, gpu, b)  # A's 4 blocks are now the least recently used
    later = FakeRequest("r", list(range(16)) + [999], 4)
    sched.policy.may_admit = lambda state, num_cpu_hit_blocks: False  # whatever the reason, it is deferred
    assert sched.get_num_new_matched_tokens(later, 0) == (None, False)
    next_victims = [block.block_hash for block in list(sched.cpu_pool.free_queue)[:4]]
    assert set(next_victims) == {with_group_id(h) for h in b.block_hashes}
    assert sched.cpu_pool.num_held_blocks() == 0  # moved, not pinned
    del sched.policy.may_admit
    hit, _ = sched.get_num_new_matched_tokens(later, 0)
    assert hit == 16


def cache_on_cpu(sched, keys: list[bytes]) -> None:
    """Put `keys` in the CPU tier as completed stores do (most recently used last)."""
    blocks = sched.cpu_pool.allocate(len(keys))
    sched.cpu_pool.reserve(blocks, keys)
    sched.cpu_pool.commit(blocks)
    sched.cpu_pool.free(blocks)


def test_a_deferrals_stores_never_evict_the_cpu_copies_of_the_blocks_its_admission_evicts():
    """A's blocks are saved on the CPU (its least recently used copies) and sit free at the GPU's eviction
    frontier, next to unsaved blocks C; an admission that would evict both is deferred. The store that saves
    C must evict other copies (B's): evicting A's would lose A when the admission drops it from the GPU
    next step (all 1,283 blocks one agentic replay lost one at a time were lost that way)."""
    sched, gpu = make_scheduler(num_gpu_blocks=12, num_cpu_blocks=9, store_policy="lazy", lazy_lookahead_blocks=1)
    put_under_pressure(sched)
    a, b, c = ([key(100 * g + i) for i in range(4)] for g in (1, 2, 3))
    cache_on_cpu(sched, a)
    cache_on_cpu(sched, b)  # the CPU tier is full; A's copies are the least recently used
    blocks = gpu.allocate(8)
    for block, k in zip(blocks, a + c, strict=True):
        gpu.cache(block, k)
    gpu.free(blocks)  # the GPU frontier: 3 empty blocks, then A, then C
    request = FakeRequest("r", list(range(1000, 1044)), 4)  # 11 blocks: it evicts all of them
    assert sched.get_num_new_matched_tokens(request, 0) == (None, False)
    meta = sched.build_connector_meta([])
    assert len(meta.store_gpu_blocks) == 4  # C's
    assert all(sched.cpu_pool.lookup(k) is not None for k in a)
    assert all(sched.cpu_pool.lookup(k) is None for k in b)
    assert [blk.block_hash for blk in sched.cpu_pool.free_queue][-4:] == a  # A: most recently used, in order
