"""The lazy store policy in its frontier mode (under pressure), one rule per test through a scripted
`StorePolicyView` (tests/lazy_view.py): when the mode starts (the first miss on content the CPU tier
evicted) and what it changes, how far ahead of the GPU eviction frontier a step stores (the lookahead), which
frontier blocks a step picks, the blocks it holds for a finishing request, and what a completed store gives
back. The scheduler-level stories: test_lazy_policy.py; the admission window and deferrals:
test_lazy_policy_exact.py."""

from __future__ import annotations

from helpers import lazy_under_pressure
from lazy_view import ScriptedView, picks_per_step, state_of, unsaved

from offload_connector.hashing import with_group_id
from scheduler_side.policies.lazy import LazyStorePolicy
from scheduler_side.request_state import LoadJob


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
