"""The scheduler side of the remote tier, one request's story at a time, with a stand-in for the lookup
thread (answers set by hand) and a hand-moved clock: what is asked and until when, what is fetched, how
completions and counters add up. The real thread and server: test_remote_client.py,
test_remote_fake_engine.py, test_remote_faults.py."""

from __future__ import annotations

import pytest
from helpers import FakeRequest, finish, step_done, tier_ops, tier_report

from offload_connector.config import load_config
from offload_connector.hashing import with_group_id
from offload_connector.metadata import WorkerReport
from offload_connector.tier_identity import TierIdentity
from scheduler_side import BlockPool, BlockPoolGpuView, OffloadScheduler
from scheduler_side.errors import SchedulerError
from scheduler_side.request_state import Phase, RequestState
from scheduler_side.tiers.remote.stats import REMOTE_COUNTERS

pytest.importorskip("redis", reason="the remote tier's client needs the `redis` package")

BS = 4
IDENTITY = TierIdentity(model="m", block_size=BS, hash_algo="xxh3_128", layout="test")


class HandLookups:
    """Stands in for RemoteLookups: records questions; `answer` files an answer."""

    def __init__(self, client) -> None:
        self.client, self.questions, self.answers, self.cancelled = client, {}, {}, set()

    def submit(self, hashes, group_id):
        ticket = len(self.questions)
        self.questions[ticket] = list(hashes)
        return ticket

    def take(self, ticket):
        return self.answers.pop(ticket, None)

    def cancel(self, ticket):
        self.cancelled.add(ticket)

    def close(self):
        pass


def make_with(num_cpu_blocks: int = 20, group_id: int = 0, remote: dict | None = None, world_size: int = 1,
              **config):
    """An eager scheduler of KV-cache group `group_id` whose remote tier has the hand-driven lookup stand-in
    and a hand-moved clock (`now[0]`, in seconds); `config`: top-level keys, `remote`: the tier's keys."""
    cfg = load_config({"store_policy": "eager", "num_cpu_blocks": num_cpu_blocks, **config,
                       "remote": {"url": "redis://127.0.0.1:1/0", **(remote or {})}})
    gpu = BlockPool(100)
    sched = OffloadScheduler(cfg, BS, num_cpu_blocks, BlockPoolGpuView(gpu), world_size, group_id=group_id,
                             tier_identity=IDENTITY)
    sched.tiers["remote"].lookups.close()  # the real thread: replaced by the hand-driven stand-in
    sched.tiers["remote"].lookups = HandLookups(sched.tiers["remote"].lookups.client)
    now = [0.0]
    sched.tiers["remote"].clock = lambda: now[0]
    return sched, gpu, now


def make(world_size: int = 1, num_cpu_blocks: int = 20, **remote):
    return make_with(num_cpu_blocks, remote=remote, world_size=world_size)


def admit(sched, gpu, req):
    hit, _ = sched.get_num_new_matched_tokens(req, 0)
    if hit is None:
        return None, []
    ids = [b.block_id for b in gpu.allocate(-(-req.num_tokens // BS))]
    sched.update_state_after_alloc(req, ids, hit)
    return hit, ids


def test_remote_hit_is_fetched_then_loaded() -> None:
    sched, gpu, _ = make()
    req = FakeRequest("r", list(range(17)), BS)  # 4 full blocks + 1 token
    # 1. CPU miss: the tier is asked about blocks 0..3, the request waits
    assert admit(sched, gpu, req) == (None, [])
    assert sched.tiers["remote"].lookups.questions[0] == req.block_hashes[:4]
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)  # no answer yet: still waiting
    # 2. 3 blocks exist: they are reserved and fetched by this step's fetch event
    sched.tiers["remote"].lookups.answers[0] = 3
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    meta = sched.build_connector_meta([])
    keys = [with_group_id(h, 0) for h in req.block_hashes[:3]]
    assert tier_ops(meta).fetch_event == 0 and tier_ops(meta).fetch_keys == keys and len(tier_ops(meta).fetch_cpu_blocks) == 3
    assert all(k in sched.cpu_pool.reserved for k in keys) and not sched.is_idle()
    sched.check_integrity()
    # 3. the fetch completes: the blocks are hit-able; the next lookup hits them and loads them
    sched.update_connector_output(tier_report(completed_fetch_events=[0]))
    hit, ids = admit(sched, gpu, req)
    assert hit == 3 * BS and sched.phase_of("r") is Phase.LOADING
    assert sched.build_connector_meta([]).load_cpu_blocks == tier_ops(meta).fetch_cpu_blocks
    sched.update_connector_output(WorkerReport(finished_load_reqs=["r"]))
    finish(sched, gpu, req, ids)
    assert sched.is_idle() and sched.tiers["remote"].num_waiting == 0
    sched.check_integrity()


def test_no_answer_within_timeout_means_no_remote_hit() -> None:
    sched, gpu, now = make(timeout_ms=100)
    req = FakeRequest("r", list(range(9)), BS)
    assert admit(sched, gpu, req) == (None, [])
    now[0] = 0.099
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    now[0] = 0.1  # timed out: the request goes on without the tier, and never asks it again
    hit, ids = admit(sched, gpu, req)
    assert hit == 0 and sched.tiers["remote"].counters.lookup_timeouts == 1 and sched.tiers["remote"].lookups.cancelled == {0}
    sched.tiers["remote"].lookups.answers[0] = 2  # a late answer is never used
    assert sched.tiers["remote"].num_waiting == 0 and len(sched.tiers["remote"].lookups.questions) == 1
    finish(sched, gpu, req, ids)
    sched.check_integrity()


def test_waiting_requests_are_bounded() -> None:
    sched, gpu, _ = make(max_waiting_requests=2)
    reqs = [FakeRequest(f"r{i}", [i * 100 + t for t in range(9)], BS) for i in range(3)]
    assert [admit(sched, gpu, r)[0] for r in reqs] == [None, None, 0]  # the third does not wait
    assert sched.tiers["remote"].counters.lookups_skipped == 1 and sched.tiers["remote"].num_waiting == 2
    sched.request_finished(reqs[0])  # a finished request stops waiting: its question is dropped
    assert sched.tiers["remote"].num_waiting == 1 and 0 in sched.tiers["remote"].lookups.cancelled


def test_fetch_with_two_ranks_fails_a_block_either_rank_failed() -> None:
    sched, gpu, _ = make(world_size=2)
    req = FakeRequest("r", list(range(17)), BS)
    admit(sched, gpu, req)
    sched.tiers["remote"].lookups.answers[0] = 4
    sched.get_num_new_matched_tokens(req, 0)
    meta = sched.build_connector_meta([])
    cpu = tier_ops(meta).fetch_cpu_blocks
    sched.update_connector_output(tier_report(rank=0, completed_fetch_events=[0]))
    assert not sched.is_idle()  # rank 1 has not reported
    sched.update_connector_output(tier_report(rank=1, completed_fetch_events=[0], failed_fetch_cpu_blocks=[cpu[1]]))
    keys = [with_group_id(h, 0) for h in req.block_hashes[:4]]
    assert [k in sched.cpu_pool.cached for k in keys] == [True, False, True, True]
    assert next(iter(sched.cpu_pool.free_queue)).block_id == cpu[1]  # the failed block is evicted first
    hit, _ = sched.get_num_new_matched_tokens(req, 0)
    assert hit == BS  # the run ends at the failed block


def test_finished_while_fetching_still_caches_and_leaks_nothing() -> None:
    sched, gpu, _ = make()
    req = FakeRequest("r", list(range(13)), BS)
    admit(sched, gpu, req)
    sched.tiers["remote"].lookups.answers[0] = 3
    sched.get_num_new_matched_tokens(req, 0)
    sched.request_finished(req)
    meta = sched.build_connector_meta([step_done("x", [], 0)])
    assert tier_ops(meta).fetch_event == 0
    sched.update_connector_output(tier_report(completed_fetch_events=[0]))
    assert sched.is_idle() and len(sched.cpu_pool.cached) == 3
    sched.check_integrity()


def test_reset_fails_fetches_in_flight_and_turns_the_tier_off() -> None:
    sched, gpu, _ = make()
    req = FakeRequest("r", list(range(13)), BS)
    admit(sched, gpu, req)
    sched.tiers["remote"].lookups.answers[0] = 3
    sched.get_num_new_matched_tokens(req, 0)
    sched.build_connector_meta([])
    assert sched.reset_cache()
    sched.update_connector_output(tier_report(completed_fetch_events=[0]))
    assert not sched.cpu_pool.cached and sched.is_idle()
    other = FakeRequest("o", list(range(50, 63)), BS)
    assert admit(sched, gpu, other)[0] == 0  # not asked: the tier is off for this instance
    assert len(sched.tiers["remote"].lookups.questions) == 1
    sched.check_integrity()


def test_a_fetch_event_never_issued_raises() -> None:
    sched, _, _ = make()
    with pytest.raises(SchedulerError, match="never issued"):
        sched.update_connector_output(tier_report(completed_fetch_events=[5]))


def store_all(sched, gpu, req):
    """The request computes its prompt and its full blocks are stored, then it finishes."""
    sched.tiers["remote"].enabled = False  # stores only: no remote lookup for this one
    _, ids = admit(sched, gpu, req)
    meta = sched.build_connector_meta([step_done(req.request_id, ids, req.num_tokens)])
    sched.update_connector_output(WorkerReport(completed_store_events=[meta.store_event]))
    finish(sched, gpu, req, ids)
    sched.tiers["remote"].enabled = True


def test_the_fetch_never_evicts_the_requests_own_cpu_hits() -> None:
    sched, gpu, _ = make(num_cpu_blocks=5)  # 4 usable blocks
    a = FakeRequest("a", list(range(8)), BS)
    store_all(sched, gpu, a)  # a's 2 blocks: the least recently used
    store_all(sched, gpu, FakeRequest("x", list(range(100, 108)), BS))  # 2 more, more recent: the pool is full
    b = FakeRequest("b", list(range(17)), BS)  # a's 2 blocks, then 2 more that only the server has
    assert admit(sched, gpu, b) == (None, [])
    assert sched.tiers["remote"].lookups.questions[0] == b.block_hashes[2:4]  # asked from the first CPU miss on
    sched.tiers["remote"].lookups.answers[0] = 2
    sched.get_num_new_matched_tokens(b, 0)
    sched.update_connector_output(tier_report(completed_fetch_events=[tier_ops(sched.build_connector_meta([])).fetch_event]))
    hit, ids = admit(sched, gpu, b)
    assert hit == 4 * BS  # x's blocks were evicted for the fetch, not a's, which b was about to hit
    sched.check_integrity()


def test_blocks_on_the_server_are_published_once_every_rank_wrote_them() -> None:
    """KV events with medium REMOTE: a block is on the server once each rank's copy is (written, or found
    there already); one rank's report, or one repeated, publishes nothing; never a REMOTE removal."""
    sched, _, _ = make(world_size=2)
    k1, k2 = with_group_id(b"\x01" * 16), with_group_id(b"\x02" * 16)
    sched.update_connector_output([tier_report(rank=0, written_keys=[k1, k2]),
                                   tier_report(rank=0, written_keys=[k1])])
    assert sched.take_events() == []
    sched.update_connector_output(tier_report(rank=1, written_keys=[k2]))
    [event] = sched.take_events()
    assert (event.kind, event.block_hash, event.medium) == ("stored", k2, "REMOTE")
    sched.update_connector_output(tier_report(rank=1, written_keys=[k1]))
    assert [(e.block_hash, e.medium) for e in sched.take_events()] == [(k1, "REMOTE")]


def test_keys_one_rank_never_wrote_do_not_pile_up() -> None:
    """A rank's write can be dropped (queue full, server down): the keys waiting for the other ranks are
    bounded (the oldest go), so a rank that drops writes for hours costs no memory."""
    sched, _, _ = make(world_size=2, num_cpu_blocks=4)
    keys = [with_group_id(i.to_bytes(16, "big")) for i in range(100)]
    sched.update_connector_output(tier_report(rank=0, written_keys=keys))
    assert len(sched.tiers["remote"]._on_server_ranks) == 4 * 4  # the newest 16 still wait for rank 1
    sched.update_connector_output(tier_report(rank=1, written_keys=keys[-16:]))
    assert [e.block_hash for e in sched.take_events()] == keys[-16:]
    assert not sched.tiers["remote"]._on_server_ranks


def test_one_rank_publishes_at_once_and_without_kv_events_nothing_is_kept() -> None:
    sched, _, _ = make(world_size=1)
    key = with_group_id(b"\x03" * 16)
    sched.update_connector_output(tier_report(written_keys=[key]))
    assert [(e.block_hash, e.medium) for e in sched.take_events()] == [(key, "REMOTE")]
    sched.emit_kv_events = False
    sched.update_connector_output(tier_report(written_keys=[key]))
    assert sched.take_events() == [] and sched.tiers["remote"].take_written() == []


# ---- lookups: what is asked, and when a request stops waiting ----------------------------------------------
def test_nothing_to_ask_asks_nothing() -> None:
    """start() with an empty range (first == last) submits no question and the request does not wait.

    Found by mutation testing of scheduler_side/tiers/remote/tier.py (docs/mutation.md)."""
    sched, _, _ = make()
    req = FakeRequest("r", list(range(17)), BS)
    assert sched.tiers["remote"].start(RequestState(req), req.block_hashes, 3, 3) is False
    assert sched.tiers["remote"].lookups.questions == {} and sched.tiers["remote"].num_waiting == 0


def test_the_question_covers_the_blocks_from_the_first_miss_to_the_last() -> None:
    """Found by mutation testing of scheduler_side/tiers/remote/tier.py (docs/mutation.md)."""
    sched, _, _ = make()
    req = FakeRequest("r", list(range(25)), BS)  # 6 full blocks
    assert sched.tiers["remote"].start(RequestState(req), req.block_hashes, 2, 5) is True
    assert sched.tiers["remote"].lookups.questions[0] == req.block_hashes[2:5]


def test_an_open_breaker_skips_lookups_and_counts_each() -> None:
    """While the breaker is open nobody waits on the tier; every skipped lookup is counted.

    Found by mutation testing of scheduler_side/tiers/remote/tier.py (docs/mutation.md)."""
    sched, gpu, _ = make()
    sched.tiers["remote"].lookups.client.breaker.on_failure()
    assert sched.tiers["remote"].lookups.client.breaker.state == "open"
    for i in range(2):
        hit, ids = admit(sched, gpu, FakeRequest(f"r{i}", [i * 100 + t for t in range(9)], BS))
        assert hit == 0
    assert sched.tiers["remote"].counters.lookups_skipped == 2 and sched.tiers["remote"].lookups.questions == {}


def test_the_deadline_is_timeout_ms_after_the_question() -> None:
    """Found by mutation testing of scheduler_side/tiers/remote/tier.py (docs/mutation.md)."""
    sched, gpu, now = make(timeout_ms=1000)
    req = FakeRequest("r", list(range(9)), BS)
    admit(sched, gpu, req)
    now[0] = 0.9995
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)  # still within the 1 s
    now[0] = 1.0
    assert sched.get_num_new_matched_tokens(req, 0)[0] == 0
    assert sched.tiers["remote"].counters.lookup_timeouts == 1


def test_every_timeout_is_counted() -> None:
    """Found by mutation testing of scheduler_side/tiers/remote/tier.py (docs/mutation.md)."""
    sched, gpu, now = make(timeout_ms=100)
    reqs = [FakeRequest(f"r{i}", [i * 100 + t for t in range(9)], BS) for i in range(2)]
    for req in reqs:
        admit(sched, gpu, req)
    now[0] = 1.0
    for req in reqs:
        assert sched.get_num_new_matched_tokens(req, 0)[0] == 0
    assert sched.tiers["remote"].counters.lookup_timeouts == 2


# ---- fetches ----------------------------------------------------------------------------------------------
def ask(sched: OffloadScheduler, req: FakeRequest, found: int) -> None:
    """The request misses on the CPU, waits on the tier, and the tier answers `found` blocks: the fetch is
    issued in this step's fetch event (not sent yet)."""
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    sched.tiers["remote"].lookups.answers[0] = found
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)


def test_a_one_block_answer_is_fetched() -> None:
    """Found by mutation testing of scheduler_side/tiers/remote/tier.py (docs/mutation.md)."""
    sched, gpu, _ = make()
    req = FakeRequest("r", list(range(9)), BS)
    admit(sched, gpu, req)
    sched.tiers["remote"].lookups.answers[0] = 1
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    assert tier_ops(sched.build_connector_meta([])).fetch_keys == [with_group_id(req.block_hashes[0])]


def test_fetch_keys_carry_the_schedulers_kv_cache_group() -> None:
    """A scheduler of KV cache group 1 fetches (and then hits) the blocks under group 1's keys.

    Found by mutation testing of scheduler_side/tiers/remote/tier.py (docs/mutation.md)."""
    sched, gpu, _ = make_with(group_id=1)
    req = FakeRequest("r", list(range(13)), BS)  # 3 full blocks + 1 token
    ask(sched, req, 3)
    meta = sched.build_connector_meta([])
    assert tier_ops(meta).fetch_keys == [with_group_id(h, 1) for h in req.block_hashes[:3]]
    sched.update_connector_output(tier_report(completed_fetch_events=[tier_ops(meta).fetch_event]))
    assert sched.get_num_new_matched_tokens(req, 0) == (3 * BS, True)


def test_a_request_waits_for_its_fetch_without_store_waits() -> None:
    """With `max_store_wait_steps: 0` a block being received ends a CPU hit at once; the request must still
    wait for its own fetch (issued, then queued for this step's metadata) instead of computing the blocks.

    Found by mutation testing of scheduler_side/tiers/remote/tier.py (docs/mutation.md)."""
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
    while that fetch is still in flight.

    Found by mutation testing of scheduler_side/tiers/remote/tier.py (docs/mutation.md)."""
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
    """The answer covers blocks 0..2; block 1 is on the CPU already: only block 0 is fetched.

    Found by mutation testing of scheduler_side/tiers/remote/tier.py (docs/mutation.md)."""
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
    """Every CPU block held: nothing can be fetched, so the request stops waiting at once.

    Found by mutation testing of scheduler_side/tiers/remote/tier.py (docs/mutation.md)."""
    sched, gpu, _ = make(num_cpu_blocks=2)  # one usable block
    held = sched.cpu_pool.allocate(1)
    req = FakeRequest("r", list(range(9)), BS)
    admit(sched, gpu, req)
    sched.tiers["remote"].lookups.answers[0] = 2
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert sched.tiers["remote"].num_waiting == 0 and tier_ops(sched.build_connector_meta([])).fetch_event is None
    sched.cpu_pool.free(held)


def test_the_fetch_never_evicts_own_cpu_hits_in_any_group() -> None:
    """As test_remote_scheduler's test of the same name, with the KV-cache group id 1 in every key.

    Found by mutation testing of scheduler_side/tiers/remote/tier.py (docs/mutation.md)."""
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


def test_reset_before_the_fetch_is_sent_fails_it_too() -> None:
    """reset_cache after a fetch was issued but before the step's metadata carried it: that fetch still
    completes as failed, so none of its (possibly old weights') blocks becomes hit-able.

    Found by mutation testing of scheduler_side/tiers/remote/tier.py (docs/mutation.md)."""
    sched, _, _ = make()
    req = FakeRequest("r", list(range(13)), BS)
    # 1. the fetch of 3 blocks is issued this step
    ask(sched, req, 3)
    # 2. reset_cache, then the metadata sends the fetch and the worker completes it
    assert sched.reset_cache()
    meta = sched.build_connector_meta([])
    assert tier_ops(meta).fetch_event == 0 and len(tier_ops(meta).fetch_cpu_blocks) == 3
    sched.update_connector_output(tier_report(completed_fetch_events=[0]))
    # 3. nothing of it is on the CPU tier
    assert not any(with_group_id(h, 0) in sched.cpu_pool.cached for h in req.block_hashes)
    sched.request_finished(req)
    assert sched.is_idle()
    sched.check_integrity()


# ---- completions and counters ------------------------------------------------------------------------------
def test_values_sum_both_sides_in_counter_order() -> None:
    """`values()` (the stats' remote part): each counter is the scheduler's plus the workers' (summed over
    reports), in `REMOTE_COUNTERS` order; zero where neither side has it.

    Found by mutation testing of scheduler_side/tiers/remote/tier.py (docs/mutation.md)."""
    sched, _, _ = make()
    remote = sched.tiers["remote"]
    assert remote.counter_values() == (0,) * len(REMOTE_COUNTERS)
    remote.counters.lookups, remote.counters.lookup_blocks = 2, 5
    sched.update_connector_output([tier_report(counters={"lookup_blocks": 7, "fetched_blocks": 3}),
                                   tier_report(counters={"fetched_blocks": 1, "breaker_trips": 1})])
    expected = dict.fromkeys(REMOTE_COUNTERS, 0) | {"lookups": 2, "lookup_blocks": 12, "fetched_blocks": 4,
                                                     "breaker_trips": 1}
    assert remote.counter_values() == tuple(expected.values())


def test_worker_counters_add_up_over_reports() -> None:
    """Found by mutation testing of scheduler_side/tiers/remote/tier.py (docs/mutation.md)."""
    sched, _, _ = make()
    sched.update_connector_output(tier_report(counters={"written_blocks": 2}))
    sched.update_connector_output(tier_report(counters={"written_blocks": 3, "fetched_blocks": 1}))
    assert sched.tiers["remote"].worker_counters == {"written_blocks": 5, "fetched_blocks": 1}


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


def test_the_next_event_id_is_not_issued_yet() -> None:
    """Found by mutation testing of scheduler_side/tiers/remote/tier.py (docs/mutation.md)."""
    sched, gpu, _ = make()
    two_fetches(sched, gpu)
    with pytest.raises(SchedulerError, match="never issued"):
        sched.update_connector_output(tier_report(completed_fetch_events=[2]))


def test_a_late_completion_does_not_hide_the_next_one() -> None:
    """Found by mutation testing of scheduler_side/tiers/remote/tier.py (docs/mutation.md)."""
    sched, gpu, _ = make()
    sched.emit_kv_events = True
    two_fetches(sched, gpu)
    sched.update_connector_output(tier_report(completed_fetch_events=[0]))
    sched.update_connector_output(tier_report(completed_fetch_events=[0, 1]))  # 0 again: late, ignored
    assert sched.is_idle() and len(sched.cpu_pool.cached) == 4


def test_a_repeated_rank_does_not_hide_the_next_event() -> None:
    """Found by mutation testing of scheduler_side/tiers/remote/tier.py (docs/mutation.md)."""
    sched, gpu, _ = make(world_size=2)
    two_fetches(sched, gpu)
    sched.update_connector_output(tier_report(rank=0, completed_fetch_events=[0, 0, 1]))
    sched.update_connector_output(tier_report(rank=1, completed_fetch_events=[0, 1]))
    assert sched.is_idle() and len(sched.cpu_pool.cached) == 4


def test_every_event_completed_in_one_report_is_published() -> None:
    """Found by mutation testing of scheduler_side/tiers/remote/tier.py (docs/mutation.md)."""
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
