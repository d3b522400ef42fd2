"""The scheduler side of the remote tier: behaviours no test pinned until mutation testing (docs/mutation.md)
showed the gap. The tier runs with the hand-driven lookup stand-in of test_remote_scheduler.py; the lookup
thread runs against a stand-in client (no server)."""

from __future__ import annotations

import threading

import pytest
from helpers import FakeRequest, tier_ops, tier_report

from offload_connector.config import load_config
from offload_connector.hashing import with_group_id
from offload_connector.remote.breaker import RemoteCounters
from scheduler_side import BlockPool, BlockPoolGpuView, OffloadScheduler
from scheduler_side.tiers.remote.lookups import RemoteLookups
from scheduler_side.tiers.remote.stats import REMOTE_COUNTERS

pytest.importorskip("redis", reason="the remote tier's client needs the `redis` package")

from test_remote_scheduler import BS, IDENTITY, HandLookups  # noqa: E402


def make(group_id: int = 0) -> tuple[OffloadScheduler, BlockPool]:
    config = load_config({"store_policy": "eager", "num_cpu_blocks": 20, "remote": {"url": "redis://127.0.0.1:1/0"}})
    gpu = BlockPool(100)
    sched = OffloadScheduler(config, BS, 20, BlockPoolGpuView(gpu), 1, group_id=group_id, tier_identity=IDENTITY)
    sched.tiers["remote"].lookups.close()  # the real thread: replaced by the hand-driven stand-in
    sched.tiers["remote"].lookups = HandLookups(sched.tiers["remote"].lookups.client)
    sched.tiers["remote"].clock = lambda: 0.0
    return sched, gpu


def ask(sched: OffloadScheduler, req: FakeRequest, found: int) -> None:
    """The request misses on the CPU, waits on the tier, and the tier answers `found` blocks: the fetch is
    issued in this step's fetch event (not sent yet)."""
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    sched.tiers["remote"].lookups.answers[0] = found
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)


# ---- the tier -------------------------------------------------------------------------------------------
def test_values_sum_both_sides_in_counter_order() -> None:
    """`values()` (the stats' remote part): each counter is the scheduler's plus the workers' (summed over
    reports), in `REMOTE_COUNTERS` order; zero where neither side has it."""
    sched, _ = make()
    remote = sched.tiers["remote"]
    assert remote.counter_values() == (0,) * len(REMOTE_COUNTERS)
    remote.counters.lookups, remote.counters.lookup_blocks = 2, 5
    sched.update_connector_output([tier_report(counters={"lookup_blocks": 7, "fetched_blocks": 3}),
                                   tier_report(counters={"fetched_blocks": 1, "breaker_trips": 1})])
    expected = dict.fromkeys(REMOTE_COUNTERS, 0) | {"lookups": 2, "lookup_blocks": 12, "fetched_blocks": 4,
                                                     "breaker_trips": 1}
    assert remote.counter_values() == tuple(expected.values())


def test_fetch_keys_carry_the_schedulers_kv_cache_group() -> None:
    """A scheduler of KV cache group 1 fetches (and then hits) the blocks under group 1's keys."""
    sched, gpu = make(group_id=1)
    req = FakeRequest("r", list(range(13)), BS)  # 3 full blocks + 1 token
    ask(sched, req, 3)
    meta = sched.build_connector_meta([])
    assert tier_ops(meta).fetch_keys == [with_group_id(h, 1) for h in req.block_hashes[:3]]
    sched.update_connector_output(tier_report(completed_fetch_events=[tier_ops(meta).fetch_event]))
    assert sched.get_num_new_matched_tokens(req, 0) == (3 * BS, True)


def test_reset_before_the_fetch_is_sent_fails_it_too() -> None:
    """reset_cache after a fetch was issued but before the step's metadata carried it: that fetch still
    completes as failed, so none of its (possibly old weights') blocks becomes hit-able."""
    sched, _ = make()
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


# ---- the lookup thread ------------------------------------------------------------------------------------
class GatedClient:
    """Stands in for RemoteClient: every block exists; `leading_present` waits for `gate` while it is
    clear, and sets `busy` on entry."""

    def __init__(self) -> None:
        self.counters = RemoteCounters()
        self.gate, self.busy = threading.Event(), threading.Event()

    def leading_present(self, key_lists):
        self.busy.set()
        assert self.gate.wait(timeout=60), "the test never opened the gate"
        return [len(keys) for keys in key_lists]

    def server_memory(self):
        return None

    def sibling(self):
        return self

    def close(self) -> None:
        pass


def test_cancelling_an_answered_question_forgets_its_answer() -> None:
    """`cancel` of a question already answered drops the answer (it is never taken) and keeps nothing."""
    client = GatedClient()
    client.gate.set()
    lookups = RemoteLookups(client, "p", 1)
    ticket = lookups.submit([b"\x01" * 16, b"\x02" * 16], 0)
    lookups.close()  # the thread answers everything queued before it stops
    lookups.cancel(ticket)
    assert lookups.take(ticket) is None
    assert not lookups._cancelled  # noqa: SLF001 - nothing waits for an answer that will never come


def test_a_question_cancelled_before_it_is_asked_leaves_nothing_behind() -> None:
    """A question cancelled while it waits in the queue is never asked, and its ticket is forgotten once
    skipped: cancelled tickets do not pile up over a long run."""
    client = GatedClient()
    lookups = RemoteLookups(client, "p", 1)
    # 1. the thread is busy with a first question
    first = lookups.submit([b"\x01" * 16], 0)
    assert client.busy.wait(timeout=60)
    # 2. a second question is queued, then cancelled before the thread reaches it
    second = lookups.submit([b"\x02" * 16], 0)
    lookups.cancel(second)
    # 3. the thread finishes; the second question is skipped (never asked: 1 block asked in all)
    client.gate.set()
    lookups.close()
    assert lookups.take(first) == 1 and lookups.take(second) is None
    assert client.counters.lookup_blocks == 1
    assert not lookups._cancelled  # noqa: SLF001
