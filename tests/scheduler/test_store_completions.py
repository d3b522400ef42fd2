"""What a worker report does to the pools: a completed store caches its blocks and publishes KV events, a
failed one (on any rank) frees its CPU blocks first in line, and a GPU block whose request is gone goes
back to the GPU free queue as the most recently used once its transfer ends; a store event stays outstanding
(what the lazy policy's estimate reads) until its completion is reported."""

from __future__ import annotations

from helpers import FakeRequest, admit, finish, free_ids, make_scheduler, report, step_done

from offload_connector.hashing import with_group_id

BS = 4


def test_a_failed_store_frees_its_cpu_blocks_first_in_line_and_counts_every_failure():
    """Found by mutation testing of scheduler_side/completions.py (docs/mutation.md)."""
    sched, gpu = make_scheduler(num_cpu_blocks=10, block_size=BS)
    for n, name in enumerate(("A", "B")):
        req = FakeRequest(name, [100 * n + t for t in range(9)], BS)
        _, _, ids = admit(sched, gpu, req)
        meta = sched.build_connector_meta([step_done(name, ids, 9)])
        sched.update_connector_output(report(failed_store_events=[meta.store_event]))
        assert free_ids(sched.cpu_pool)[:2] == meta.store_cpu_blocks  # reused first: they hold nothing
        finish(sched, gpu, req, ids)
    assert sched.stats.num_failed_store_blocks == 4 and not sched.cpu_pool.cached


def test_a_store_fails_if_any_rank_failed_it():
    """Found by mutation testing of scheduler_side/completions.py (docs/mutation.md)."""
    sched, gpu = make_scheduler(block_size=BS, world_size=2)
    a = FakeRequest("A", list(range(9)), BS)
    _, _, ids = admit(sched, gpu, a)
    meta = sched.build_connector_meta([step_done("A", ids, 9)])
    sched.update_connector_output(report(rank=0, failed_store_events=[meta.store_event]))
    sched.update_connector_output(report(rank=1, completed_store_events=[meta.store_event]))
    assert not sched.cpu_pool.cached and sched.stats.num_failed_store_blocks == 2
    finish(sched, gpu, a, ids)
    assert sched.is_idle()


def test_a_block_whose_request_is_gone_returns_to_the_gpu_queue_as_most_recently_used():
    """Found by mutation testing of scheduler_side/completions.py (docs/mutation.md)."""
    # 1. eager: A finishes while its store is in flight; the store's reference is the last one
    sched, gpu = make_scheduler(num_gpu_blocks=10, block_size=BS)
    a = FakeRequest("A", list(range(9)), BS)
    _, _, ids = admit(sched, gpu, a)
    meta = sched.build_connector_meta([step_done("A", ids, 9)])
    finish(sched, gpu, a, ids)
    sched.update_connector_output(report(completed_store_events=[meta.store_event]))
    assert free_ids(gpu)[-2:] == meta.store_gpu_blocks
    # 2. B is aborted while its load is in flight; the load's references are the last ones
    b = FakeRequest("B", list(range(9)), BS)
    _, _, b_ids = admit(sched, gpu, b)
    load = sched.build_connector_meta([])
    finish(sched, gpu, b, b_ids)
    sched.update_connector_output(report(finished_load_reqs=["B"]))
    assert free_ids(gpu)[-2:] == load.load_gpu_blocks
    assert sched.is_idle()


def store_two_requests(sched, gpu, before_b=lambda: None) -> list[list[bytes]]:  # noqa: ANN001
    """A, then B, each stored and finished; with room for 2 blocks, B's store evicts A's. Returns each one's
    keys; `before_b` runs between them."""
    keys = []
    for n, name in enumerate(("A", "B")):
        if name == "B":
            before_b()
        req = FakeRequest(name, [100 * n + t for t in range(9)], BS)
        _, _, ids = admit(sched, gpu, req)
        meta = sched.build_connector_meta([step_done(name, ids, 9)])
        sched.update_connector_output(report(completed_store_events=[meta.store_event]))
        finish(sched, gpu, req, ids)
        keys.append([with_group_id(h) for h in req.block_hashes])
    return keys


def test_kv_events_name_the_stored_and_the_evicted_keys():
    """Found by mutation testing of scheduler_side/kv_events.py (docs/mutation.md)."""
    sched, gpu = make_scheduler(num_cpu_blocks=3, block_size=BS)  # room for 2 blocks
    keys = store_two_requests(sched, gpu)
    events = [(e.kind, e.block_hash) for e in sched.take_events()]
    assert events[:2] == [("stored", k) for k in keys[0]]
    assert sorted(events[2:4]) == sorted(("removed", k) for k in keys[0])  # B's store evicted A's blocks
    assert events[4:] == [("stored", k) for k in keys[1]]


def test_kv_events_turned_on_later_name_the_evictions_from_then_on():
    """The CPU pool tells the scheduler of its evictions only while someone listens (eager without KV events:
    nobody); turning the events on must make the next eviction heard."""
    sched, gpu = make_scheduler(num_cpu_blocks=3, block_size=BS)
    sched.emit_kv_events = False
    assert sched.cpu_pool.on_evict is None
    keys = store_two_requests(sched, gpu, before_b=lambda: setattr(sched, "emit_kv_events", True))
    events = [(e.kind, e.block_hash) for e in sched.take_events()]
    assert sorted(events[:2]) == sorted(("removed", k) for k in keys[0])  # B's store evicted A's blocks
    assert events[2:] == [("stored", k) for k in keys[1]]


def test_a_store_event_is_outstanding_until_its_completion_is_reported():
    """Found by mutation testing of scheduler_side/policies/view.py (docs/mutation.md)."""
    sched, gpu = make_scheduler(num_cpu_blocks=8)
    req = FakeRequest("a", list(range(9)), BS)
    _, _, ids = admit(sched, gpu, req)
    meta = sched.build_connector_meta([step_done("a", ids, 9)])
    view = sched.policy.view
    assert view.is_store_outstanding(meta.store_event)
    sched.update_connector_output(report(completed_store_events=[meta.store_event]))
    assert not view.is_store_outstanding(meta.store_event)
