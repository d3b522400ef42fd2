"""OffloadConnector in vLLM's real `Scheduler` with a hybrid `KVCacheConfig` (HMA on): group 0 full
attention, group 1 a sliding window of 32 tokens (2 blocks of 16), one GPU block pool shared by both.

`Sim(window=32)` (vllm_sim_helpers.py) steps the scheduler in both of vLLM's modes. The window rule under
test (scheduler_side/groups.py): a prefix of `e` blocks needs every full-attention block and, of the
sliding-window group, only blocks from `(16 * e - 31) // 16` on; vLLM passes the null block (0) for the
others, which are neither loaded nor stored. `sched.reset_prefix_cache()` empties vLLM's GPU prefix cache
(not ours), so the next request finds its prefix on the CPU tier only.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from vllm.v1.request import RequestStatus  # noqa: E402
from vllm_sim_helpers import MODES, Sim, tokens  # noqa: E402

from offload_connector.hashing import with_group_id  # noqa: E402

WINDOW = 32
FULL, SWA = 0, 1  # group ids


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    return request.param


def stored_prefix(mode: str, num_gpu_blocks: int = 24, **kwargs: object) -> tuple[Sim, list[int]]:
    """A ran a 48-token prefix + 16 tokens; its blocks are on the CPU tier and gone from the GPU cache."""
    sim = Sim(mode=mode, num_gpu_blocks=num_gpu_blocks, window=WINDOW, **kwargs)
    prefix = tokens(1, 48)
    sim.add("A", prefix + tokens(2, 16))
    sim.run_until_idle()
    assert sim.sched.reset_prefix_cache()
    return sim, prefix


def key(sim: Sim, req_id: str, block: int, group: int) -> bytes:
    return with_group_id(bytes(sim.reqs[req_id].block_hashes[block]), group)


def forget(sim: Sim, block: int, group: int) -> None:
    """The CPU tier loses its copy of A's block `block` in `group`."""
    pool = sim.connector.offload.cpu_pool
    pool.uncache(pool.cached[key(sim, "A", block, group)])


def test_vllm_keeps_hma_on_and_the_connector_sees_both_groups() -> None:
    sim = Sim(num_gpu_blocks=8, window=WINDOW)
    assert sim.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
    assert type(sim.sched.kv_cache_manager.coordinator).__name__ == "HybridKVCacheCoordinator"
    assert [(g.group_id, g.window) for g in sim.connector.offload.groups] == [(FULL, None), (SWA, WINDOW)]


def test_every_completed_block_of_both_groups_is_stored(mode: str) -> None:
    sim, prefix = stored_prefix(mode)
    offload = sim.connector.offload
    # A's 64 tokens are 4 full blocks; the one-step prefill holds all 4 blocks of the window group too.
    assert offload.stats.num_stored_blocks == 8
    hashes = [bytes(h) for h in sim.reqs["A"].block_hashes]
    for group in (FULL, SWA):
        assert all(with_group_id(h, group) in offload.cpu_pool.cached for h in hashes)
    sim.assert_no_leaks()


@pytest.mark.parametrize("eviction", ["lru", "arc"])
def test_cpu_hit_loads_full_blocks_and_only_the_window_blocks(mode: str, eviction: str) -> None:
    sim, prefix = stored_prefix(mode, eviction=eviction)
    offload = sim.connector.offload
    sim.add("B", prefix + tokens(4, 16))
    sim.step()
    assert sim.loads[-1] == ["B"]
    full, swa = sim.sched.kv_cache_manager.get_blocks("B").get_block_ids()
    # A 48-token prefix: the window group needs blocks (48 - 31) // 16 = 1 and 2; block 0 is the null block.
    assert swa[0] == 0 and 0 not in swa[1:3] and 0 not in full[:3]
    pairs = sim.load_pairs()
    expected = {full[i]: key(sim, "B", i, FULL) for i in range(3)} | {swa[i]: key(sim, "B", i, SWA) for i in (1, 2)}
    assert pairs == expected
    sim.run_until_idle()
    assert (offload.stats.num_hit_tokens, offload.stats.num_loaded_blocks) == (48, 5)
    assert sim.first_scheduled["B"] == 16  # only the 16 tokens the CPU tier did not have
    sim.assert_no_leaks()


def test_a_window_block_outside_the_window_is_not_needed(mode: str) -> None:
    """The window group's block 0 lies outside the window of a 48-token prefix: losing it costs nothing."""
    sim, prefix = stored_prefix(mode)
    offload = sim.connector.offload
    forget(sim, 0, SWA)
    sim.add("B", prefix + tokens(4, 16))
    sim.run_until_idle()
    assert (offload.stats.num_hit_tokens, offload.stats.num_loaded_blocks) == (48, 5)
    sim.assert_no_leaks()


def test_a_missing_window_block_shortens_the_hit_to_what_every_group_serves(mode: str) -> None:
    """Without the window group's block 2, a 48-token prefix is not servable; 32 tokens (window blocks 0
    and 1, full blocks 0 and 1) are: the hit is the longest prefix every group can serve."""
    sim, prefix = stored_prefix(mode)
    offload = sim.connector.offload
    forget(sim, 2, SWA)
    sim.add("B", prefix + tokens(4, 16))
    sim.step()
    full, swa = sim.sched.kv_cache_manager.get_blocks("B").get_block_ids()
    assert sim.load_pairs() == {full[0]: key(sim, "B", 0, FULL), full[1]: key(sim, "B", 1, FULL),
                               swa[0]: key(sim, "B", 0, SWA), swa[1]: key(sim, "B", 1, SWA)}
    sim.run_until_idle()
    assert (offload.stats.num_hit_tokens, offload.stats.num_loaded_blocks) == (32, 4)
    assert sim.first_scheduled["B"] == 32
    sim.assert_no_leaks()


def test_a_missing_full_attention_block_ends_the_hit(mode: str) -> None:
    sim, prefix = stored_prefix(mode)
    offload = sim.connector.offload
    forget(sim, 1, FULL)
    sim.add("B", prefix + tokens(4, 16))
    sim.run_until_idle()
    assert (offload.stats.num_hit_tokens, offload.stats.num_loaded_blocks) == (16, 2)  # block 0 of each group
    sim.assert_no_leaks()


def test_long_prompt_stores_only_blocks_vllm_still_holds_and_hits_past_the_window(mode: str) -> None:
    """A 160-token prompt in 64-token chunks: vLLM drops window blocks between chunks; every block of a
    chunk is stored while vLLM still holds it, so a re-run hits 144 tokens (the whole prompt but the
    block holding the last token) and loads only the window's 2 blocks of the window group."""
    sim = Sim(mode=mode, num_gpu_blocks=24, window=WINDOW)
    offload = sim.connector.offload
    prompt = tokens(5, 160)
    sim.add("A", prompt)
    sim.run_until_idle()
    assert offload.stats.num_stored_blocks == 20  # 10 blocks per group, each stored in the chunk computing it
    assert sim.sched.reset_prefix_cache()
    sim.add("B", prompt[:144] + tokens(6, 16))
    sim.run_until_idle()
    assert (offload.stats.num_hit_tokens, offload.stats.num_loaded_blocks) == (144, 9 + 2)
    sim.assert_no_leaks()


def test_hints_apply_to_every_groups_copy(mode: str) -> None:
    """The admission filter judges a block by group 0's key; what it decides holds for the block's copy in
    every group: `store: false` stores neither, closing a session demotes both."""
    sim = Sim(mode=mode, num_gpu_blocks=24, window=WINDOW)
    offload = sim.connector.offload
    sim.add("A", tokens(1, 64), hints={"store": False})
    sim.run_until_idle()
    assert offload.stats.num_stored_blocks == 0
    sim.add("S", tokens(2, 64), hints={"session": "s"})
    sim.run_until_idle()
    assert offload.stats.num_stored_blocks == 8
    assert offload.close_session("s") == 8  # 4 blocks in each of the 2 groups
    sim.assert_no_leaks()


def test_abort_while_loading_frees_every_group(mode: str) -> None:
    sim, prefix = stored_prefix(mode)
    sim.hold_loads = True
    sim.add("B", prefix + tokens(4, 16))
    sim.step()
    assert sim.loads[-1] == ["B"]
    loading = set(sim.last_meta.transfer.load_gpu_blocks)
    assert len(loading) == 5  # 3 full-attention blocks and the window group's 2
    sim.sched.finish_requests("B", RequestStatus.FINISHED_ABORTED)
    pool = sim.sched.kv_cache_manager.block_pool
    for _ in range(3):
        sim.step()
        assert all(pool.blocks[i].ref_cnt > 0 for i in loading)  # still loading: held in both groups
    assert sim.connector.offload.transfers.requests["B"].load.holds_gpu
    sim.hold_loads = False
    sim.run_until_idle()
    sim.assert_no_leaks()


def test_preemption_and_resume_in_both_groups(mode: str) -> None:
    sim = Sim(mode=mode, num_gpu_blocks=14, max_num_batched_tokens=128, window=WINDOW)
    sim.add("P1", tokens(8, 40), max_tokens=60)
    sim.add("P2", tokens(9, 40), max_tokens=60)
    sim.run_until_idle(max_steps=600)
    assert sim.preempted
    offload = sim.connector.offload
    assert offload.stats.num_stored_blocks > 0
    sim.assert_no_leaks()
