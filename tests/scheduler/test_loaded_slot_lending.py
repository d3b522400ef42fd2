"""A store takes the CPU slot of a block its step's load reads only when that load alone reads it.

Lazy under CPU pressure lends a loaded block's slot to the same step's store (the workers run that store
after the load: `store_after_load`). With the load wait off (`max_store_wait_steps: 0`) a second request
can load the same CPU blocks while the first request's load is still in flight; and a request whose
allocation has not happened yet pins them as a pending hit. Either way the slot is not the load's to lend:
the store would write bytes another load still reads, or that a pending hit is about to load. The
scheduler's `check_integrity` names such a block (the stores-and-reads invariant, scheduler.py).
"""

from __future__ import annotations

import pytest
from helpers import FakeRequest, admit, make_scheduler, put_under_pressure, report, step_done

from offload_connector.hashing import with_group_id
from scheduler_side import BlockPool, OffloadScheduler, SchedulerError
from scheduler_side.request_state import LoadJob

BS = 4
PREFIX = list(range(9))  # two full blocks and one token to compute


def computed_and_freed(sched: OffloadScheduler, gpu: BlockPool, req: FakeRequest, gpu_ids: list[int]) -> None:
    """The engine's side of a finish after computing `req`: its full blocks stay cached on the GPU, free."""
    sched.request_finished(req)
    for gpu_id, h in zip(gpu_ids, req.block_hashes, strict=False):
        gpu.cache(gpu.blocks[gpu_id], with_group_id(h))
    gpu.free([gpu.blocks[i] for i in reversed(gpu_ids)])


def prefix_loading_and_unsaved_blocks():
    """A lazy scheduler under pressure, the load wait off: A's two blocks are on the CPU tier only; B's load
    of them is in flight (`load_b`); D's two computed blocks were just freed, unsaved, and the policy holds
    them for the next store event."""
    sched, gpu = make_scheduler(num_gpu_blocks=16, num_cpu_blocks=20, block_size=BS, store_policy="lazy",
                                lazy_lookahead_blocks=20, max_store_wait_steps=0)
    put_under_pressure(sched)
    a = FakeRequest("A", PREFIX, BS)
    _, _, a_ids = admit(sched, gpu, a)
    sched.build_connector_meta([step_done("A", a_ids, 9)])
    computed_and_freed(sched, gpu, a, a_ids)
    meta = sched.build_connector_meta([])  # A's blocks lie on the frontier: saved now
    sched.update_connector_output(report(completed_store_events=[meta.store_event]))
    for block in list(gpu.free_queue):  # the GPU evicts them
        gpu.uncache(block)
    assert len(sched.cpu_pool.cached) == 2 and sched.policy.under_pressure
    b, d = FakeRequest("B", PREFIX, BS), FakeRequest("D", list(range(500, 509)), BS)
    # 1. B hits A's blocks on the CPU tier; D is admitted and computed in the same step
    assert admit(sched, gpu, b)[:2] == (8, True)
    _, _, d_ids = admit(sched, gpu, d)
    load_b = sched.build_connector_meta([step_done("D", d_ids, 9)])
    assert load_b.load_event_reqs == ["B"] and load_b.store_event is None
    # 2. D finishes: its computed blocks are cached on the GPU, unsaved, held for the next store event
    computed_and_freed(sched, gpu, d, d_ids)
    return sched, gpu, load_b


@pytest.mark.parametrize("b_reads", ["done", "in flight", "done, lending off"])
def test_a_slot_is_lent_only_while_its_load_alone_reads_it(b_reads):
    """`lending off`: a scheduler for a host pool several ranks share lends no slot at all (stores.py)."""
    sched, gpu, load_b = prefix_loading_and_unsaved_blocks()
    sched.stores.lend_load_slots = b_reads != "done, lending off"
    sched.stats.num_reused_load_slots = 5  # a running total (as after earlier steps' lends)
    # 3. C hits the same CPU blocks (no load wait): its load reads them too
    c = FakeRequest("C", PREFIX + [9, 10], BS)
    assert admit(sched, gpu, c)[:2] == (8, True)
    if b_reads != "in flight":
        sched.update_connector_output(report(finished_load_reqs=["B"]))
    # 4. this step sends C's load and stores D's blocks
    meta = sched.build_connector_meta([])
    assert meta.load_event_reqs == ["C"] and meta.load_cpu_blocks == load_b.load_cpu_blocks
    assert len(meta.store_gpu_blocks) == 2
    lent = set(meta.store_cpu_blocks) & set(meta.load_cpu_blocks)
    if b_reads == "done":  # C's load alone reads them: the store takes both slots, after the load
        assert lent == set(meta.load_cpu_blocks) and meta.store_after_load
        assert sched.stats.num_reused_load_slots == 5 + 2
    else:  # B's load still reads them (or lending is off): the store writes free blocks instead
        assert not lent and not meta.store_after_load
        assert sched.stats.num_reused_load_slots == 5
    sched.check_integrity()
    # 5. everything completes: the blocks go back, and C's load read A's content throughout
    reports = [report(finished_load_reqs=["C"]), report(completed_store_events=[meta.store_event])]
    if b_reads == "in flight":
        reports.insert(0, report(finished_load_reqs=["B"]))
    sched.update_connector_output(reports)
    sched.check_integrity()
    assert sched.cpu_pool.num_held_blocks() == 0


def test_a_slot_a_pending_hit_holds_is_not_lent():
    """The converse: B's load is done, C loads the blocks this step, and E has looked them up (a pending
    hit: the engine could not allocate E this step). The store must not take the slots E is to load."""
    sched, gpu, _ = prefix_loading_and_unsaved_blocks()
    c, e = FakeRequest("C", PREFIX + [9, 10], BS), FakeRequest("E", PREFIX + [11], BS)
    assert admit(sched, gpu, c)[:2] == (8, True)
    assert sched.get_num_new_matched_tokens(e, 0) == (8, True)  # pinned; allocated in a later step
    sched.update_connector_output(report(finished_load_reqs=["B"]))
    meta = sched.build_connector_meta([])
    assert meta.load_event_reqs == ["C"] and len(meta.store_gpu_blocks) == 2
    assert not set(meta.store_cpu_blocks) & set(meta.load_cpu_blocks) and not meta.store_after_load
    sched.check_integrity()
    # E is allocated next step: it loads A's content, still in those blocks
    e_ids = [blk.block_id for blk in gpu.allocate(3)]
    sched.update_state_after_alloc(e, e_ids, 8)
    load_e = sched.build_connector_meta([])
    assert load_e.load_cpu_blocks == meta.load_cpu_blocks
    assert all(sched.cpu_pool.blocks[i].block_hash is not None for i in load_e.load_cpu_blocks)
    sched.check_integrity()


def test_check_integrity_names_a_store_over_a_block_a_load_reads():
    """The invariant's own check, on a store event planted over the first CPU block of B's load in flight:
    refused; allowed once B's load has lent that slot (it alone reads it); refused again once C's pending
    hit holds the block too."""
    sched, gpu, _ = prefix_loading_and_unsaved_blocks()
    job = sched.transfers.requests["B"].load
    assert isinstance(job, LoadJob)
    slot = job.cpu_blocks[0]
    [source] = gpu.allocate(1)  # the planted store event's references: this GPU block's, and the slot's
    sched.cpu_pool.touch([slot])
    event = sched.transfers.issue_store_event([source.block_id], [slot])
    with pytest.raises(SchedulerError, match=f"CPU block {slot.block_id} is written by store event "
                                             f"{event.event_id} while read by request B's load \\(0 of them"):
        sched.check_integrity()
    job.lent.add(slot.block_id)
    sched.check_integrity()
    assert sched.get_num_new_matched_tokens(FakeRequest("C", PREFIX, BS), 0) == (8, True)
    with pytest.raises(SchedulerError, match="request B's load, request C's pending hit \\(1 of them"):
        sched.check_integrity()
