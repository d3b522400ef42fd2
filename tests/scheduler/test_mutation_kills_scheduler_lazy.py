"""The lazy store policy's decisions, one rule per test, through a scripted `StorePolicyView` (mutation testing,
docs/mutation.md, found these rules unpinned): when an admission is deferred, how many blocks a step stores,
how the lookahead follows the recent allocations, and when the CPU tier counts as under pressure."""

from __future__ import annotations

from dataclasses import dataclass, field

from helpers import FakeRequest, lazy_under_pressure

from offload_connector.hashing import with_group_id
from scheduler_side.policies.lazy import LazyStorePolicy
from scheduler_side.request_state import LoadJob, RequestState

BS = 4


@dataclass
class ScriptedView:
    """A `StorePolicyView` whose answers the test sets: the GPU frontier, saved keys, CPU room."""

    lazy_lookahead_blocks: int | None = 1
    max_blocks_per_step: int | None = None
    block_size: int = BS
    group_id: int = 0
    frontier: list[tuple[int, bytes | None]] = field(default_factory=list)
    saved: set[bytes] = field(default_factory=set)
    outstanding: set[int] = field(default_factory=set)
    cpu_free: int = 100
    num_gpu_blocks: int = 1000
    cpu_empty: int = 100
    gpu_free: int = 1000

    def is_saved(self, key: bytes) -> bool:
        return key in self.saved

    def is_dead(self, key: bytes) -> bool:
        return False

    def may_have_dead(self) -> bool:
        return False

    def saved_key_maps(self):
        return self.saved, frozenset()  # (read with `in` only)

    def is_store_outstanding(self, event_id: int) -> bool:
        return event_id in self.outstanding

    def cpu_num_free_blocks(self) -> int:
        return self.cpu_free

    def cpu_num_empty_blocks(self) -> int:
        return self.cpu_empty

    def gpu_num_free_blocks(self) -> int:
        return self.gpu_free

    def gpu_eviction_candidates(self):
        return iter(self.frontier)

    def gpu_frontier(self, num: int):
        head = self.frontier[:num]
        return [gpu_id for gpu_id, _ in head], [key for _, key in head]


def key(i: int) -> bytes:
    return b"k%04d" % i


def unsaved(first_id: int, n: int) -> list[tuple[int, bytes | None]]:
    return [(first_id + i, key(first_id + i)) for i in range(n)]


def empty(first_id: int, n: int) -> list[tuple[int, bytes | None]]:
    return [(first_id + i, None) for i in range(n)]


def state_of(num_blocks: int, gpu_hit_blocks: int = 0, request_id: str = "r") -> RequestState:
    state = RequestState(FakeRequest(request_id, list(range(num_blocks * BS)), BS))
    state.num_gpu_hit_blocks = gpu_hit_blocks
    return state


# ---- deferring an admission ----------------------------------------------------------------------------------
def test_an_admission_looks_exactly_as_far_as_the_blocks_it_allocates():
    # 4 blocks, 1 a GPU hit and 1 a CPU hit: it allocates 3 (the CPU hit's block too), all of them harmless
    view = ScriptedView(frontier=empty(1, 3) + unsaved(10, 1))
    assert lazy_under_pressure(view).may_admit(state_of(4, gpu_hit_blocks=1), 1)
    # one block more and its allocation would evict the unsaved block: deferred
    view.frontier = empty(1, 2) + unsaved(10, 1)
    assert not lazy_under_pressure(view).may_admit(state_of(4, gpu_hit_blocks=1), 1)


def test_an_admission_looks_no_further_than_the_engines_step_bound():
    view = ScriptedView(max_blocks_per_step=2, frontier=empty(1, 2) + unsaved(10, 5))
    assert lazy_under_pressure(view).may_admit(state_of(10), 0)  # only 2 blocks this step, both harmless
    view.max_blocks_per_step = 3
    assert not lazy_under_pressure(view).may_admit(state_of(10), 0)


def test_a_one_block_admission_that_would_evict_an_unsaved_block_is_deferred():
    view = ScriptedView(frontier=unsaved(1, 1))
    assert not lazy_under_pressure(view).may_admit(state_of(1), 0)


def test_saved_blocks_do_not_defer_an_admission():
    view = ScriptedView(frontier=unsaved(1, 3))
    view.saved = {k for _, k in view.frontier}
    assert lazy_under_pressure(view).may_admit(state_of(3), 0)


def test_an_admission_is_deferred_only_while_the_cpu_tier_can_take_what_it_would_evict():
    view = ScriptedView(frontier=unsaved(1, 2), cpu_free=2)
    assert not lazy_under_pressure(view).may_admit(state_of(2), 0)  # exactly enough room
    view.cpu_free = 1
    assert lazy_under_pressure(view).may_admit(state_of(2), 0)  # deferring would be in vain


def test_the_next_store_covers_every_admission_deferred_this_step():
    view = ScriptedView(lazy_lookahead_blocks=1, frontier=unsaved(1, 50))
    policy = lazy_under_pressure(view)
    assert not policy.may_admit(state_of(2, request_id="a"), 0)
    assert not policy.may_admit(state_of(3, request_id="b"), 0)
    assert len(policy.pick_stores().gpu_ids) == 1 + 2 + 3  # the lookahead plus both needs
    policy.on_stores_emitted(None, [])
    assert len(policy.pick_stores().gpu_ids) == 1  # needs are for one step only


# ---- how many blocks a step stores ----------------------------------------------------------------------------
def picks_per_step(policy: LazyStorePolicy, view: ScriptedView, event_id: int) -> int:
    picks = policy.pick_stores()
    policy.on_stores_emitted(event_id, picks.gpu_ids)
    view.outstanding.add(event_id)
    return len(picks.gpu_ids)


def test_the_lookahead_follows_the_recent_peak_allocation():
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
    last event was still in flight at the next step and lets each pick count for less accordingly."""
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


# ---- CPU pressure ----------------------------------------------------------------------------------------------
def test_the_cpu_tier_is_under_pressure_from_the_first_miss_on_content_it_evicted():
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
    view = ScriptedView(group_id=3)
    state = state_of(3)
    assert LazyStorePolicy(view).on_allocated(state, 2) == []  # no pressure: the copies stay
    policy = lazy_under_pressure(view)
    assert policy.on_allocated(state, 2) == [with_group_id(h, 3) for h in state.request.block_hashes[:2]]
    assert policy.on_allocated(state, 0) == []


def test_a_deferred_admission_needs_whole_blocks():
    """A 9-token prompt takes 3 blocks (the last one partly filled): the store after its deferral covers 3
    blocks of need, also while picks weigh less than a block each."""
    view = ScriptedView(lazy_lookahead_blocks=1, frontier=unsaved(1, 200))
    policy = lazy_under_pressure(view)
    assert [picks_per_step(policy, view, event_id) for event_id in range(2)] == [1, 2]  # events outlast steps
    assert not policy.may_admit(RequestState(FakeRequest("r", list(range(9)), BS)), 0)
    assert len(policy.pick_stores().gpu_ids) == 7  # (1 + 3) blocks of budget at 0.512 of a block per pick
