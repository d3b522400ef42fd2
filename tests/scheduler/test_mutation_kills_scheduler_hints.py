"""Hint validation messages, the admission filter fed at allocation and at finish with `store: false`,
dropped CPU copies of superseded blocks in any KV group, and the scheduler's own invariant checks:
behaviours the mutation run found no test for (docs/mutation.md)."""

from __future__ import annotations

import pytest
from helpers import FakeRequest, admit, finish, make_scheduler, report, step_done, store_and_finish
from test_mutation_kills_scheduler_completions import generate

from offload_connector.config import load_config
from offload_connector.hashing import with_group_id
from scheduler_side import BlockPool, BlockPoolGpuView, OffloadScheduler
from scheduler_side.admission.hints import MAX_SESSION_CHARS, parse_hints
from scheduler_side.errors import SchedulerError

BS = 4


def test_bad_hints_are_named_in_the_message() -> None:
    assert "got list" in parse_hints([1])[1]
    long = "s" * (MAX_SESSION_CHARS + 1)
    assert repr(long[:40]) in parse_hints({"session": long})[1]
    assert parse_hints({"close_session": True})[1].startswith("kv_transfer_params 'close_session'")


def test_a_session_id_of_the_maximum_length_is_valid() -> None:
    hints, problem = parse_hints({"session": "s" * MAX_SESSION_CHARS})
    assert problem is None and hints.session == "s" * MAX_SESSION_CHARS


def test_load_mapping_errors_name_the_request_and_whole_blocks() -> None:
    sched, gpu = make_scheduler(block_size=BS)
    store_and_finish(sched, gpu, FakeRequest("A", list(range(9)), BS))
    b = FakeRequest("req-b", list(range(9)) + [7, 7, 7, 7], BS)
    assert sched.get_num_new_matched_tokens(b, 0) == (2 * BS, True)
    with pytest.raises(SchedulerError, match=r"req-b: 1 GPU blocks cannot hold a load of 2 blocks after 0 GPU"):
        sched.update_state_after_alloc(b, [5], 2 * BS)


def test_a_load_queued_twice_is_refused() -> None:
    """Our invariant: a load job is handed to the workers once."""
    sched, gpu = make_scheduler(block_size=BS)
    store_and_finish(sched, gpu, FakeRequest("A", list(range(9)), BS))
    b = FakeRequest("B", list(range(9)), BS)
    admit(sched, gpu, b)
    state = sched.transfers.requests["B"]
    sched.build_connector_meta([])
    sched.transfers.loads_to_send.append(state)
    with pytest.raises(SchedulerError, match="without a fresh job"):
        sched.build_connector_meta([])


def hinted(req: FakeRequest, **hints) -> FakeRequest:
    req.kv_transfer_params = hints
    return req


def test_store_false_output_is_born_dead_at_finish() -> None:
    sched, gpu = make_scheduler(block_size=BS)
    a = hinted(FakeRequest("A", list(range(12)), BS), store=False)
    _, _, ids = admit(sched, gpu, a)
    generate(a, [90, 91, 92, 93])
    finish(sched, gpu, a, ids)
    assert sched.admission.is_dead(with_group_id(a.block_hashes[3]))


def test_a_gpu_hit_revives_a_dead_block_even_with_store_false() -> None:
    """A block is live again when a request reuses it, whatever that request's own `store` hint."""
    sched, gpu = make_scheduler(block_size=BS)
    a = hinted(FakeRequest("A", list(range(9)), BS), store=False)
    _, _, a_ids = admit(sched, gpu, a)
    finish(sched, gpu, a, a_ids)
    key = with_group_id(a.block_hashes[0])
    assert sched.admission.is_dead(key)
    b = hinted(FakeRequest("B", list(range(9)) + [5, 5, 5, 5], BS), store=False)
    admit(sched, gpu, b, gpu_hit_tokens=BS)  # block 0 comes from the engine's GPU cache
    assert not sched.admission.is_dead(key)


@pytest.mark.parametrize("group_id", [0, 1])
def test_a_superseded_block_loses_its_cpu_copy_once(group_id: int) -> None:
    config = load_config({"store_policy": "eager", "num_cpu_blocks": 50, "branch_filter": True})
    gpu = BlockPool(100)
    sched = OffloadScheduler(config, BS, 50, BlockPoolGpuView(gpu), 1, group_id=group_id)
    a = FakeRequest("A", list(range(13)), BS)
    _, _, a_ids = admit(sched, gpu, a)
    meta = sched.build_connector_meta([step_done("A", a_ids, 13)])
    sched.update_connector_output(report(completed_store_events=[meta.store_event]))
    finish(sched, gpu, a, a_ids)
    x = with_group_id(a.block_hashes[2], group_id)
    assert sched.cpu_pool.lookup(x) is not None
    b = FakeRequest("B", list(range(8)) + [50, 51, 52, 53, 54], BS)  # supersedes A's third block
    admit(sched, gpu, b, gpu_hit_tokens=0)
    assert sched.cpu_pool.lookup(x) is None and sched.stats.num_dropped_blocks == 1


def test_store_false_revives_the_dead_blocks_it_hits_on_the_gpu_and_on_the_cpu() -> None:
    """A `store: false` request that hits dead blocks on both tiers (the GPU's first, then a CPU hit of
    n blocks) makes every hit block live: "new" starts after the GPU hit *plus* the CPU hit."""
    sched, gpu = make_scheduler(block_size=BS)
    a = hinted(FakeRequest("A", list(range(13)), BS), session="s")
    store_and_finish(sched, gpu, a)
    assert sched.close_session("s") == 3  # A's three full blocks die, their CPU copies demoted (still cached)
    keys = [with_group_id(h) for h in a.block_hashes[:3]]
    assert all(sched.admission.is_dead(k) for k in keys)
    b = hinted(FakeRequest("B", list(range(13)) + [5, 5, 5], BS), store=False)
    hit, _, _ = admit(sched, gpu, b, gpu_hit_tokens=BS)  # block 0 from the GPU, blocks 1-2 from the CPU
    assert hit == 2 * BS
    assert not any(sched.admission.is_dead(k) for k in keys)
