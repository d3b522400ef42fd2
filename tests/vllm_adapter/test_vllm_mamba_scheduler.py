"""OffloadConnector in vLLM's real `Scheduler` with a Mamba hybrid's `KVCacheConfig` in align mode: group 0
full attention, group 1 a Mamba layer's state (one page per block of 16 tokens), one GPU block pool.

vLLM's own `MambaManager` lays out the state group's blocks: in a prefill step of several blocks only the
block of the step's last token holds a state (the others are the null block), and a request that loads
`e` blocks gets one state block, `e - 1`. Steps of 64 tokens (4 blocks) here, so states exist where the
steps end; the connector stores those, and a hit ends where the attention KV and a state are both on the
CPU tier. `Sim(mamba=True)` (vllm_sim_helpers.py) steps the scheduler in both of vLLM's modes;
`sched.reset_prefix_cache()` empties vLLM's GPU prefix cache (not ours).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from vllm_sim_helpers import MODES, Sim, tokens  # noqa: E402

from offload_connector.hashing import with_group_id  # noqa: E402

FULL, STATE = 0, 1  # group ids


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    return request.param


def stored_prefix(mode: str) -> tuple[Sim, list[int]]:
    """A ran a 96-token prefix + 4 tokens in steps of 64, 32 and 4 tokens; gone from the GPU cache since."""
    sim = Sim(mode=mode, num_gpu_blocks=40, mamba=True, max_num_batched_tokens=64)
    prefix = tokens(1, 96)
    sim.add("A", prefix + tokens(2, 4))
    sim.run_until_idle()
    assert sim.sched.reset_prefix_cache()
    return sim, prefix


def cached(sim: Sim, req_id: str, group: int) -> list[int]:
    pool = sim.connector.offload.cpu_pool
    return [i for i, h in enumerate(sim.reqs[req_id].block_hashes) if with_group_id(bytes(h), group) in pool.cached]


def load_keys(sim: Sim, req_id: str, blocks: dict[int, list[int]]) -> dict[int, bytes]:
    """What the load issued this step must hold: GPU block id -> cache key, for `blocks` (group -> block
    indexes) of request `req_id`'s block lists in vLLM."""
    lists = sim.sched.kv_cache_manager.get_blocks(req_id).blocks
    hashes = sim.reqs[req_id].block_hashes
    return {lists[g][i].block_id: with_group_id(bytes(hashes[i]), g) for g, idx in blocks.items() for i in idx}


def issued_load(sim: Sim, req_id: str) -> dict[int, bytes]:
    """Steps until the step that issues `req_id`'s load; that load: GPU block id -> the CPU block's key."""
    for _ in range(10):
        sim.step()
        if req_id in sim.loads[-1]:
            break
    else:
        raise AssertionError(f"no load for {req_id} within 10 steps")
    return sim.load_pairs()


def test_vllm_keeps_hma_on_with_a_state_group_in_align_mode() -> None:
    sim = Sim(num_gpu_blocks=40, mamba=True)
    assert [type(g.kv_cache_spec).__name__ for g in sim.kv_cache_config.kv_cache_groups] == ["FullAttentionSpec",
                                                                                             "MambaSpec"]
    assert sim.connector.config.store_policy == "eager"  # unset: eager for several groups
    assert [g.state for g in sim.connector.offload.groups] == [False, True]


def test_states_are_stored_where_steps_end_and_a_returning_prompt_loads_the_last(mode: str) -> None:
    sim, prefix = stored_prefix(mode)
    # 1. A's steps ended after 64 and 96 tokens: the states after blocks 3 and 5; every attention block.
    assert cached(sim, "A", FULL) == [0, 1, 2, 3, 4, 5] and cached(sim, "A", STATE) == [3, 5]
    # 2. B shares the 96 tokens: a CPU hit of 96, loading 6 attention blocks and the state after block 5.
    sim.add("B", prefix + tokens(3, 4))
    assert issued_load(sim, "B") == load_keys(sim, "B", {FULL: list(range(6)), STATE: [5]})
    sim.run_until_idle()
    assert sim.connector.offload.stats.num_hit_tokens == 96
    sim.assert_no_leaks()


def test_a_hit_stops_at_the_last_block_with_a_stored_state(mode: str) -> None:
    """C shares 80 tokens (5 blocks): the attention KV of all 5 is on the CPU tier, the state after 80
    tokens is not (no step of A ended there), so the hit is 64 tokens, with the state after block 3."""
    sim, prefix = stored_prefix(mode)
    sim.add("C", prefix[:80] + tokens(4, 20))
    assert issued_load(sim, "C") == load_keys(sim, "C", {FULL: list(range(4)), STATE: [3]})
    sim.run_until_idle()
    assert sim.connector.offload.stats.num_hit_tokens == 64
    sim.assert_no_leaks()
