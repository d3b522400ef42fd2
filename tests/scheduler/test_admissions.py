"""The scheduler's admissions (scheduler_side/admissions.py) feeding the admission filter, on the scheduler
alone: which keys a request's admission, GPU and CPU hits and finish make live or dead (with `store: false`
and the branch filter), and a superseded block's CPU copy dropped once, in any KV-cache group. (Through
the fake engine: test_session_hints.py.)"""

from __future__ import annotations

import pytest
from helpers import FakeRequest, admit, finish, generate, make_scheduler, report, step_done, store_and_finish

from offload_connector.config import load_config
from offload_connector.hashing import with_group_id
from scheduler_side import BlockPool, BlockPoolGpuView, OffloadScheduler

BS = 4


def hinted(req: FakeRequest, **hints) -> FakeRequest:
    req.kv_transfer_params = hints
    return req


def test_a_finishing_request_s_output_supersedes_nothing() -> None:
    """With the branch filter, a request's output joins the tree at its finish without superseding: two
    answers to the same prompt are siblings, the first one's blocks stay live.

    Found by mutation testing of scheduler_side/admissions.py (docs/mutation.md)."""
    sched, gpu = make_scheduler(block_size=BS, branch_filter=True)
    prompt = list(range(8))
    a = FakeRequest("A", list(prompt), BS)
    _, _, a_ids = admit(sched, gpu, a)
    generate(a, [100, 101, 102, 103])
    finish(sched, gpu, a, a_ids)
    b = FakeRequest("B", list(prompt), BS)
    _, _, b_ids = admit(sched, gpu, b)
    generate(b, [200, 201, 202, 203])
    finish(sched, gpu, b, b_ids)
    first_answer = with_group_id(a.block_hashes[2])
    assert first_answer in sched.admission._nodes and not sched.admission.is_dead(first_answer)


def superseded(sched, gpu):
    """A uses P0 P1 X; B then uses P0 P1 Y: B's new branch supersedes X. Returns A, A's ids, X's key."""
    a = FakeRequest("A", list(range(12)), BS)
    _, _, a_ids = admit(sched, gpu, a)
    b = FakeRequest("B", list(range(8)) + [50, 51, 52, 53], BS)
    admit(sched, gpu, b)
    x = with_group_id(a.block_hashes[2])
    assert sched.admission.is_dead(x)
    return a, a_ids, x


def test_a_request_admitted_again_revives_its_superseded_blocks() -> None:
    """Preempted and admitted again, a request uses all its blocks again: a dead one is live again.

    Found by mutation testing of scheduler_side/admissions.py (docs/mutation.md)."""
    sched, gpu = make_scheduler(block_size=BS, branch_filter=True)
    a, a_ids, x = superseded(sched, gpu)
    sched.request_preempted("A")
    gpu.free([gpu.blocks[i] for i in reversed(a_ids)])
    admit(sched, gpu, a)
    assert not sched.admission.is_dead(x)


def test_a_finishing_request_adds_its_output_and_revives_nothing() -> None:
    """At its finish only the blocks a request completed since admission join the tree: a prompt block
    superseded while it ran stays dead.

    Found by mutation testing of scheduler_side/admissions.py (docs/mutation.md)."""
    sched, gpu = make_scheduler(block_size=BS, branch_filter=True)
    a, a_ids, x = superseded(sched, gpu)
    generate(a, [60, 61, 62, 63])
    finish(sched, gpu, a, a_ids)
    assert sched.admission.is_dead(x) and with_group_id(a.block_hashes[3]) in sched.admission._nodes


def test_store_false_output_is_born_dead_at_finish() -> None:
    """Found by mutation testing of scheduler_side/admissions.py (docs/mutation.md)."""
    sched, gpu = make_scheduler(block_size=BS)
    a = hinted(FakeRequest("A", list(range(12)), BS), store=False)
    _, _, ids = admit(sched, gpu, a)
    generate(a, [90, 91, 92, 93])
    finish(sched, gpu, a, ids)
    assert sched.admission.is_dead(with_group_id(a.block_hashes[3]))


def test_a_gpu_hit_revives_a_dead_block_even_with_store_false() -> None:
    """A block is live again when a request reuses it, whatever that request's own `store` hint.

    Found by mutation testing of scheduler_side/admissions.py (docs/mutation.md)."""
    sched, gpu = make_scheduler(block_size=BS)
    a = hinted(FakeRequest("A", list(range(9)), BS), store=False)
    _, _, a_ids = admit(sched, gpu, a)
    finish(sched, gpu, a, a_ids)
    key = with_group_id(a.block_hashes[0])
    assert sched.admission.is_dead(key)
    b = hinted(FakeRequest("B", list(range(9)) + [5, 5, 5, 5], BS), store=False)
    admit(sched, gpu, b, gpu_hit_tokens=BS)  # block 0 comes from the engine's GPU cache
    assert not sched.admission.is_dead(key)


def test_store_false_revives_the_dead_blocks_it_hits_on_the_gpu_and_on_the_cpu() -> None:
    """A `store: false` request that hits dead blocks on both tiers (the GPU's first, then a CPU hit of
    n blocks) makes every hit block live: "new" starts after the GPU hit *plus* the CPU hit.

    Found by mutation testing of scheduler_side/admissions.py (docs/mutation.md)."""
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


@pytest.mark.parametrize("group_id", [0, 1])
def test_a_superseded_block_loses_its_cpu_copy_once(group_id: int) -> None:
    """Found by mutation testing of scheduler_side/admissions.py (docs/mutation.md)."""
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
