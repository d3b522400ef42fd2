"""OffloadConnector inside vLLM's real `Scheduler`, stepped with fake model-runner outputs, in both of
vLLM's modes: synchronous, and `AsyncScheduler` with two batches in flight (`defer_block_free` on).

`Sim` (vllm_sim_helpers.py) drives the scheduler as vLLM's engine core does and plays the model runner
and our worker role. Every scenario runs in both modes; where a figure differs in async mode (steps from
admission to first compute), the test asserts the async figure and says why.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402
from vllm_sim_helpers import BS, MODES, RESUME_STEPS, Sim, tokens  # noqa: E402


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.mark.parametrize(("policy", "eviction"), [("eager", "lru"), ("lazy", "lru"), ("lazy", "arc")])
def test_cpu_hit_loads_then_computes_only_uncached_tokens(policy: str, eviction: str, mode: str) -> None:
    # 5 usable GPU blocks: one 64-token request fills them
    sim = Sim(mode=mode, num_gpu_blocks=6, store_policy=policy, eviction=eviction)
    prefix = tokens(1, 48)
    # 1. A runs; its full blocks are stored to the CPU tier (eager: as they are computed; lazy: when it
    #    finishes, since the nearly full GPU pool would evict them at the next allocation).
    sim.add("A", prefix + tokens(2, 16))
    sim.run_until_idle()
    assert sim.connector.offload.stats.num_stored_blocks >= 4
    # 2. C, with unrelated tokens, needs every GPU block: A's cached blocks are evicted from the GPU.
    sim.add("C", tokens(3, 64))
    sim.run_until_idle()
    # 3. B shares A's first 3 blocks: no GPU hit, a CPU hit of 48 tokens; it waits for its load.
    sim.add("B", prefix + tokens(4, 16))
    admitted = sim.step_no + 1
    assert sim.step() == {}
    assert sim.loads[-1] == ["B"] and sim.step_no == admitted
    assert sim.sched.requests["B"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    # 4. The load completes within the admission step. Sync: that step's output (B's finished_recving)
    #    is processed before the next schedule(), so B computes in the very next step. Async: the next
    #    step is scheduled before that output is processed, so B waits one more step (RESUME_STEPS).
    #    Either way B computes only the 16 tokens that were not on the CPU.
    steps = sim.steps_until_scheduled("B")
    assert sim.scheduled[-1] == {"B": 16}
    assert steps == sim.step_no - admitted == RESUME_STEPS[mode]  # steps from admission to first compute
    assert sim.scheduled[admitted:-1] == [{}] * (steps - 1)  # nothing else ran meanwhile
    assert sim.connector.offload.stats.num_hit_tokens == 48
    assert sim.connector.offload.stats.num_loaded_blocks == 3
    # 5. Everything finishes and nothing stays referenced.
    sim.run_until_idle()
    sim.assert_no_leaks()


def test_gpu_hit_is_not_loaded_again(mode: str) -> None:
    sim = Sim(mode=mode, num_gpu_blocks=32)
    prefix = tokens(5, 48)
    sim.add("A", prefix + tokens(6, 16))
    sim.run_until_idle()
    # 1. A's blocks are still cached on the GPU: B takes them from there, nothing is loaded.
    sim.add("B", prefix + tokens(7, 16))
    assert sim.step() == {"B": 16}
    assert all(not loads for loads in sim.loads)
    sim.run_until_idle()
    sim.assert_no_leaks()


def test_preemption_and_resume(mode: str) -> None:
    sim = Sim(mode=mode, num_gpu_blocks=7, max_num_batched_tokens=128)  # 6 usable blocks; two requests want 8
    sim.add("P1", tokens(8, 40), max_tokens=30)
    sim.add("P2", tokens(9, 40), max_tokens=30)
    sim.run_until_idle(max_steps=400)
    # 1. The GPU pool ran out during decode: vLLM preempted a request, which resumed and finished.
    assert sim.preempted
    # 2. Both requests produced all their tokens; no block is left referenced.
    sim.assert_no_leaks()
    assert sim.connector.offload.stats.num_stored_blocks > 0


def test_abort_while_waiting_for_load(mode: str) -> None:
    sim = Sim(mode=mode, num_gpu_blocks=6)
    prefix = tokens(10, 48)
    sim.add("A", prefix + tokens(11, 16))
    sim.run_until_idle()
    sim.add("C", tokens(12, 64))
    sim.run_until_idle()
    # 1. B gets a CPU hit; its load is slow (not reported yet).
    sim.hold_loads = True
    sim.add("B", prefix + tokens(13, 16))
    sim.step()
    assert sim.loads[-1] == ["B"]
    load_gpu_blocks = sim.connector.offload.transfers.requests["B"].load.gpu_block_ids
    # 2. The client aborts B while its load is in flight: the target GPU blocks stay referenced.
    sim.sched.finish_requests("B", RequestStatus.FINISHED_ABORTED)
    sim.step()
    pool = sim.sched.kv_cache_manager.block_pool
    assert all(pool.blocks[i].ref_cnt > 0 for i in load_gpu_blocks)
    # 3. The load completes; vLLM and the connector release everything.
    sim.hold_loads = False
    sim.run_until_idle()
    sim.assert_no_leaks()


def test_cpu_pool_full_skips_stores_without_failing(mode: str) -> None:
    sim = Sim(mode=mode, num_gpu_blocks=32, num_cpu_blocks=3)  # room for 2 blocks only
    sim.add("A", tokens(14, 96))
    sim.run_until_idle()
    stats = sim.connector.offload.stats
    assert stats.num_stored_blocks + stats.num_store_skipped_blocks >= 6
    sim.assert_no_leaks()


def test_stats_and_kv_events_reach_vllm(mode: str) -> None:
    sim = Sim(mode=mode, num_gpu_blocks=6, kv_events=True)
    prefix = tokens(15, 48)
    a = sim.add("A", prefix + tokens(16, 16))
    sim.run_until_idle()
    sim.add("C", tokens(17, 64))
    sim.run_until_idle()
    sim.add("B", prefix + tokens(18, 16))
    sim.run_until_idle()
    # 1. The per-step deltas vLLM collected add up to the scheduler side's running counters.
    counters = sim.connector.offload.stats
    summary = sim.stats.reduce()
    assert summary["num_stored_blocks"] == counters.num_stored_blocks > 0
    assert summary["num_loaded_blocks"] == counters.num_loaded_blocks == 3
    assert summary["num_hit_tokens"] == 48
    assert 0 < summary["cpu_hit_rate"] <= 1
    assert summary["cpu_capacity_blocks"] == 31
    # 2. Stored blocks were published as BlockStored events with medium CPU.
    stored = [e for e in sim.kv_events if type(e).__name__ == "BlockStored"]
    assert len(stored) == counters.num_stored_blocks
    assert all(e.medium == "CPU" and e.block_size == BS for e in stored)
    # Same hash form as vLLM's own GPU events, so a router can match the tiers.
    assert {maybe_convert_block_hash(h) for h in a.block_hashes} <= {e.block_hashes[0] for e in stored}
    sim.assert_no_leaks()


def test_cpu_eviction_publishes_block_removed(mode: str) -> None:
    sim = Sim(mode=mode, num_gpu_blocks=32, num_cpu_blocks=4, kv_events=True)  # 3 usable CPU blocks
    sim.add("A", tokens(19, 64))
    sim.run_until_idle()
    sim.add("B", tokens(20, 64))
    sim.run_until_idle()
    removed = [e for e in sim.kv_events if type(e).__name__ == "BlockRemoved"]
    assert removed and all(e.medium == "CPU" for e in removed)
    assert sim.stats.reduce()["num_cpu_evictions"] == len(removed)
    sim.assert_no_leaks()


def test_the_capacity_reaches_vllm_before_any_request(mode: str) -> None:
    """Issue 41: the capacity gauges read 0 until the first request, as an idle engine never stepped. The
    connector asks vLLM for one step at start-up (`has_pending_push_work`), whose stats carry them."""
    sim = Sim(mode=mode, num_gpu_blocks=6)
    # 1. A fresh engine with no request: the connector asks for a step.
    assert sim.sched.has_requests()
    sim.run_until_idle()
    # 2. That step's stats report carries the gauges, with no counter; then the engine is idle.
    gauges = sim.stats.reduce()
    assert gauges["cpu_capacity_blocks"] == 31 and gauges["cpu_capacity_bytes"] == 31 * sim.connector.shape.bytes_per_block
    assert gauges["cpu_blocks_cached"] == 0 and not sim.stats.counters
    assert not sim.sched.has_requests() and sim.step_no == 1
    sim.assert_no_leaks()


def test_metrics_off_asks_for_no_step_at_start_up() -> None:
    sim = Sim(num_gpu_blocks=6, metrics=False)
    assert not sim.sched.has_requests()


def test_stats_reach_vllm_every_n_steps_and_when_quiet() -> None:
    """The tracker reports at the first step (so the capacity gauges are set from then, counters or not),
    then deltas every `every` steps (sums unchanged) and at once on `flush`."""
    from offload_connector.vllm.stats import COUNTERS, StatsTracker

    tracker, total = StatsTracker(every=4), [0] * len(COUNTERS)
    assert COUNTERS[0] == "num_lookups"

    def values() -> tuple[int, ...]:
        return tuple(total)

    first = tracker.take(values, lambda: {"cpu_capacity_blocks": 31})
    assert first is not None and first.counters == {} and first.gauges == {"cpu_capacity_blocks": 31}
    gauges = dict  # no gauges: only the counters matter from here
    reports = []
    for _ in range(10):
        total[0] += 1
        reports.append(tracker.take(values, gauges))
    assert [r is not None for r in reports] == [False, False, False, True] * 2 + [False, False]
    assert sum(r.counters["num_lookups"] for r in reports if r) == 8  # two steps not reported yet
    total[0] += 1
    flushed = tracker.take(values, gauges, flush=True)
    assert flushed is not None and flushed.counters["num_lookups"] == 3  # the rest, at once
    assert tracker.take(values, gauges, flush=True) is None  # nothing changed since
    with pytest.raises(ValueError, match="every"):
        StatsTracker(every=0)


def test_remote_tier_blocks_become_block_stored_events_with_medium_remote() -> None:
    """The remote tier's blocks (every rank's copy on the server) reach vLLM as BlockStored, medium REMOTE,
    in the same hash form and group split as the CPU tier's."""
    from offload_connector.hashing import with_group_id
    from offload_connector.vllm.messages import to_vllm_events
    from scheduler_side import KVEvent

    block_hash = bytes(range(16))
    [event] = to_vllm_events([KVEvent("stored", with_group_id(block_hash, 1), "REMOTE")], BS)
    assert type(event).__name__ == "BlockStored" and event.medium == "REMOTE"
    assert event.block_hashes == [maybe_convert_block_hash(block_hash)] and event.group_idx == 1


@pytest.mark.parametrize("max_num_seqs", [1, 4])
def test_a_request_waits_for_anothers_load_of_its_prefix_then_hits_it_on_the_gpu(mode: str,
                                                                                  max_num_seqs: int) -> None:
    """B's CPU hit is being loaded when D, with the same prefix and more, is looked up: vLLM's scheduler
    looks D up meanwhile (a request waiting for its load does not count as running). D waits for that load
    (`num_load_waits`) instead of loading the prefix a second time, then vLLM's own prefix cache hits it."""
    sim = Sim(mode=mode, num_gpu_blocks=12, max_num_seqs=max_num_seqs)
    prefix = tokens(1, 48)
    sim.add("A", prefix + tokens(2, 16))
    sim.run_until_idle()
    sim.add("C", tokens(3, 176))  # 11 blocks: evicts A's cached blocks from the GPU
    sim.run_until_idle()
    sim.add("B", prefix + tokens(4, 16))
    sim.add("D", prefix + tokens(4, 16) + tokens(5, 16))
    start = len(sim.scheduled)
    sim.run_until_idle()
    stats = sim.connector.offload.stats
    assert stats.num_loaded_blocks == 3  # the prefix, once (for B)
    assert stats.num_load_waits >= 1 and stats.num_hit_tokens == 48
    first_d = next(step["D"] for step in sim.scheduled[start:] if "D" in step)
    assert first_d <= 32  # D computed at most its own 2 blocks: the prefix was a GPU hit
    sim.assert_no_leaks()
