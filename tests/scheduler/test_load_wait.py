"""A lookup whose CPU hit starts at a block another request is loading waits for that load.

Once the load is done the engine's GPU prefix cache holds those blocks, so the waiting request hits them
on the GPU instead of loading the same blocks a second time into blocks of its own (and, one request at a
time, instead of being admitted next to the loading request and missing what that request computes). The
wait is bounded by `max_store_wait_steps` per request; past it the request loads its hit as before.
"""

from __future__ import annotations

import pytest
from helpers import FakeRequest, admit, make_scheduler, report, store_and_finish

from offload_connector.fake_engine import FakeEngine
from offload_connector.fake_engine.workload import small_config

BS = 4


def stored_and_evicted(**overrides):
    """A scheduler whose CPU tier holds A's two full blocks, which the GPU no longer has."""
    sched, gpu = make_scheduler(num_gpu_blocks=12, num_cpu_blocks=8, block_size=BS, **overrides)
    store_and_finish(sched, gpu, FakeRequest("A", list(range(9)), BS))
    for block in list(gpu.free_queue):
        gpu.uncache(block)
    return sched, gpu


def test_a_lookup_waits_while_another_request_loads_its_first_cpu_block():
    sched, gpu = stored_and_evicted()
    b, c = FakeRequest("B", list(range(9)), BS), FakeRequest("C", list(range(10)), BS)
    assert admit(sched, gpu, b)[:2] == (8, True)
    meta = sched.build_connector_meta([])  # B's load is in flight
    assert sched.get_num_new_matched_tokens(c, 0) == (None, False)
    assert sched.stats.num_load_waits == 1
    assert sched.get_num_new_matched_tokens(c, 0) == (None, False)  # still loading: asks again
    sched.update_connector_output(report(finished_load_reqs=["B"]))
    # B's load is done: the engine now hits those blocks on the GPU, so C has nothing to load.
    assert sched.get_num_new_matched_tokens(c, 8) == (0, False)
    assert sched.stats.num_load_waits == 2
    assert meta.load_cpu_blocks and sched.stats.num_loaded_blocks == 2


def test_a_pending_hit_of_the_same_step_counts_as_a_load():
    sched, _ = stored_and_evicted()
    b, c = FakeRequest("B", list(range(9)), BS), FakeRequest("C", list(range(9)), BS)
    assert sched.get_num_new_matched_tokens(b, 0) == (8, True)  # pinned, allocated later this step
    assert sched.get_num_new_matched_tokens(c, 0) == (None, False)


def test_the_wait_is_bounded_then_the_request_loads_its_hit():
    sched, gpu = stored_and_evicted(max_store_wait_steps=2)
    b, c = FakeRequest("B", list(range(9)), BS), FakeRequest("C", list(range(9)), BS)
    admit(sched, gpu, b)
    sched.build_connector_meta([])
    assert sched.get_num_new_matched_tokens(c, 0) == (None, False)
    assert sched.get_num_new_matched_tokens(c, 0) == (None, False)
    hit, is_async, _ = admit(sched, gpu, c)  # the third lookup: both read the same CPU blocks
    assert (hit, is_async) == (8, True)
    assert sched.stats.num_load_waits == 2


def test_a_lookup_after_the_gpu_hit_of_a_loading_block_does_not_wait():
    """Only the hit's *first* block matters: a request whose CPU run starts elsewhere loads at once."""
    sched, gpu = stored_and_evicted()
    admit(sched, gpu, FakeRequest("B", list(range(5)), BS))  # loads A's first block only
    sched.build_connector_meta([])
    c = FakeRequest("C", list(range(9)), BS)  # its GPU hit is block 0; its CPU run starts at block 1
    assert sched.get_num_new_matched_tokens(c, 4) == (4, True)
    assert sched.stats.num_load_waits == 0


@pytest.mark.parametrize("wait", [True, False])
def test_one_at_a_time_the_next_turn_hits_on_the_gpu_what_the_previous_loaded(wait):
    """The engine runs one request at a time, but a request waiting for its load does not count as running,
    so the next one is looked up meanwhile. Without the wait (max_store_wait_steps: 0) it loads the same
    prefix again and computes what the first one is about to compute; with it, it waits and then hits all
    of that on the GPU. KV is checked after every load and hit either way."""
    cfg = small_config(num_gpu_blocks=40, num_cpu_blocks=80, max_num_seqs=1, max_num_batched_tokens=256,
                       max_store_wait_steps=8 if wait else 0)
    prefix = list(range(100, 140))  # 10 full blocks
    with FakeEngine(cfg) as engine:
        engine.add_request("A", prefix + [1], 2)
        engine.run()
        engine.add_request("F", list(range(500, 640)), 2)  # 35 blocks: evicts A's prefix from the GPU
        engine.run()
        b = engine.add_request("B", prefix + [2, 3, 4, 5, 6, 7, 8, 9, 10], 2)
        c = engine.add_request("C", prefix + [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], 2)
        engine.run()
        assert engine.check() == 0 and engine.stats.integrity_errors == 0
        assert b.num_cpu_hit_tokens == 40
        if wait:
            assert (c.num_gpu_hit_tokens, c.num_cpu_hit_tokens) == (48, 0)
            assert engine.connector.stats.num_load_waits >= 1
        else:
            assert (c.num_gpu_hit_tokens, c.num_cpu_hit_tokens) == (0, 40)
        assert engine.connector.stats.num_loaded_blocks == (10 if wait else 20)


def test_with_several_kv_cache_groups_too():
    """A hybrid model (a full-attention and a sliding-window group): the same wait, on either group's copy."""
    from offload_connector.config import load_config
    from offload_connector.metadata import WorkerReport
    from scheduler_side import OffloadScheduler, StepRequest
    from scheduler_side.groups import KVGroup
    from scheduler_side.interfaces import BlockPoolGpuView
    from scheduler_side.pool.block_pool import BlockPool

    groups = (KVGroup(0), KVGroup(1, window=8))
    gpu = BlockPool(64)
    sched = OffloadScheduler(load_config({"num_cpu_blocks": 64}, num_kv_groups=2), BS, 64, BlockPoolGpuView(gpu),
                             groups=groups)
    a = FakeRequest("A", list(range(17)), BS)  # 4 full blocks
    assert sched.get_num_new_matched_tokens(a, 0) == (0, False)
    ids = [[b.block_id for b in gpu.allocate(5)] for _ in groups]
    sched.update_state_after_alloc(a, ids, 0)
    meta = sched.build_connector_meta([StepRequest("A", ids, 17, True)])
    sched.update_connector_output(WorkerReport(completed_store_events=[meta.store_event]))
    sched.request_finished(a)
    b, c = FakeRequest("B", list(range(17)), BS), FakeRequest("C", list(range(17)), BS)
    hit, is_async = sched.get_num_new_matched_tokens(b, 0)
    assert (hit, is_async) == (16, True)
    assert sched.get_num_new_matched_tokens(c, 0) == (None, False)  # B's pending hit pins the first block
    assert sched.stats.num_load_waits == 1
