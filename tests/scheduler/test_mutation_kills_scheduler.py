"""Scheduler-side behaviours that no test pinned until mutation testing (docs/mutation.md) showed the gap.

Stories in the style of test_scheduler_scenarios.py: one behaviour each, numbered steps, public behaviour.
"""

from __future__ import annotations

from helpers import FakeRequest, admit, make_scheduler, put_under_pressure, report, step_done

from offload_connector.hashing import with_group_id
from scheduler_side import BlockPool

BS = 4


def finish(sched, gpu, req, ids):
    assert sched.request_finished(req) == (False, None)
    gpu.free([gpu.blocks[i] for i in reversed(ids)])


# ---- statistics ------------------------------------------------------------------------------------------


# ---- the block pool ----------------------------------------------------------------------------------------


# ---- reset_cache -------------------------------------------------------------------------------------------


# ---- ARC hints under a KV-cache group other than 0 -----------------------------------------------------------


def free_ids(pool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


# ---- completions -------------------------------------------------------------------------------------------


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


# ---- finish and preemption of requests the connector does not know ----------------------------------------


# ---- eager stores -----------------------------------------------------------------------------------------------


# ---- pools and queues -----------------------------------------------------------------------------------------


# ---- step metadata --------------------------------------------------------------------------------------------


# ---- lookups ------------------------------------------------------------------------------------------------------


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


# ---- integrity checks see every broken invariant -------------------------------------------------------------


# ---- construction ----------------------------------------------------------------------------------------------


# ---- statistics of admissions ----------------------------------------------------------------------------------


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
