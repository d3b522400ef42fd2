"""The eager store policy: every newly computed full block that has a hash and a GPU block is stored in
the step that computed it, once, under the scheduler's KV-cache group."""

from __future__ import annotations

from helpers import FakeRequest, admit, finish, make_scheduler, report, step_done

from offload_connector.config import load_config
from offload_connector.hashing import with_group_id
from scheduler_side import BlockPool, BlockPoolGpuView, OffloadScheduler

BS = 4


def sched_with_group(group: int, **overrides):
    gpu = BlockPool(64)
    config = load_config({"store_policy": "eager", "num_cpu_blocks": 16, **overrides})
    return OffloadScheduler(config, BS, 16, BlockPoolGpuView(gpu), group_id=group), gpu


def test_eager_stores_every_new_block_even_after_one_another_request_took():
    """Found by mutation testing of scheduler_side/policies/store_policy.py (docs/mutation.md)."""
    sched, gpu = make_scheduler(block_size=BS)
    a = FakeRequest("A", list(range(9)), BS)
    b = FakeRequest("B", list(range(4)) + list(range(50, 55)), BS)  # A's first block, then its own
    _, _, a_ids = admit(sched, gpu, a)
    _, _, b_ids = admit(sched, gpu, b)
    meta = sched.build_connector_meta([step_done("A", a_ids, 9), step_done("B", b_ids, 9)])
    assert meta.store_gpu_blocks == a_ids[:2] + [b_ids[1]]  # B's first block is A's: picked once


def test_eager_stores_only_blocks_it_has_both_a_hash_and_a_gpu_block_for():
    """Found by mutation testing of scheduler_side/policies/store_policy.py (docs/mutation.md)."""
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
    """Found by mutation testing of scheduler_side/policies/store_policy.py (docs/mutation.md)."""
    sched, gpu = sched_with_group(3)
    a = FakeRequest("A", list(range(9)), BS)
    _, _, ids = admit(sched, gpu, a)
    meta = sched.build_connector_meta([step_done("A", ids, 9)])
    sched.update_connector_output(report(completed_store_events=[meta.store_event]))
    assert sched.is_saved(with_group_id(a.block_hashes[0], 3)) and not sched.is_saved(with_group_id(a.block_hashes[0]))
    finish(sched, gpu, a, ids)
    assert sched.get_num_new_matched_tokens(FakeRequest("B", list(range(9)), BS), 0) == (8, True)
