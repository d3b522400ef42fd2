"""Lazy stores, in the scheduler: only hashed GPU blocks near the eviction frontier are saved, saved GPU blocks
keep their LRU position, a CPU copy of a block resident on the GPU gives way under pressure (and is kept as
the most recently used without), a finishing request's blocks are held for the next store (never those of
a request that never ran), and the lookahead follows the engine's step bound and what admissions take."""

import pytest
from helpers import (
    FakeRequest,
    admit,
    finish,
    free_ids,
    make_scheduler,
    put_under_pressure,
    report,
    step_done,
)

from offload_connector.config import load_config
from offload_connector.hashing import with_group_id
from scheduler_side import BlockPool, BlockPoolGpuView, OffloadScheduler

BS = 4


def compute_and_free(sched, gpu, req):
    """The engine computes `req` fully, caches its full blocks on the GPU and finishes it. Under pressure
    lazy stores nothing while the blocks are in use; while the CPU tier has room it stores every computed
    block, as eager does (that store completes here)."""
    _, _, ids = admit(sched, gpu, req)
    under_pressure = sched.policy.under_pressure
    meta = sched.build_connector_meta([step_done(req.request_id, ids, req.num_tokens)])
    if under_pressure:
        assert meta.store_event is None
    else:
        assert meta.store_gpu_blocks == ids[:req.num_tokens // BS]
        sched.update_connector_output(report(completed_store_events=[meta.store_event]))
    for gpu_id, h in zip(ids, req.block_hashes, strict=False):
        gpu.cache(gpu.blocks[gpu_id], with_group_id(h))
    sched.request_finished(req)
    gpu.free([gpu.blocks[i] for i in reversed(ids)])
    return ids


def test_lazy_stores_only_near_the_eviction_frontier():
    sched, gpu = make_scheduler(num_gpu_blocks=9, num_cpu_blocks=20, block_size=BS,
                                store_policy="lazy", lazy_lookahead_blocks=4)
    put_under_pressure(sched)
    a_ids = compute_and_free(sched, gpu, FakeRequest("A", list(range(8)), BS))  # 2 full blocks
    # free queue now: 3 4 5 6 7 8 (never used) then A's blocks, tail first: 2 1
    meta = sched.build_connector_meta([])
    assert meta.store_event is None  # A's blocks are beyond the 4-block lookahead
    gpu.touch([gpu.blocks[i] for i in (3, 4, 5, 6)])  # the engine allocates 4 blocks elsewhere
    meta = sched.build_connector_meta([])
    assert meta.store_gpu_blocks == [a_ids[1], a_ids[0]]  # frontier order: the tail block first
    sched.update_connector_output(report(completed_store_events=[meta.store_event]))
    # the saved GPU blocks are back in the free queue at their old LRU position
    assert [b.block_id for b in gpu.free_queue] == [7, 8, a_ids[1], a_ids[0]]
    assert sched.build_connector_meta([]).store_event is None  # already saved: not stored twice


def lazy_with_a_stored_prefix(pressure: bool):
    """A lazy scheduler whose CPU tier holds A's two blocks (and nothing else), under pressure or not."""
    sched, gpu = make_scheduler(num_gpu_blocks=12, num_cpu_blocks=20, block_size=BS,
                                store_policy="lazy", lazy_lookahead_blocks=20)
    if pressure:
        put_under_pressure(sched)
    compute_and_free(sched, gpu, FakeRequest("A", list(range(9)), BS))  # stored now, without pressure
    meta = sched.build_connector_meta([])  # under pressure: A's blocks lie within the 20-block lookahead
    if meta.store_event is not None:
        sched.update_connector_output(report(completed_store_events=[meta.store_event]))
    assert len(sched.cpu_pool.cached) == 2
    for blk in list(gpu.free_queue):  # the GPU copies get evicted
        gpu.uncache(blk)
    sched.build_connector_meta([])
    assert sched.policy.under_pressure == pressure
    return sched, gpu


@pytest.mark.parametrize("pressure", [True, False])
def test_lazy_loaded_cpu_copy_gives_way_under_pressure(pressure):
    sched, gpu = lazy_with_a_stored_prefix(pressure)
    b = FakeRequest("B", list(range(9)), BS)
    hit, _, ids = admit(sched, gpu, b)
    assert hit == 8
    meta = sched.build_connector_meta([])
    sched.update_connector_output(report(finished_load_reqs=["B"]))
    again = sched.get_num_new_matched_tokens(FakeRequest("C", list(range(9)), BS), 0)
    if pressure:  # the GPU holds them now: the CPU copies are forgotten (empty room, taken before content)
        assert all(sched.cpu_pool.blocks[i].block_hash is None for i in meta.load_cpu_blocks)
        assert not sched.cpu_pool.cached
        assert again == (0, False)
    else:  # room to spare: the copies stay hit-able
        assert again == (8, True)
    sched.request_finished(b)
    gpu.free([gpu.blocks[i] for i in reversed(ids)])
    sched.check_integrity()


def test_lazy_keeps_a_loaded_blocks_cpu_copy_as_most_recently_used_without_pressure():
    """Found by mutation testing of scheduler_side/policies/lazy.py (docs/mutation.md)."""
    # Until the tier fills, lazy keeps a loaded block's CPU copy: the GPU will drop that block relying on it,
    # so it is content just reused (the most recently used), not the first to go once the tier is full.
    sched, gpu = make_scheduler(num_gpu_blocks=12, num_cpu_blocks=20, block_size=BS,
                                store_policy="lazy", lazy_lookahead_blocks=20)
    for rid, first in (("A", 0), ("C", 100)):  # A's 2 full blocks on the CPU, then C's (more recent)
        req = FakeRequest(rid, list(range(first, first + 9)), BS)
        _, _, ids = admit(sched, gpu, req)
        meta = sched.build_connector_meta([step_done(rid, ids, 9)])  # no pressure: stored as computed
        sched.update_connector_output(report(completed_store_events=[meta.store_event]))
        finish(sched, gpu, req, ids)
    for blk in list(gpu.free_queue):
        gpu.uncache(blk)  # the GPU copies are evicted
    b = FakeRequest("B", list(range(9)), BS)
    hit, _, b_ids = admit(sched, gpu, b)
    assert hit == 8
    load = sched.build_connector_meta([])
    sched.update_connector_output(report(finished_load_reqs=["B"]))
    pool = sched.cpu_pool
    assert pool.num_evictions == 0 and len(pool.cached) == 4  # no pressure: kept
    order = [(blk.block_id, blk.block_hash is not None) for blk in pool.free_queue]
    assert order[:15] == [(i, False) for i, _ in order[:15]]  # the 15 empty blocks come first
    assert [i for i, _ in order[-2:]] == load.load_cpu_blocks  # then C's copies, then A's: most recent
    finish(sched, gpu, b, b_ids)


def test_a_load_whose_request_finished_meanwhile_keeps_its_cpu_copies():
    """The engine never caches the GPU blocks of a request that finished (was aborted) while loading, so
    under pressure too the CPU copies stay: they are all that is left of that content."""
    sched, gpu = lazy_with_a_stored_prefix(pressure=True)
    b = FakeRequest("B", list(range(9)), BS)
    hit, _, ids = admit(sched, gpu, b)
    assert hit == 8
    meta = sched.build_connector_meta([])
    assert sched.request_finished(b) == (False, None)  # aborted while its load is in flight
    gpu.free([gpu.blocks[i] for i in reversed(ids)])
    sched.update_connector_output(report(finished_load_reqs=["B"]))
    assert sorted(b.block_id for b in sched.cpu_pool.cached.values()) == sorted(meta.load_cpu_blocks)
    c = FakeRequest("C", list(range(9)), BS)
    assert sched.get_num_new_matched_tokens(c, 0) == (8, True)
    sched.request_finished(c)
    sched.check_integrity()


@pytest.mark.parametrize("pressure", [True, False])
def test_lazy_gpu_hit_discards_the_cpu_copy_under_pressure(pressure):
    sched, gpu = lazy_with_a_stored_prefix(pressure)
    b = FakeRequest("B", list(range(9)), BS)
    # 1. a lookup alone changes nothing: B might not get its blocks
    assert sched.get_num_new_matched_tokens(b, 8) == (0, False)
    assert len(sched.cpu_pool.cached) == 2
    # 2. B is allocated and holds both blocks as GPU hits: under pressure the CPU copies give way
    sched.update_state_after_alloc(b, [1, 2, 3], 0)
    assert len(sched.cpu_pool.cached) == (0 if pressure else 2)


def test_lazy_holds_a_finished_requests_blocks_when_the_pool_is_nearly_full():
    """Step 3 found by mutation testing of scheduler_side/completions.py (docs/mutation.md)."""
    sched, gpu = make_scheduler(num_gpu_blocks=4, num_cpu_blocks=8, block_size=BS,
                                store_policy="lazy", lazy_lookahead_blocks=8)
    put_under_pressure(sched)
    a = FakeRequest("A", list(range(9)), BS)
    _, _, ids = admit(sched, gpu, a)
    assert sched.build_connector_meta([step_done("A", ids, 9)]).store_event is None
    # 1. A finishes with 0 free GPU blocks (< lookahead): its 2 full blocks are held, not freed.
    assert sched.request_finished(a) == (False, None)
    gpu.free([gpu.blocks[i] for i in reversed(ids)])
    assert sched.num_inflight_transfers == 2 and not sched.is_idle()
    assert [gpu.blocks[i].ref_cnt for i in ids] == [1, 1, 0]
    # 2. The next step's allocation cannot evict them; the next metadata stores them.
    assert gpu.allocate(2) is None
    meta = sched.build_connector_meta([])
    assert meta.store_gpu_blocks == ids[:2]
    assert [gpu.blocks[i].ref_cnt for i in ids] == [1, 1, 0]  # each hold's reference is the event's now
    sched.update_connector_output(report(completed_store_events=[meta.store_event]))
    assert sched.is_idle() and gpu.num_held_blocks() == 0
    assert free_ids(gpu) == ids[:2] + [ids[2]]  # 3. once saved, the held blocks are the first to be evicted
    assert sched.get_num_new_matched_tokens(FakeRequest("B", list(range(9)), BS), 0) == (8, True)


def lazy_holding_two_blocks():
    """A lazy scheduler under pressure whose 4-block GPU pool is full when request A (2 full blocks and a
    partial one) finishes: A's full blocks are held for the next store event."""
    sched, gpu = make_scheduler(num_gpu_blocks=4, num_cpu_blocks=8, block_size=BS,
                                store_policy="lazy", lazy_lookahead_blocks=8)
    put_under_pressure(sched)
    a = FakeRequest("A", list(range(9)), BS)
    _, _, ids = admit(sched, gpu, a)
    sched.build_connector_meta([step_done("A", ids, 9)])
    sched.request_finished(a)
    gpu.free([gpu.blocks[i] for i in reversed(ids)])
    assert sched.policy.num_held_blocks == 2
    return sched, gpu, a, ids


def test_a_held_block_the_cpu_tier_has_no_room_for_is_released_not_stored():
    """Two held blocks, one free CPU block: the event stores the first with its hold's reference and the
    second's hold is let go at once (free again, unsaved), so nothing stays referenced."""
    sched, gpu, _, ids = lazy_holding_two_blocks()
    pinned = sched.cpu_pool.allocate(sched.cpu_pool.num_free_blocks - 1)  # room for one store
    meta = sched.build_connector_meta([])
    assert meta.store_gpu_blocks == [ids[0]] and sched.stats.num_store_skipped_blocks == 1
    assert [gpu.blocks[i].ref_cnt for i in ids] == [1, 0, 0] and sched.policy.num_held_blocks == 0
    sched.update_connector_output(report(completed_store_events=[meta.store_event]))
    sched.cpu_pool.free(pinned)
    assert sched.is_idle() and gpu.num_held_blocks() == 0
    sched.check_integrity()
    assert sched.get_num_new_matched_tokens(FakeRequest("B", list(range(9)), BS), 0) == (4, True)  # A's 1st only


def test_a_held_block_saved_meanwhile_is_released_not_stored_again():
    """A block held at finish may reach the CPU tier another way before the next metadata (the remote tier's
    fetch completing): the store event leaves it out (reserving its key again is a caller bug), and the
    hold is still released. Found by test_remote_state_machine."""
    sched, gpu, a, ids = lazy_holding_two_blocks()
    [cpu_block] = sched.cpu_pool.allocate(1)  # A's first block arrives on the CPU tier meanwhile
    sched.cpu_pool.cache(cpu_block, with_group_id(a.block_hashes[0]))
    sched.cpu_pool.free([cpu_block])
    meta = sched.build_connector_meta([])
    assert meta.store_gpu_blocks == [ids[1]]
    assert gpu.blocks[ids[0]].ref_cnt == 0 and sched.policy.num_held_blocks == 0
    sched.update_connector_output(report(completed_store_events=[meta.store_event]))
    assert sched.is_idle() and gpu.num_held_blocks() == 0
    sched.check_integrity()


def lazy_with_unsaved_frontier(num_unsaved: int, **scheduler_kwargs):
    """A lazy scheduler (adaptive lookahead) whose GPU free queue is exactly `num_unsaved` blocks holding
    the engine's cached KV of an earlier prompt, none of it saved; 40 more GPU blocks are set aside. Under
    pressure (lazy's frontier mode)."""
    gpu = BlockPool(1 + 40 + num_unsaved)
    sched = OffloadScheduler(load_config({"num_cpu_blocks": 200, "store_policy": "lazy"}), BS, 200,
                             BlockPoolGpuView(gpu), **scheduler_kwargs)
    put_under_pressure(sched)  # lazy's frontier mode
    reserved = gpu.allocate(40)
    earlier = FakeRequest("U", list(range(num_unsaved * BS)), BS)
    blocks = gpu.allocate(num_unsaved)
    for block, h in zip(blocks, earlier.block_hashes, strict=True):
        gpu.cache(block, with_group_id(h))
    gpu.free(blocks)
    return sched, gpu, reserved


def test_lazy_lookahead_is_at_least_the_engines_step_bound():
    """Found by mutation testing of scheduler_side/policies/lazy.py (docs/mutation.md)."""
    sched, gpu, _ = lazy_with_unsaved_frontier(60, max_blocks_per_step=24)
    assert len(sched.build_connector_meta([]).store_gpu_blocks) == 24  # not the floor of 16


def test_lazy_lookahead_counts_only_the_blocks_an_admission_takes_from_the_free_queue():
    """Found by mutation testing of scheduler_side/policies/lazy.py (docs/mutation.md)."""
    sched, gpu, reserved = lazy_with_unsaved_frontier(60)
    r = FakeRequest("R", list(range(1000, 1000 + 24 * BS)), BS)  # 24 blocks, the first 20 a GPU hit
    ids = [b.block_id for b in reserved[:24]]
    while sched.get_num_new_matched_tokens(r, 20 * BS)[0] is None:
        pass  # deferred once (its 4 new blocks would evict unsaved ones), then admitted
    sched.update_state_after_alloc(r, ids, 0)
    picked = len(sched.build_connector_meta([step_done("R", ids, 20 * BS)]).store_gpu_blocks)
    assert picked == 16 + 4  # the floor (2 x 4 new blocks is less) plus the deferred admission's need


def test_lazy_defers_an_admission_that_would_evict_unsaved_blocks_once():
    """A burst larger than the lookahead: the request waits one step while that step's store saves the
    blocks its allocation takes; it is deferred at most once."""
    sched, gpu = make_scheduler(num_gpu_blocks=9, num_cpu_blocks=20, block_size=BS,
                                store_policy="lazy", lazy_lookahead_blocks=1)
    put_under_pressure(sched)
    a_ids = compute_and_free(sched, gpu, FakeRequest("A", list(range(8)), BS))  # 2 cached blocks
    gpu.touch([gpu.blocks[i] for i in (3, 4, 5, 6, 7)])  # the frontier is now 8, then A's 2 and 1
    meta = sched.build_connector_meta([])
    assert meta.store_gpu_blocks == []  # block 8 holds nothing; A's are beyond the 1-block lookahead
    big = FakeRequest("B", list(range(100, 111)), BS)  # 3 blocks: 8, then A's two, unsaved
    assert sched.get_num_new_matched_tokens(big, 0) == (None, False)
    assert sched.stats.num_deferred_lookups == 1
    meta = sched.build_connector_meta([])
    assert sorted(meta.store_gpu_blocks) == sorted(a_ids)  # the deferred need is stored this step
    sched.update_connector_output(report(completed_store_events=[meta.store_event]))
    assert sched.get_num_new_matched_tokens(big, 0) == (0, False)  # now it may evict them: saved
    for k in (0, 1):
        assert sched.is_saved(with_group_id(FakeRequest("A", list(range(8)), BS).block_hashes[k]))


def test_lazy_defers_a_request_at_most_once():
    sched, gpu = make_scheduler(num_gpu_blocks=9, num_cpu_blocks=20, block_size=BS,
                                store_policy="lazy", lazy_lookahead_blocks=1)
    put_under_pressure(sched)
    compute_and_free(sched, gpu, FakeRequest("A", list(range(8)), BS))
    gpu.touch([gpu.blocks[i] for i in (3, 4, 5, 6, 7, 8)])
    big = FakeRequest("B", list(range(100, 108)), BS)
    assert sched.get_num_new_matched_tokens(big, 0) == (None, False)
    meta = sched.build_connector_meta([])
    assert len(meta.store_gpu_blocks) == 2
    sched.update_connector_output(report(failed_store_events=[meta.store_event]))  # still unsaved
    assert sched.get_num_new_matched_tokens(big, 0) == (0, False)  # admitted anyway: deferred once only
    assert sched.stats.num_deferred_lookups == 1
    sched.check_integrity()


def test_lazy_does_not_defer_for_blocks_the_cpu_tier_cannot_take():
    sched, gpu = make_scheduler(num_gpu_blocks=9, num_cpu_blocks=2, block_size=BS,  # one usable CPU block
                                store_policy="lazy", lazy_lookahead_blocks=1)
    put_under_pressure(sched)
    compute_and_free(sched, gpu, FakeRequest("A", list(range(8)), BS))
    gpu.touch([gpu.blocks[i] for i in (3, 4, 5, 6, 7, 8)])
    assert sched.get_num_new_matched_tokens(FakeRequest("B", list(range(100, 108)), BS), 0) == (0, False)
    assert sched.stats.num_deferred_lookups == 0


def test_eager_never_defers():
    sched, gpu = make_scheduler(num_gpu_blocks=9, num_cpu_blocks=20, block_size=BS, store_policy="eager")
    a = FakeRequest("A", list(range(8)), BS)
    _, _, ids = admit(sched, gpu, a)
    for gpu_id, h in zip(ids, a.block_hashes, strict=True):
        gpu.cache(gpu.blocks[gpu_id], with_group_id(h))
    sched.request_finished(a)
    gpu.free([gpu.blocks[i] for i in reversed(ids)])  # cached and never stored: eager stores on compute
    gpu.touch([gpu.blocks[i] for i in (3, 4, 5, 6, 7)])
    assert sched.get_num_new_matched_tokens(FakeRequest("B", list(range(100, 111)), BS), 0) == (0, False)


def test_a_preempted_request_finished_before_readmission_holds_nothing():
    """Lazy, GPU free queue shorter than the lookahead: A is preempted (the engine frees its blocks and gives
    them to B), then aborted before it is re-admitted. The policy must not hold or store A's former
    blocks under A's keys: they hold B's KV now (a later hit on A's prompt would read it)."""
    sched, gpu = make_scheduler(num_gpu_blocks=9, num_cpu_blocks=20, block_size=BS,
                                store_policy="lazy", lazy_lookahead_blocks=16)
    put_under_pressure(sched)
    a = FakeRequest("A", list(range(12)), BS)
    # 1. A runs: its 3 full blocks are computed and cached on the GPU.
    _, _, a_ids = admit(sched, gpu, a)
    sched.build_connector_meta([step_done("A", a_ids, 12)])
    for gpu_id, h in zip(a_ids, a.block_hashes, strict=False):
        gpu.cache(gpu.blocks[gpu_id], with_group_id(h))
    # 2. preempted: the connector hears of it; the engine frees A's blocks ...
    sched.request_preempted("A")
    gpu.free([gpu.blocks[i] for i in reversed(a_ids)])
    for gpu_id in a_ids:
        gpu.uncache(gpu.blocks[gpu_id])
    # ... and hands them to B (other content, no connector involvement)
    b_blocks = gpu.allocate(gpu.num_free_blocks)
    assert {b.block_id for b in b_blocks} >= set(a_ids)
    # 3. A is aborted before it is looked up again.
    assert sched.request_finished(a) == (False, None)
    assert sched.policy.num_held_blocks == 0
    assert all(gpu.blocks[i].ref_cnt == 1 for i in a_ids)  # only B's references
    meta = sched.build_connector_meta([])
    assert not set(meta.store_gpu_blocks) & set(a_ids)
    gpu.free(b_blocks)
    assert sched.is_idle()


def test_lazy_holds_nothing_of_a_request_finished_before_its_first_step():
    """Found by mutation testing of scheduler_side/policies/lazy.py (docs/mutation.md)."""
    gpu = BlockPool(4)
    sched = OffloadScheduler(load_config({"num_cpu_blocks": 8, "store_policy": "lazy", "lazy_lookahead_blocks": 8}),
                             1, 8, BlockPoolGpuView(gpu))  # one token per block
    put_under_pressure(sched)  # lazy's frontier mode: without it nothing is ever held
    a = FakeRequest("A", list(range(3)), 1)
    _, _, ids = admit(sched, gpu, a)  # the GPU pool is full now: the lazy policy would hold finished blocks
    finish(sched, gpu, a, ids)  # ... but A never ran: none of its blocks holds KV
    assert sched.policy.num_held_blocks == 0 and sched.is_idle()


def test_a_saved_block_whose_cpu_copy_is_evicted_is_stored_again_before_the_gpu_evicts_it():
    """The saved head of the GPU free queue is not read again each step: a block in it whose CPU copy the
    tier evicts must still be stored again (else the GPU evicts its last copy)."""
    sched, gpu = make_scheduler(num_gpu_blocks=9, num_cpu_blocks=20, block_size=BS,
                                store_policy="lazy", lazy_lookahead_blocks=8)
    put_under_pressure(sched)
    a_ids = compute_and_free(sched, gpu, FakeRequest("A", list(range(8)), BS))  # 2 full blocks
    meta = sched.build_connector_meta([])
    assert sorted(meta.store_gpu_blocks) == sorted(a_ids[:2])  # within the lookahead: saved
    sched.update_connector_output(report(completed_store_events=[meta.store_event]))
    assert sched.build_connector_meta([]).store_event is None  # the saved head: nothing new to read
    key = with_group_id(FakeRequest("A", list(range(8)), BS).block_hashes[1])
    sched.cpu_pool.discard(sched.cpu_pool.cached[key])  # the tier drops one copy
    meta = sched.build_connector_meta([])
    assert meta.store_gpu_blocks == [a_ids[1]]
    sched.update_connector_output(report(completed_store_events=[meta.store_event]))
    sched.check_integrity()
