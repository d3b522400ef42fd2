"""Scheduler-side behaviours that no test pinned until mutation testing (docs/mutation.md) showed the gap.

Stories in the style of test_scheduler_scenarios.py: one behaviour each, numbered steps, public behaviour.
"""

from __future__ import annotations

from helpers import FakeRequest, admit, make_scheduler, put_under_pressure, report, step_done

from offload_connector.hashing import with_group_id
from scheduler_side import BlockPool
from scheduler_side.stats import FIELDS, SchedulerStats

BS = 4


def finish(sched, gpu, req, ids):
    assert sched.request_finished(req) == (False, None)
    gpu.free([gpu.blocks[i] for i in reversed(ids)])


def store_prefix(sched, gpu, req_id: str, tokens: list[int]) -> FakeRequest:
    """Admit, compute and finish a request under eager stores; its full blocks end up on the CPU."""
    req = FakeRequest(req_id, tokens, BS)
    _, _, ids = admit(sched, gpu, req)
    meta = sched.build_connector_meta([step_done(req_id, ids, len(tokens))])
    sched.update_connector_output(report(completed_store_events=[meta.store_event]))
    finish(sched, gpu, req, ids)
    return req


# ---- statistics ------------------------------------------------------------------------------------------
def test_stats_values_and_snapshot_follow_the_field_order():
    stats = SchedulerStats()
    for i, name in enumerate(FIELDS):
        setattr(stats, name, i + 1)
    assert stats.values() == tuple(range(1, len(FIELDS) + 1))
    assert stats.snapshot() == {name: i + 1 for i, name in enumerate(FIELDS)}
    assert list(stats.snapshot()) == list(FIELDS) and FIELDS[0] == "num_lookups"


# ---- the block pool ----------------------------------------------------------------------------------------
def test_discard_leaves_a_held_block_and_its_content_alone():
    pool = BlockPool(4)
    (held,) = pool.allocate(1)
    assert pool.cache(held, b"k")
    assert pool.discard(held) is False
    assert pool.lookup(b"k") is held and held.ref_cnt == 1
    pool.free([held])
    assert pool.discard(held) is True
    assert pool.lookup(b"k") is None and next(iter(pool.free_queue)) is held  # first to be reused
    pool.check_integrity()


# ---- reset_cache -------------------------------------------------------------------------------------------
def test_reset_cache_forgets_everything_stored_or_being_stored():
    # max_store_wait_steps 0: C loads the blocks B's pending hit pins instead of waiting for that load
    sched, gpu = make_scheduler(num_gpu_blocks=40, num_cpu_blocks=20, block_size=BS, max_store_wait_steps=0)
    prefix = list(range(9))  # 2 full blocks
    store_prefix(sched, gpu, "A", prefix)
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


def test_reset_cache_says_false_while_the_lazy_policy_holds_unsaved_blocks():
    sched, gpu = make_scheduler(num_gpu_blocks=4, num_cpu_blocks=8, block_size=BS,
                                store_policy="lazy", lazy_lookahead_blocks=8)
    put_under_pressure(sched)  # lazy's frontier mode
    a = FakeRequest("A", list(range(9)), BS)
    _, _, ids = admit(sched, gpu, a)
    sched.build_connector_meta([step_done("A", ids, 9)])
    finish(sched, gpu, a, ids)  # a nearly full GPU pool: the policy holds A's 2 blocks for the next store
    assert sched.reset_cache() is False
    meta = sched.build_connector_meta([])  # the store takes them
    assert len(meta.store_gpu_blocks) == 2
    assert sched.reset_cache() is True  # the store is in flight (failed now), nothing held
    sched.update_connector_output(report(completed_store_events=[meta.store_event]))
    assert not sched.cpu_pool.cached and sched.is_idle()


# ---- ARC hints under a KV-cache group other than 0 -----------------------------------------------------------
def test_arc_hints_use_the_schedulers_group_id():
    from offload_connector.config import load_config
    from scheduler_side import BlockPoolGpuView, OffloadScheduler
    from scheduler_side.pool.eviction.arc import T2

    group = 3
    gpu = BlockPool(64)
    sched = OffloadScheduler(load_config({"store_policy": "eager", "num_cpu_blocks": 6, "eviction": "arc"}), BS, 6, BlockPoolGpuView(gpu),
                             group_id=group)
    q = sched.cpu_pool.free_queue

    def run(req_id: str, tokens: list[int], gpu_hit_tokens: int = 0) -> None:
        req = FakeRequest(req_id, tokens, BS)
        hit, _, ids = admit(sched, gpu, req, gpu_hit_tokens)
        if hit:
            sched.build_connector_meta([])
            sched.update_connector_output(report(finished_load_reqs=[req_id]))
        meta = sched.build_connector_meta([step_done(req_id, ids, len(tokens))])
        if meta.store_event is not None:
            sched.update_connector_output(report(completed_store_events=[meta.store_event]))
        finish(sched, gpu, req, ids)

    def key(tokens: list[int], i: int = 0) -> bytes:
        return with_group_id(FakeRequest("k", tokens, BS).block_hashes[i], group)

    prefix = list(range(9))
    run("a", prefix)
    run("a2", prefix)  # a CPU hit: reused, under the group's key
    assert sched.cpu_pool.lookup(key(prefix)).seg == T2
    others = [[1000 * (n + 1) + t for t in range(13)] for n in range(2)]  # 3 blocks each: x1 evicts x0
    for n, tokens in enumerate(others):
        run(f"x{n}", tokens)
    ghost0, ghost1 = key(others[0], 0), key(others[0], 1)
    assert ghost0 in q.b1 and ghost1 in q.b1
    # a lookup whose GPU hit covers block 0: only blocks 1.. missed on the CPU, the first of them adapts
    p_before = q.p
    req = FakeRequest("again", others[0], BS)
    assert sched.get_num_new_matched_tokens(req, BS) == (0, False)
    assert q.p > p_before
    assert ghost1 in q.recent and ghost1 not in q.b1
    assert ghost0 in q.b1 and ghost0 not in q.recent  # never looked up on the CPU
    sched.request_finished(req)


def sched_with_group(group: int, **overrides):
    from offload_connector.config import load_config
    from scheduler_side import BlockPoolGpuView, OffloadScheduler

    gpu = BlockPool(64)
    config = load_config({"store_policy": "eager", "num_cpu_blocks": 16, **overrides})
    return OffloadScheduler(config, BS, 16, BlockPoolGpuView(gpu), group_id=group), gpu


def free_ids(pool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


# ---- completions -------------------------------------------------------------------------------------------
def test_transfer_figures_add_up_over_reports():
    sched, _ = make_scheduler(block_size=BS, world_size=2)
    sched.update_connector_output([report(rank=0, bytes_stored=100, bytes_loaded=10, store_seconds=1.5, load_seconds=0.5),
                                   report(rank=1, bytes_stored=50, bytes_loaded=5, store_seconds=0.5, load_seconds=0.25)])
    s = sched.stats
    assert (s.bytes_stored, s.bytes_loaded, s.store_seconds, s.load_seconds) == (150, 15, 2.0, 0.75)


def test_a_failed_store_frees_its_cpu_blocks_first_in_line_and_counts_every_failure():
    sched, gpu = make_scheduler(num_cpu_blocks=10, block_size=BS)
    for n, name in enumerate(("A", "B")):
        req = FakeRequest(name, [100 * n + t for t in range(9)], BS)
        _, _, ids = admit(sched, gpu, req)
        meta = sched.build_connector_meta([step_done(name, ids, 9)])
        sched.update_connector_output(report(failed_store_events=[meta.store_event]))
        assert free_ids(sched.cpu_pool)[:2] == meta.store_cpu_blocks  # reused first: they hold nothing
        finish(sched, gpu, req, ids)
    assert sched.stats.num_failed_store_blocks == 4 and not sched.cpu_pool.cached


def test_a_store_fails_if_any_rank_failed_it():
    sched, gpu = make_scheduler(block_size=BS, world_size=2)
    a = FakeRequest("A", list(range(9)), BS)
    _, _, ids = admit(sched, gpu, a)
    meta = sched.build_connector_meta([step_done("A", ids, 9)])
    sched.update_connector_output(report(rank=0, failed_store_events=[meta.store_event]))
    sched.update_connector_output(report(rank=1, completed_store_events=[meta.store_event]))
    assert not sched.cpu_pool.cached and sched.stats.num_failed_store_blocks == 2
    finish(sched, gpu, a, ids)
    assert sched.is_idle()


def test_a_completion_for_the_next_unissued_store_event_is_refused():
    import pytest

    from scheduler_side import SchedulerError

    sched, gpu = make_scheduler(block_size=BS)
    a = FakeRequest("A", list(range(9)), BS)
    _, _, ids = admit(sched, gpu, a)
    meta = sched.build_connector_meta([step_done("A", ids, 9)])
    with pytest.raises(SchedulerError, match="never issued"):
        sched.update_connector_output(report(completed_store_events=[meta.store_event + 1]))


def test_a_block_whose_request_is_gone_returns_to_the_gpu_queue_as_most_recently_used():
    # 1. eager: A finishes while its store is in flight; the store's reference is the last one
    sched, gpu = make_scheduler(num_gpu_blocks=10, block_size=BS)
    a = FakeRequest("A", list(range(9)), BS)
    _, _, ids = admit(sched, gpu, a)
    meta = sched.build_connector_meta([step_done("A", ids, 9)])
    finish(sched, gpu, a, ids)
    sched.update_connector_output(report(completed_store_events=[meta.store_event]))
    assert free_ids(gpu)[-2:] == meta.store_gpu_blocks
    # 2. B is aborted while its load is in flight; the load's references are the last ones
    b = FakeRequest("B", list(range(9)), BS)
    _, _, b_ids = admit(sched, gpu, b)
    load = sched.build_connector_meta([])
    finish(sched, gpu, b, b_ids)
    sched.update_connector_output(report(finished_load_reqs=["B"]))
    assert free_ids(gpu)[-2:] == load.load_gpu_blocks
    assert sched.is_idle()


def test_lazy_held_blocks_go_to_the_head_of_the_gpu_queue_once_saved():
    sched, gpu = make_scheduler(num_gpu_blocks=4, num_cpu_blocks=8, block_size=BS,
                                store_policy="lazy", lazy_lookahead_blocks=8)
    put_under_pressure(sched)  # lazy's frontier mode
    a = FakeRequest("A", list(range(9)), BS)
    _, _, ids = admit(sched, gpu, a)
    sched.build_connector_meta([step_done("A", ids, 9)])
    finish(sched, gpu, a, ids)  # the policy holds A's two full blocks for the next store
    meta = sched.build_connector_meta([])
    assert meta.store_gpu_blocks == ids[:2]
    sched.update_connector_output(report(completed_store_events=[meta.store_event]))
    assert free_ids(gpu) == ids[:2] + [ids[2]]  # saved copies are evicted first


def test_lazy_keeps_a_loaded_blocks_cpu_copy_as_most_recently_used_without_pressure():
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


def test_kv_events_name_the_stored_and_the_evicted_keys():
    sched, gpu = make_scheduler(num_cpu_blocks=3, block_size=BS)  # room for 2 blocks
    keys = []
    for n, name in enumerate(("A", "B")):
        req = FakeRequest(name, [100 * n + t for t in range(9)], BS)
        _, _, ids = admit(sched, gpu, req)
        meta = sched.build_connector_meta([step_done(name, ids, 9)])
        sched.update_connector_output(report(completed_store_events=[meta.store_event]))
        finish(sched, gpu, req, ids)
        keys.append([with_group_id(h) for h in req.block_hashes])
    events = [(e.kind, e.block_hash) for e in sched.take_events()]
    assert events[:2] == [("stored", k) for k in keys[0]]
    assert sorted(events[2:4]) == sorted(("removed", k) for k in keys[0])  # B's store evicted A's blocks
    assert events[4:] == [("stored", k) for k in keys[1]]


def test_integrity_finds_a_cpu_reference_nobody_accounts_for():
    import pytest

    from scheduler_side import SchedulerError

    sched, _ = make_scheduler(block_size=BS)
    sched.check_integrity()
    sched.cpu_pool.touch([sched.cpu_pool.blocks[1]])  # block 1, one reference: nobody's
    with pytest.raises(SchedulerError, match="referenced but no transfer"):
        sched.check_integrity()


# ---- finish and preemption of requests the connector does not know ----------------------------------------
def test_finish_and_preemption_of_an_unknown_request_change_nothing():
    sched, _ = make_scheduler(block_size=BS)
    assert sched.request_finished(FakeRequest("ghost", list(range(9)), BS)) == (False, None)
    sched.request_preempted("ghost")
    assert not sched.has_request("ghost") and sched.is_idle()


def test_a_preempted_request_recomputed_without_a_lookup_stores_from_its_first_block():
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


# ---- eager stores -----------------------------------------------------------------------------------------------
def test_eager_stores_every_new_block_even_after_one_another_request_took():
    sched, gpu = make_scheduler(block_size=BS)
    a = FakeRequest("A", list(range(9)), BS)
    b = FakeRequest("B", list(range(4)) + list(range(50, 55)), BS)  # A's first block, then its own
    _, _, a_ids = admit(sched, gpu, a)
    _, _, b_ids = admit(sched, gpu, b)
    meta = sched.build_connector_meta([step_done("A", a_ids, 9), step_done("B", b_ids, 9)])
    assert meta.store_gpu_blocks == a_ids[:2] + [b_ids[1]]  # B's first block is A's: picked once


def test_eager_stores_only_blocks_it_has_both_a_hash_and_a_gpu_block_for():
    sched, gpu = make_scheduler(block_size=BS)
    a = FakeRequest("A", list(range(9)), BS)  # 2 hashed blocks
    _, _, ids = admit(sched, gpu, a)
    # 1. decode ran past the hashed blocks: the third block has no hash yet
    extra = [b.block_id for b in gpu.allocate(1)]
    meta = sched.build_connector_meta([step_done("A", ids + extra, 16)])
    assert meta.store_gpu_blocks == ids[:2]
    # 2. a step that knows fewer GPU blocks than it computed stores only those it knows
    c = FakeRequest("C", list(range(200, 209)), BS)
    _, _, c_ids = admit(sched, gpu, c)
    meta = sched.build_connector_meta([step_done("C", c_ids[:1], 9)])
    assert meta.store_gpu_blocks == c_ids[:1]


def test_eager_keys_and_hits_use_the_schedulers_group_id():
    sched, gpu = sched_with_group(3)
    a = FakeRequest("A", list(range(9)), BS)
    _, _, ids = admit(sched, gpu, a)
    meta = sched.build_connector_meta([step_done("A", ids, 9)])
    sched.update_connector_output(report(completed_store_events=[meta.store_event]))
    assert sched.is_saved(with_group_id(a.block_hashes[0], 3)) and not sched.is_saved(with_group_id(a.block_hashes[0]))
    finish(sched, gpu, a, ids)
    assert sched.get_num_new_matched_tokens(FakeRequest("B", list(range(9)), BS), 0) == (8, True)


# ---- pools and queues -----------------------------------------------------------------------------------------
def test_popping_an_empty_free_queue_is_refused():
    import pytest

    from scheduler_side.pool.free_queue import FreeBlockQueue

    with pytest.raises(RuntimeError, match="empty queue"):
        FreeBlockQueue([]).popleft()


def test_commit_or_abort_of_a_block_without_a_reservation_is_refused():
    import pytest

    from scheduler_side.pool.block_pool import PoolError

    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    pool.cache(block, b"k")  # cached, not reserved
    for op in (pool.commit, pool.abort):
        with pytest.raises(PoolError, match="holds no reservation"):
            op([block])
    assert pool.lookup(b"k") is block


def test_arc_files_a_committed_store_of_a_recently_reused_key_as_reused():
    from scheduler_side.pool.eviction.arc import T1, T2

    pool = BlockPool(6, eviction="arc")
    pool.note_reuse(b"hot")  # a GPU hit: the key is reused, its block is not on the CPU
    blocks = pool.allocate(2)
    pool.reserve(blocks, [b"hot", b"cold"])
    assert pool.commit(blocks) == [b"hot", b"cold"]
    pool.free(blocks)
    assert (blocks[0].seg, blocks[1].seg) == (T2, T1)


# ---- step metadata --------------------------------------------------------------------------------------------
def test_events_are_numbered_consecutively_and_counted_over_steps():
    """Store events are numbered 0, 1, 2, ... (a completion above the last one is refused as never issued);
    load events likewise; the counters add up over steps."""
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


def test_stores_skipped_for_a_pinned_full_cpu_pool_add_up():
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


def test_an_unknown_scheduled_request_does_not_hide_the_ones_after_it():
    sched, gpu = make_scheduler(block_size=BS)
    a = FakeRequest("A", list(range(9)), BS)
    _, _, ids = admit(sched, gpu, a)
    meta = sched.build_connector_meta([step_done("never-looked-up", [50, 51], 9), step_done("A", ids, 9)])
    assert meta.store_gpu_blocks == ids[:2]


# ---- lookups ------------------------------------------------------------------------------------------------------
def test_lookup_counters_add_up():
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


def test_a_partial_gpu_hit_gets_no_cpu_hit():
    sched, gpu = make_scheduler(block_size=BS)
    store_prefix(sched, gpu, "A", list(range(13)))  # 3 blocks on the CPU
    b = FakeRequest("B", list(range(13)), BS)
    assert sched.get_num_new_matched_tokens(b, 6) == (0, False)  # the CPU run would start mid-block
    assert sched.phase_of("B").value == "looked up"
    sched.update_state_after_alloc(b, [blk.block_id for blk in gpu.allocate(4)], 0)
    assert sched.phase_of("B").value == "running"


def test_an_allocation_without_a_lookup_starts_tracking_the_request():
    sched, gpu = make_scheduler(block_size=BS)
    a = FakeRequest("A", list(range(9)), BS)
    ids = [b.block_id for b in gpu.allocate(3)]
    sched.update_state_after_alloc(a, ids, 0)
    assert sched.has_request("A") and sched.phase_of("A").value == "running"
    meta = sched.build_connector_meta([step_done("A", ids, 9)])
    assert meta.store_gpu_blocks == ids[:2]


def test_a_reservation_of_mismatched_lists_changes_nothing():
    import pytest

    pool = BlockPool(4)
    blocks = pool.allocate(2)
    with pytest.raises(ValueError):
        pool.reserve(blocks, [b"k1"])
    assert not pool.reserved and all(b.block_hash is None for b in blocks)


# ---- integrity checks see every broken invariant -------------------------------------------------------------
def test_pool_integrity_sees_the_null_block_in_the_free_queue_and_bad_reservations():
    import pytest

    from scheduler_side.pool.block_pool import PoolError

    for count in (0, 2):  # the null block's count changed by a bug (it never enters the free queue)
        pool = BlockPool(4)
        pool.null_block.ref_cnt = count
        with pytest.raises(PoolError, match="null block"):
            pool.check_integrity()
    for breakage in ("freed", "also cached"):
        pool = BlockPool(4)
        (a,) = pool.allocate(1)
        pool.reserve([a], [b"k"])
        if breakage == "freed":
            a.ref_cnt = 0  # a reservation whose block nobody holds
            pool.free_queue.append(a)
        else:
            pool.cached[b"k"] = a  # a reservation that is hit-able already
        with pytest.raises(PoolError, match="reservation"):
            pool.check_integrity()


# ---- construction ----------------------------------------------------------------------------------------------
def test_block_size_and_world_size_must_be_positive():
    import pytest

    from offload_connector.config import load_config
    from scheduler_side import BlockPoolGpuView, OffloadScheduler

    config, gpu = load_config({"store_policy": "eager", "num_cpu_blocks": 4}), BlockPoolGpuView(BlockPool(8))
    for block_size, world_size in ((0, 1), (1, 0), (-1, 1), (1, -2)):
        with pytest.raises(ValueError, match="must be positive"):
            OffloadScheduler(config, block_size, 4, gpu, world_size)
    assert OffloadScheduler(config, 1, 4, gpu, 1).block_size == 1


def test_arc_remembers_reused_keys_of_both_tiers():
    """ARC keeps the keys reused lately for the GPU's blocks and the CPU's: a key reused long ago (here 30
    reuses ago, more than the CPU holds) still files its block as reused when it is stored again."""
    from offload_connector.config import load_config
    from scheduler_side import BlockPoolGpuView, OffloadScheduler
    from scheduler_side.pool.eviction.arc import T2

    sched = OffloadScheduler(load_config({"store_policy": "eager", "num_cpu_blocks": 6, "eviction": "arc"}), BS, 6,
                             BlockPoolGpuView(BlockPool(40)), num_gpu_blocks=40)
    pool = sched.cpu_pool
    for k in range(30):
        pool.note_reuse(b"key%02d" % k)
    (block,) = pool.allocate(1)
    pool.reserve([block], [b"key00"])
    pool.commit([block])
    pool.free([block])
    assert block.seg == T2


# ---- statistics of admissions ----------------------------------------------------------------------------------
def test_admission_counters_add_up():
    sched, gpu = make_scheduler(block_size=BS)
    store_prefix(sched, gpu, "A", list(range(13)))  # 3 blocks on the CPU
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


# ---- lazy: the engine's step bound, and requests gone before their first step ----------------------------------
def lazy_with_unsaved_frontier(num_unsaved: int, **scheduler_kwargs):
    """A lazy scheduler (adaptive lookahead) whose GPU free queue is exactly `num_unsaved` blocks holding
    the engine's cached KV of an earlier prompt, none of it saved; 40 more GPU blocks are set aside. Under
    pressure (lazy's frontier mode)."""
    from offload_connector.config import load_config
    from scheduler_side import BlockPoolGpuView, OffloadScheduler

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
    sched, gpu, _ = lazy_with_unsaved_frontier(60, max_blocks_per_step=24)
    assert len(sched.build_connector_meta([]).store_gpu_blocks) == 24  # not the floor of 16


def test_lazy_lookahead_counts_only_the_blocks_an_admission_takes_from_the_free_queue():
    sched, gpu, reserved = lazy_with_unsaved_frontier(60)
    r = FakeRequest("R", list(range(1000, 1000 + 24 * BS)), BS)  # 24 blocks, the first 20 a GPU hit
    ids = [b.block_id for b in reserved[:24]]
    while sched.get_num_new_matched_tokens(r, 20 * BS)[0] is None:
        pass  # deferred once (its 4 new blocks would evict unsaved ones), then admitted
    sched.update_state_after_alloc(r, ids, 0)
    picked = len(sched.build_connector_meta([step_done("R", ids, 20 * BS)]).store_gpu_blocks)
    assert picked == 16 + 4  # the floor (2 x 4 new blocks is less) plus the deferred admission's need


def test_lazy_holds_nothing_of_a_request_finished_before_its_first_step():
    from offload_connector.config import load_config
    from scheduler_side import BlockPoolGpuView, OffloadScheduler

    gpu = BlockPool(4)
    sched = OffloadScheduler(load_config({"num_cpu_blocks": 8, "store_policy": "lazy", "lazy_lookahead_blocks": 8}),
                             1, 8, BlockPoolGpuView(gpu))  # one token per block
    a = FakeRequest("A", list(range(3)), 1)
    _, _, ids = admit(sched, gpu, a)  # the GPU pool is full now: the lazy policy would hold finished blocks
    finish(sched, gpu, a, ids)  # ... but A never ran: none of its blocks holds KV
    assert sched.policy.num_held_blocks == 0 and sched.is_idle()


# ---- ARC's adaptation step --------------------------------------------------------------------------------------
def arc_with_ghosts(num_blocks: int, reused: list[int]) -> tuple[BlockPool, list[bytes]]:
    """An ARC pool of `num_blocks` usable blocks that stored keys 0..num_blocks-1 (those in `reused` hit
    again), then had every block taken: seen-once keys are `b1` ghosts, reused ones `b2` ghosts."""
    pool = BlockPool(num_blocks + 1, eviction="arc")
    keys = [b"key%d" % k for k in range(num_blocks)]
    for k in keys:
        (block,) = pool.allocate(1)
        pool.cache(block, k)
        pool.free([block])
    for k in reused:
        pool.note_reuse(keys[k])
    pool.allocate(num_blocks)
    return pool, keys


def test_arc_moves_its_target_by_the_ratio_of_the_ghost_lists_at_least_one():
    """Megiddo & Modha: a hit on a seen-once ghost raises p by max(1, |b2| / |b1|), a hit on a reused ghost
    lowers it by max(1, |b1| / |b2|) (list sizes after the hit ghost left, at least 1), never below 0."""
    pool, keys = arc_with_ghosts(5, reused=[2, 3, 4])  # b1: 0 1, b2: 2 3 4
    q = pool.free_queue
    pool.note_miss(keys[0])
    assert q.p == 3.0  # |b2| 3 / |b1| 1
    pool.note_miss(keys[2])
    assert q.p == 2.0  # max(1, |b1| 1 / |b2| 2)
    pool, keys = arc_with_ghosts(5, reused=[3, 4])  # b1: 0 1 2, b2: 3 4
    pool.note_miss(keys[0])
    assert pool.free_queue.p == 1.0  # max(1, 2 / 2)
    pool, keys = arc_with_ghosts(6, reused=[5])  # b1: 0..4, b2: 5
    for k in (0, 1, 2):
        pool.note_miss(keys[k])
    assert pool.free_queue.p == 3.0
    pool.note_miss(keys[5])
    assert pool.free_queue.p == 1.0  # |b1| 2 / max(1, |b2| 0)


def test_arc_remembers_exactly_its_history_of_reused_keys_newest_first():
    from scheduler_side.pool.eviction.arc import T1, T2

    def seg_when_stored(pool: BlockPool, key: bytes) -> int:
        (block,) = pool.allocate(1)
        pool.reserve([block], [key])
        pool.commit([block])
        pool.free([block])
        return block.seg

    for reuses, first_remembered in ((8, True), (9, False)):
        pool = BlockPool(6, eviction="arc", history=8)
        for k in range(reuses):
            pool.note_reuse(b"key%d" % k)
        assert seg_when_stored(pool, b"key0") == (T2 if first_remembered else T1)
        assert seg_when_stored(pool, b"key%d" % (reuses - 1)) == T2  # the newest is always remembered


def test_arc_keeps_no_more_ghosts_than_it_has_blocks_and_drops_a_ghost_stored_again():
    pool = BlockPool(2, eviction="arc")  # one usable block
    for k in (b"a", b"b"):
        (block,) = pool.allocate(1)  # evicts the previous key
        pool.cache(block, k)
        pool.free([block])
    pool.allocate(1)
    q = pool.free_queue
    assert list(q.b1) == [b"b"]  # a's ghost made room for b's
    pool = BlockPool(4, eviction="arc")
    (block,) = pool.allocate(1)
    pool.cache(block, b"k")
    pool.free([block])
    taken = pool.allocate(3)  # k is evicted: a ghost
    assert b"k" in pool.free_queue.b1
    pool.free(taken[:1])
    (again,) = pool.allocate(1)
    pool.reserve([again], [b"k"])
    pool.commit([again])  # stored again: no longer a ghost, and no adaptation
    assert b"k" not in pool.free_queue.b1 and pool.free_queue.p == 0.0


def test_caching_a_free_block_files_it_as_seen_once():
    from scheduler_side.pool.eviction.arc import EMPTY, T1

    pool = BlockPool(4, eviction="arc")
    block = pool.blocks[2]
    assert block.seg == EMPTY
    assert pool.cache(block, b"k")
    assert block.seg == T1 and block in list(pool.free_queue.t1)
    pool.check_integrity()


def test_recaching_a_block_under_another_key_forgets_the_old_one_and_only_that():
    evicted = []
    pool = BlockPool(4, on_evict=lambda key, by_allocation: evicted.append(key))
    (block,) = pool.allocate(1)
    assert pool.cache(block, b"k1") and pool.cache(block, b"k1")  # the same key again: nothing dropped
    assert evicted == [] and pool.lookup(b"k1") is block
    assert pool.cache(block, b"k2")
    assert evicted == [b"k1"] and pool.lookup(b"k1") is None and pool.lookup(b"k2") is block
    pool.free([block])
    pool.check_integrity()
