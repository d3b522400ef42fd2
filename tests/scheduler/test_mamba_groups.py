"""Mamba/SSM state groups (vLLM's `mamba_cache_mode="align"`) without vLLM: the state rule, the hybrid hit
with state groups against a brute-force oracle, and request stories over block lists laid out the way
vLLM 0.32's `MambaManager` lays them out. (vLLM's real engine: tests/vllm_adapter/test_vllm_mamba_e2e.py.)

Align mode, per Mamba group: a step computing tokens up to `n` holds the running state in block
`(n - 1) // block_size`, a new block; the blocks before it are the null block (0), except, in a step of
several blocks, a scratch block vLLM may keep for a prefill checkpoint just before it. A request that
loads `e` blocks gets the null block for blocks `0 .. e - 2` and one block, `e - 1`, for the state.
"""

from __future__ import annotations

import pytest
from helpers import FakeRequest, assert_idle, finish, report, step_done
from hypothesis import given
from hypothesis import strategies as st

from offload_connector.config import load_config
from offload_connector.hashing import with_group_id
from scheduler_side import OffloadScheduler
from scheduler_side.groups import KVGroup, hybrid_hit_end
from scheduler_side.interfaces import BlockPoolGpuView
from scheduler_side.pool.block_pool import BlockPool

BS = 4
STATE = KVGroup(0, state=True)
GROUPS = (KVGroup(0, state=True), KVGroup(1, state=True), KVGroup(2))  # vLLM's order: Mamba, Mamba, attention
ATTENTION = 2


def test_a_state_group_needs_the_block_ending_at_the_prefix() -> None:
    # vLLM: skipped tokens = n - 1, so a prefix of n tokens needs block (n - 1) // block_size alone.
    assert [STATE.first_needed_block(n, BS) for n in (0, 1, 4, 5, 8, 9)] == [0, 0, 0, 1, 1, 2]
    assert not STATE.needs_every_block and KVGroup(1).needs_every_block
    assert not KVGroup(1, window=8).needs_every_block


def test_a_state_block_is_stored_only_from_a_step_that_ended_on_its_boundary() -> None:
    assert STATE.stores_block(1, 8, BS) and not STATE.stores_block(0, 8, BS)  # block 0 is scratch or null
    assert not STATE.stores_block(1, 9, BS)  # the step ended in block 2: block 1's page is not a boundary's
    assert KVGroup(1).stores_block(0, 9, BS)  # attention keeps every token's KV


def test_a_state_group_with_a_window_is_refused() -> None:
    with pytest.raises(ValueError, match="state group without window"):
        KVGroup(0, window=8, state=True)


def oracle(groups: list[KVGroup], found: list[list[bool]], first: int, end: int) -> int:
    """Every prefix length, longest first: the first where each attention group has all its blocks and each
    state group the block ending there."""
    for e in range(end, first, -1):
        if all(found[g][e - 1 - first] if group.state else all(found[g][i - first] for i in range(first, e))
               for g, group in enumerate(groups)):
            return e
    return first


@given(st.data())
def test_the_hit_ends_where_the_attention_kv_and_every_state_are_on_the_cpu(data: st.DataObject) -> None:
    first = data.draw(st.integers(0, 6))
    end = first + data.draw(st.integers(0, 12))
    groups = [KVGroup(g, state=s) for g, s in enumerate(data.draw(st.lists(st.booleans(), min_size=1,
                                                                          max_size=3)))]
    found = [data.draw(st.lists(st.booleans(), min_size=end - first, max_size=end - first)) for _ in groups]
    assert hybrid_hit_end(groups, found, first, end, BS) == oracle(groups, found, first, end)


def make() -> tuple[OffloadScheduler, BlockPool]:
    gpu = BlockPool(64)
    sched = OffloadScheduler(load_config({"num_cpu_blocks": 40}, num_kv_groups=len(GROUPS)), BS, 40,
                             BlockPoolGpuView(gpu), groups=GROUPS)
    return sched, gpu


def prefill(sched: OffloadScheduler, gpu: BlockPool, req: FakeRequest, chunk_blocks: int) -> list[list[int]]:
    """vLLM computing `req`'s prompt in steps of `chunk_blocks` blocks (the last step to the prompt's end),
    each step's stores completing at once, the finished request's blocks then freed. Returns what the
    request's block lists were (the GPU ids of each group, 0 for the null block)."""
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    lists: list[list[int]] = [[] for _ in GROUPS]
    held: list[int] = []  # every block vLLM allocated to the request (freed at the end)
    sched.update_state_after_alloc(req, lists, 0)
    done = 0
    while done < req.num_tokens:
        after = min(done + chunk_blocks * BS, req.num_tokens)
        new: list[list[int]] = []
        last = (after - 1) // BS
        for group, ids in zip(GROUPS, lists, strict=True):
            if group.state:  # nulls, a scratch checkpoint block in a step of several blocks, the running state
                scratch = last - 1 if after - done > BS and last - 1 >= len(ids) else None
                add = [0] * (last - len(ids))
                if scratch is not None:
                    add[scratch - len(ids)] = gpu.allocate(1)[0].block_id
                add.append(gpu.allocate(1)[0].block_id)
            else:
                add = [b.block_id for b in gpu.allocate(last + 1 - len(ids))]
            held += [i for i in add if i]
            ids.extend(add)
            new.append(add)
        meta = sched.build_connector_meta([step_done(req.request_id, new, after, replace=done == 0)])
        if meta.store_event is not None:
            sched.update_connector_output(report(completed_store_events=[meta.store_event]))
        done = after
    finish(sched, gpu, req, held)
    return lists


def cached(sched: OffloadScheduler, req: FakeRequest, group: int) -> list[int]:
    """The blocks of `req` whose copy in `group` is on the CPU tier."""
    return [i for i, h in enumerate(req.block_hashes) if with_group_id(h, group) in sched.cpu_pool.cached]


def returning(sched: OffloadScheduler, gpu: BlockPool, req: FakeRequest):
    """A request sharing a stored prefix: its lookup, then vLLM's align-mode allocation for the hit (the
    null block before the state block in each Mamba group) and the load it makes."""
    hit, is_async = sched.get_num_new_matched_tokens(req, 0)
    n = hit // BS
    lists = [[0] * (n - 1) + [gpu.allocate(1)[0].block_id] if g.state else [b.block_id for b in gpu.allocate(n)]
             for g in GROUPS]
    sched.update_state_after_alloc(req, lists, hit)
    meta = sched.build_connector_meta([])
    keys = [sched.cpu_pool.blocks[c].block_hash for c in meta.load_cpu_blocks]
    return hit, is_async, lists, meta, keys


def test_one_block_per_step_stores_a_state_per_block_and_a_returning_prompt_loads_the_last() -> None:
    sched, gpu = make()
    a = FakeRequest("A", list(range(21)), BS)  # 5 full blocks and a partial one
    # 1-6. A's prompt one block per step: every step ends on a boundary, so each group stores every full block.
    prefill(sched, gpu, a, chunk_blocks=1)
    assert [cached(sched, a, g) for g in range(3)] == [[0, 1, 2, 3, 4]] * 3
    # 7. B shares A's 5 full blocks: a CPU hit of 20 tokens (21st token computed).
    b = FakeRequest("B", list(range(20)) + [99, 98, 97], BS)
    hit, is_async, lists, meta, keys = returning(sched, gpu, b)
    assert (hit, is_async) == (20, True)
    # 8. The load: of each Mamba group only the state after 20 tokens (block 4), and all 5 attention blocks.
    h = b.block_hashes
    assert meta.load_gpu_blocks == [lists[0][4], lists[1][4], *lists[ATTENTION]]
    assert keys == [with_group_id(h[4], 0), with_group_id(h[4], 1)] + [with_group_id(h[i], 2) for i in range(5)]
    # 9. The load completes; B computes its last token (nothing completes a block); B finishes.
    sched.update_connector_output(report(finished_load_reqs=["B"]))
    new = [[gpu.allocate(1)[0].block_id] for _ in GROUPS]  # block 5 of each group
    meta = sched.build_connector_meta([step_done("B", new, 23, False)])
    assert meta.store_event is None
    finish(sched, gpu, b, [i for ids in lists + new for i in ids if i])
    assert sched.stats.num_loaded_blocks == 7
    assert_idle(sched, gpu)


def test_a_hit_stops_at_the_last_block_whose_state_was_stored() -> None:
    """Steps of 2 blocks end on blocks 1 and 3, then at the prompt's end inside block 5: only blocks 1 and 3
    have a boundary's state (vLLM's scratch checkpoint blocks 0 and 2 are never stored). The attention KV
    of all 5 full blocks is on the CPU tier, yet the hit is 4 blocks: the state after 20 tokens is not."""
    sched, gpu = make()
    a = FakeRequest("A", list(range(21)), BS)
    lists = prefill(sched, gpu, a, chunk_blocks=2)
    assert lists[0][0] != 0 and lists[0][2] != 0  # the scratch blocks were real blocks, not the null block
    assert cached(sched, a, 0) == cached(sched, a, 1) == [1, 3]
    assert cached(sched, a, ATTENTION) == [0, 1, 2, 3, 4]
    b = FakeRequest("B", list(range(20)) + [99, 98, 97], BS)
    hit, _, lists, meta, keys = returning(sched, gpu, b)
    assert hit == 16
    assert keys[:2] == [with_group_id(b.block_hashes[3], 0), with_group_id(b.block_hashes[3], 1)]
    assert meta.load_gpu_blocks == [lists[0][3], lists[1][3], *lists[ATTENTION]]
    sched.update_connector_output(report(finished_load_reqs=["B"]))
    finish(sched, gpu, b, [i for ids in lists for i in ids if i])
    assert_idle(sched, gpu)


def test_a_state_missing_in_one_group_shortens_the_hit_for_all() -> None:
    sched, gpu = make()
    a = FakeRequest("A", list(range(21)), BS)
    prefill(sched, gpu, a, chunk_blocks=1)
    sched.cpu_pool.uncache(sched.cpu_pool.cached[with_group_id(a.block_hashes[4], 1)])
    sched.cpu_pool.uncache(sched.cpu_pool.cached[with_group_id(a.block_hashes[3], 0)])
    b = FakeRequest("B", list(range(20)) + [99, 98, 97], BS)
    # Block 4 lacks group 1's state, block 3 group 0's: the longest prefix with every state is 3 blocks.
    hit, _, lists, meta, _ = returning(sched, gpu, b)
    assert hit == 12 and len(meta.load_gpu_blocks) == 2 + 3
    sched.update_connector_output(report(finished_load_reqs=["B"]))
    finish(sched, gpu, b, [i for ids in lists for i in ids if i])
    assert_idle(sched, gpu)
