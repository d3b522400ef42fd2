"""The remote tier's scheduler side (scheduler_side/tiers/remote/tier.py): behaviours the mutation run found no
test for (docs/mutation.md). Each test names the rule it pins. A hand-driven stand-in answers the lookups
(test_remote_scheduler.HandLookups) and a hand-moved clock stands in for time."""

from __future__ import annotations

import pytest
from helpers import FakeRequest, finish, tier_ops, tier_report
from test_remote_scheduler import BS, IDENTITY, HandLookups, admit, make, store_all

from offload_connector.config import load_config
from offload_connector.hashing import with_group_id
from offload_connector.metadata import WorkerReport
from scheduler_side import BlockPool, BlockPoolGpuView, OffloadScheduler
from scheduler_side.errors import SchedulerError
from scheduler_side.request_state import RequestState

pytest.importorskip("redis", reason="the remote tier's client needs the `redis` package")


def make_with(num_cpu_blocks: int = 20, group_id: int = 0, remote: dict | None = None, **config):
    """`make` with top-level config keys and a KV-cache group id of our choosing."""
    cfg = load_config({"store_policy": "eager", "num_cpu_blocks": num_cpu_blocks, **config,
                       "remote": {"url": "redis://127.0.0.1:1/0", **(remote or {})}})
    gpu = BlockPool(100)
    sched = OffloadScheduler(cfg, BS, num_cpu_blocks, BlockPoolGpuView(gpu), 1, group_id=group_id,
                             tier_identity=IDENTITY)
    sched.tiers["remote"].lookups.close()
    sched.tiers["remote"].lookups = HandLookups(sched.tiers["remote"].lookups.client)
    now = [0.0]
    sched.tiers["remote"].clock = lambda: now[0]
    return sched, gpu, now


def test_nothing_to_ask_asks_nothing() -> None:
    """start() with an empty range (first == last) submits no question and the request does not wait."""
    sched, _, _ = make()
    req = FakeRequest("r", list(range(17)), BS)
    assert sched.tiers["remote"].start(RequestState(req), req.block_hashes, 3, 3) is False
    assert sched.tiers["remote"].lookups.questions == {} and sched.tiers["remote"].num_waiting == 0


def test_the_question_covers_the_blocks_from_the_first_miss_to_the_last() -> None:
    sched, _, _ = make()
    req = FakeRequest("r", list(range(25)), BS)  # 6 full blocks
    assert sched.tiers["remote"].start(RequestState(req), req.block_hashes, 2, 5) is True
    assert sched.tiers["remote"].lookups.questions[0] == req.block_hashes[2:5]


def test_an_open_breaker_skips_lookups_and_counts_each() -> None:
    """While the breaker is open nobody waits on the tier; every skipped lookup is counted."""
    sched, gpu, _ = make()
    sched.tiers["remote"].lookups.client.breaker.on_failure()
    assert sched.tiers["remote"].lookups.client.breaker.state == "open"
    for i in range(2):
        hit, ids = admit(sched, gpu, FakeRequest(f"r{i}", [i * 100 + t for t in range(9)], BS))
        assert hit == 0
    assert sched.tiers["remote"].counters.lookups_skipped == 2 and sched.tiers["remote"].lookups.questions == {}


def test_the_deadline_is_timeout_ms_after_the_question() -> None:
    sched, gpu, now = make(timeout_ms=1000)
    req = FakeRequest("r", list(range(9)), BS)
    admit(sched, gpu, req)
    now[0] = 0.9995
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)  # still within the 1 s
    now[0] = 1.0
    assert sched.get_num_new_matched_tokens(req, 0)[0] == 0
    assert sched.tiers["remote"].counters.lookup_timeouts == 1


def test_every_timeout_is_counted() -> None:
    sched, gpu, now = make(timeout_ms=100)
    reqs = [FakeRequest(f"r{i}", [i * 100 + t for t in range(9)], BS) for i in range(2)]
    for req in reqs:
        admit(sched, gpu, req)
    now[0] = 1.0
    for req in reqs:
        assert sched.get_num_new_matched_tokens(req, 0)[0] == 0
    assert sched.tiers["remote"].counters.lookup_timeouts == 2


def test_a_one_block_answer_is_fetched() -> None:
    sched, gpu, _ = make()
    req = FakeRequest("r", list(range(9)), BS)
    admit(sched, gpu, req)
    sched.tiers["remote"].lookups.answers[0] = 1
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    assert tier_ops(sched.build_connector_meta([])).fetch_keys == [with_group_id(req.block_hashes[0])]


def test_a_request_waits_for_its_fetch_without_store_waits() -> None:
    """With `max_store_wait_steps: 0` a block being received ends a CPU hit at once; the request must still
    wait for its own fetch (issued, then queued for this step's metadata) instead of computing the blocks."""
    sched, gpu, _ = make_with(max_store_wait_steps=0)
    req = FakeRequest("r", list(range(13)), BS)
    admit(sched, gpu, req)
    sched.tiers["remote"].lookups.answers[0] = 3
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)  # the fetch is issued
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)  # ... and queued: wait, same step
    sched.check_integrity()  # the queued fetch holds its blocks
    sched.build_connector_meta([])
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)  # sent, not complete
    sched.update_connector_output(tier_report(completed_fetch_events=[0]))
    assert sched.get_num_new_matched_tokens(req, 0) == (3 * BS, True)


def test_a_fetch_that_outlives_the_deadline_stops_the_wait_once() -> None:
    """Past the deadline the request stops waiting for its fetch (one timeout), and never waits again
    while that fetch is still in flight."""
    sched, gpu, now = make(timeout_ms=100)
    req = FakeRequest("r", list(range(13)), BS)
    admit(sched, gpu, req)
    sched.tiers["remote"].lookups.answers[0] = 3
    sched.get_num_new_matched_tokens(req, 0)
    sched.build_connector_meta([])
    now[0] = 0.5
    for _ in range(3):
        sched.get_num_new_matched_tokens(req, 0)  # the blocks are still being received
    assert sched.tiers["remote"].counters.lookup_timeouts == 1 and sched.tiers["remote"].num_waiting == 0
    sched.update_connector_output(tier_report(completed_fetch_events=[0]))
    sched.check_integrity()


def test_the_fetch_stops_at_a_block_the_cpu_already_has() -> None:
    """The answer covers blocks 0..2; block 1 is on the CPU already: only block 0 is fetched."""
    sched, gpu, _ = make()
    req = FakeRequest("r", list(range(13)), BS)
    [block] = sched.cpu_pool.allocate(1)
    sched.cpu_pool.cache(block, with_group_id(req.block_hashes[1]))
    sched.cpu_pool.free([block])
    admit(sched, gpu, req)
    sched.tiers["remote"].lookups.answers[0] = 3
    sched.get_num_new_matched_tokens(req, 0)
    assert tier_ops(sched.build_connector_meta([])).fetch_keys == [with_group_id(req.block_hashes[0])]


def test_no_cpu_room_means_no_fetch_and_no_wait() -> None:
    """Every CPU block held: nothing can be fetched, so the request stops waiting at once."""
    sched, gpu, _ = make(num_cpu_blocks=2)  # one usable block
    held = sched.cpu_pool.allocate(1)
    req = FakeRequest("r", list(range(9)), BS)
    admit(sched, gpu, req)
    sched.tiers["remote"].lookups.answers[0] = 2
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert sched.tiers["remote"].num_waiting == 0 and tier_ops(sched.build_connector_meta([])).fetch_event is None
    sched.cpu_pool.free(held)


def test_the_fetch_never_evicts_own_cpu_hits_in_any_group() -> None:
    """As test_remote_scheduler's test of the same name, with the KV-cache group id 1 in every key."""
    sched, gpu, _ = make_with(num_cpu_blocks=5, group_id=1)
    a = FakeRequest("a", list(range(8)), BS)
    store_all(sched, gpu, a)
    store_all(sched, gpu, FakeRequest("x", list(range(100, 108)), BS))
    b = FakeRequest("b", list(range(17)), BS)
    assert admit(sched, gpu, b) == (None, [])
    sched.tiers["remote"].lookups.answers[0] = 2
    sched.get_num_new_matched_tokens(b, 0)
    meta = sched.build_connector_meta([])
    assert tier_ops(meta).fetch_keys == [with_group_id(h, 1) for h in b.block_hashes[2:4]]
    sched.update_connector_output(tier_report(completed_fetch_events=[tier_ops(meta).fetch_event]))
    hit, _ = admit(sched, gpu, b)
    assert hit == 4 * BS


def two_fetches(sched, gpu):
    """Two requests, one fetch event each (ids 0 and 1), sent; returns the requests."""
    reqs = []
    for i in range(2):
        req = FakeRequest(f"r{i}", [i * 100 + t for t in range(9)], BS)
        admit(sched, gpu, req)
        sched.tiers["remote"].lookups.answers[i] = 2
        sched.get_num_new_matched_tokens(req, 0)
        assert tier_ops(sched.build_connector_meta([])).fetch_event == i  # event ids count up by one
        reqs.append(req)
    return reqs


def test_worker_counters_add_up_over_reports() -> None:
    sched, _, _ = make()
    sched.update_connector_output(tier_report(counters={"written_blocks": 2}))
    sched.update_connector_output(tier_report(counters={"written_blocks": 3, "fetched_blocks": 1}))
    assert sched.tiers["remote"].worker_counters == {"written_blocks": 5, "fetched_blocks": 1}


def test_the_next_event_id_is_not_issued_yet() -> None:
    sched, gpu, _ = make()
    two_fetches(sched, gpu)
    with pytest.raises(SchedulerError, match="never issued"):
        sched.update_connector_output(tier_report(completed_fetch_events=[2]))


def test_a_late_completion_does_not_hide_the_next_one() -> None:
    sched, gpu, _ = make()
    sched.emit_kv_events = True
    two_fetches(sched, gpu)
    sched.update_connector_output(tier_report(completed_fetch_events=[0]))
    sched.update_connector_output(tier_report(completed_fetch_events=[0, 1]))  # 0 again: late, ignored
    assert sched.is_idle() and len(sched.cpu_pool.cached) == 4


def test_a_repeated_rank_does_not_hide_the_next_event() -> None:
    sched, gpu, _ = make(world_size=2)
    two_fetches(sched, gpu)
    sched.update_connector_output(tier_report(rank=0, completed_fetch_events=[0, 0, 1]))
    sched.update_connector_output(tier_report(rank=1, completed_fetch_events=[0, 1]))
    assert sched.is_idle() and len(sched.cpu_pool.cached) == 4


def test_every_event_completed_in_one_report_is_published() -> None:
    sched, gpu, _ = make()
    sched.emit_kv_events = True
    reqs = two_fetches(sched, gpu)
    sched.take_events()
    sched.update_connector_output(tier_report(completed_fetch_events=[0, 1]))
    stored = [e.block_hash for e in sched.take_events() if e.kind == "stored"]
    assert sorted(stored) == sorted(with_group_id(h) for r in reqs for h in r.block_hashes[:2])
    for req in reqs:
        hit, ids = admit(sched, gpu, req)
        assert hit == 2 * BS
        sched.update_connector_output(WorkerReport(finished_load_reqs=[req.request_id]))
        finish(sched, gpu, req, ids)
