"""Several KV-cache groups without vLLM: the window rule, the hybrid hit against a brute-force oracle, and
the set-ups the scheduler refuses. (vLLM's real Scheduler with a hybrid config: test_vllm_hybrid_scheduler.py.)"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from offload_connector.config import load_config
from offload_connector.metadata import WorkerReport
from scheduler_side import OffloadScheduler
from scheduler_side.groups import KVGroup, hybrid_hit_end
from scheduler_side.interfaces import BlockPoolGpuView
from scheduler_side.pool.block_pool import BlockPool

BS = 16


def test_first_needed_block_follows_vllms_skipped_tokens() -> None:
    # vLLM: skipped tokens = max(0, n - window + 1 - extra_retained); whole blocks below them are dropped.
    window = KVGroup(1, window=32)
    assert [window.first_needed_block(n, BS) for n in (0, 31, 32, 47, 48, 63, 64)] == [0, 0, 0, 1, 1, 2, 2]
    assert KVGroup(1, window=32, extra_retained=16).first_needed_block(64, BS) == 1
    assert KVGroup(0).first_needed_block(10_000, BS) == 0  # full attention needs every block


@pytest.mark.parametrize("kwargs", [{"group_id": -1}, {"window": 0}, {"extra_retained": -1}])
def test_bad_groups_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="KVGroup"):
        KVGroup(**{"group_id": 0} | kwargs)


def oracle(groups: list[KVGroup], found: list[list[bool]], first: int, end: int) -> int:
    """Every prefix length, longest first: the first one every group serves."""
    for e in range(end, first, -1):
        if all(all(found[g][i - first] for i in range(max(first, group.first_needed_block(e * BS, BS)), e))
               for g, group in enumerate(groups)):
            return e
    return first


@given(st.data())
def test_hybrid_hit_is_the_longest_prefix_every_group_serves(data: st.DataObject) -> None:
    first = data.draw(st.integers(0, 6))
    end = first + data.draw(st.integers(0, 12))
    windows = data.draw(st.lists(st.one_of(st.none(), st.integers(1, 80)), min_size=1, max_size=3))
    groups = [KVGroup(g, window=w) for g, w in enumerate(windows)]
    found = [data.draw(st.lists(st.booleans(), min_size=end - first, max_size=end - first)) for _ in groups]
    assert hybrid_hit_end(groups, found, first, end, BS) == oracle(groups, found, first, end)


def test_a_window_group_needs_only_its_window() -> None:
    groups = [KVGroup(0), KVGroup(1, window=32)]
    full = [True] * 6
    # The window group lacks blocks 0..2: a prefix of 6 blocks needs only its blocks 4 and 5 (from (96-31)//16).
    assert hybrid_hit_end(groups, [full, [False, False, False, True, True, True]], 0, 6, BS) == 6
    # Lacking block 4 instead: 6 blocks cannot be served, nor 5 (needs 3, 4); 4 can (needs 2, 3).
    assert hybrid_hit_end(groups, [full, [True, True, True, True, False, True]], 0, 6, BS) == 4
    # The full-attention group's run bounds all: its miss at block 2 caps the hit at 2.
    assert hybrid_hit_end(groups, [[True, True, False, True, True, True], [True] * 6], 0, 6, BS) == 2


@pytest.mark.parametrize(("extra", "match"), [({"store_policy": "lazy"}, "store_policy='lazy'.*allowed with "
                                                                          "several groups: eager")])
def test_the_scheduler_refuses_what_several_groups_do_not_support(extra: dict, match: str) -> None:
    gpu = BlockPoolGpuView(BlockPool(8))
    groups = (KVGroup(0), KVGroup(1, window=32))
    with pytest.raises(ValueError, match=match):
        OffloadScheduler(load_config({"num_cpu_blocks": 8, **extra}), BS, 8, gpu, groups=groups)
    sched = OffloadScheduler(load_config({"num_cpu_blocks": 8}, num_kv_groups=2), BS, 8, gpu, groups=groups)
    assert sched.groups == groups and sched.group_id == 0


def test_a_window_block_picked_late_is_stored_only_while_vllm_still_holds_it() -> None:
    """Hashes can lag the computed tokens (speculative decoding hashes a block once its drafts are
    accepted): a window block whose hash arrives after the window moved past it may already be dropped and
    reused by vLLM, so it is not stored; the full-attention group's copy still is."""
    from helpers import FakeRequest

    from scheduler_side import StepRequest

    bs, groups = 4, (KVGroup(0), KVGroup(1, window=8))
    gpu = BlockPool(64)
    sched = OffloadScheduler(load_config({"num_cpu_blocks": 64}, num_kv_groups=2), bs, 64,
                             BlockPoolGpuView(gpu), groups=groups)
    req = FakeRequest("r", list(range(36)), bs)
    hashes = req.block_hashes
    req.block_hashes = hashes[:2]  # the engine has hashed 2 of the 8 full blocks so far
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    ids = [[b.block_id for b in gpu.allocate(9)] for _ in groups]
    sched.update_state_after_alloc(req, ids, 0)
    meta = sched.build_connector_meta([StepRequest("r", ids, 32, True)])
    assert meta.store_gpu_blocks == ids[0][:2] + ids[1][:2]
    sched.update_connector_output(WorkerReport(completed_store_events=[meta.store_event]))
    req.block_hashes = hashes  # one decode step later every block has its hash
    meta = sched.build_connector_meta([StepRequest("r", ([], []), 33)])
    # Before this step 32 tokens were computed: the window then starts at block (32 - 7) // 4 = 6.
    assert meta.store_gpu_blocks == ids[0][2:8] + ids[1][6:8]
