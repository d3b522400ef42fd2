"""Property test of the scheduler side with the remote tier: the rules of test_scheduler_state_machine.py
plus requests that wait on the tier, lookup answers arriving in any order (or never: the clock moves past
timeout_ms), fetch events completing per rank with random blocks failed, and cache resets. After every rule
the pools are consistent (fetch events hold their blocks) and at the end every reference is back."""

import hypothesis.strategies as st
import pytest
from helpers import FakeRequest, tier_ops, tier_report
from hypothesis import HealthCheck, settings
from hypothesis.stateful import initialize, precondition, rule
from scheduler_machine import BS, PREFIXES, Running, SchedulerMachine

from offload_connector.config import load_config
from offload_connector.metadata import TierReport
from offload_connector.tier_identity import TierIdentity
from scheduler_side import BlockPool, BlockPoolGpuView, OffloadScheduler

pytest.importorskip("redis", reason="the remote tier's client needs the `redis` package")
IDENTITY = TierIdentity(model="m", block_size=BS, hash_algo="xxh3_128", layout="test")


class HandLookups:
    """Stands in for the lookup thread: questions wait until a rule answers them."""

    def __init__(self, client) -> None:
        self.client, self.questions, self.answers = client, {}, {}

    def submit(self, hashes, group_id):
        self.questions[len(self.questions)] = len(hashes)
        return len(self.questions) - 1

    def take(self, ticket):
        return self.answers.pop(ticket, None)

    def cancel(self, ticket):
        self.answers.pop(ticket, None)
        self.questions.pop(ticket, None)

    def close(self):
        pass


class RemoteMachine(SchedulerMachine):
    @initialize(policy=st.sampled_from(["eager", "lazy"]), world_size=st.sampled_from([1, 2]),
                num_cpu_blocks=st.integers(2, 12), eviction=st.sampled_from(["lru", "arc"]),
                write=st.sampled_from(["on_store", "on_cpu_evict"]), allow_reset=st.booleans())
    def setup(self, policy, world_size, num_cpu_blocks, eviction, write, allow_reset):
        self.allow_reset = allow_reset  # a reset turns the tier off: half the runs never reset
        config = load_config({"num_cpu_blocks": num_cpu_blocks, "store_policy": policy, "eviction": eviction,
                              "remote": {"url": "redis://127.0.0.1:1/0", "write": write, "timeout_ms": 1000,
                                         "max_waiting_requests": 3}})
        self.gpu = BlockPool(24)
        self.sched = OffloadScheduler(config, BS, num_cpu_blocks, BlockPoolGpuView(self.gpu), world_size,
                                      tier_identity=IDENTITY)
        self.sched.tiers["remote"].lookups.close()
        self.lookups = self.sched.tiers["remote"].lookups = HandLookups(self.sched.tiers["remote"].lookups.client)
        self.now = [0.0]
        self.sched.tiers["remote"].clock = lambda: self.now[0]
        self.world_size = world_size
        self.reqs: dict[str, Running] = {}
        self.waiting: dict[str, FakeRequest] = {}  # looked up, answered None: asked again by `retry`
        self.sent_loads: list[str] = []
        self.load_reads: dict[str, set[int]] = {}
        self.load_writes: dict[str, list[int]] = {}
        self.stores: dict[int, list[int]] = {}
        self.fetches: dict[int, list[int]] = {}  # fetch event -> its CPU blocks
        self.next_id = 0
        self.watch_cpu_evictions()

    def _admit(self, req, gpu_hit_tokens):
        hit, is_async = self.sched.get_num_new_matched_tokens(req, gpu_hit_tokens)
        if hit is None:
            self.waiting[req.request_id] = req
            return
        self.waiting.pop(req.request_id, None)
        blocks = self.gpu.allocate(-(-req.num_tokens // BS))
        if blocks is None:
            self.sched.request_finished(req)  # the engine gives up on it
            return
        ids = [b.block_id for b in blocks]
        self.sched.update_state_after_alloc(req, ids, hit)
        self.reqs[req.request_id] = Running(req, ids, gpu_hit_tokens + hit, loading=is_async)

    @rule(prefix=st.integers(0, 2), extra=st.integers(0, 9), gpu_hit=st.booleans())
    def admit(self, prefix, extra, gpu_hit):
        rid = f"r{self.next_id}"
        self.next_id += 1
        self._admit(FakeRequest(rid, PREFIXES[prefix] + [7000 + self.next_id] * extra, BS), 0)

    def _record(self, meta):
        super()._record(meta)
        if tier_ops(meta).fetch_event is not None:
            self.fetches[tier_ops(meta).fetch_event] = list(tier_ops(meta).fetch_cpu_blocks)
        assert len(tier_ops(meta).write_cpu_blocks) == len(tier_ops(meta).write_keys)
        for cpu_id, key in zip(tier_ops(meta).write_cpu_blocks, tier_ops(meta).write_keys, strict=True):
            assert self.sched.cpu_pool.blocks[cpu_id].block_hash != key  # evicted: no longer cached there

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), found=st.integers(-1, 4))
    def retry(self, data, found):
        """Ask again for a waiting request, first answering its open question (found >= 0) if it has one."""
        req = self.waiting[data.draw(st.sampled_from(sorted(self.waiting)))]
        wait = self.sched.tiers["remote"]._waits.get(req.request_id)
        if found >= 0 and wait is not None and wait.ticket in self.lookups.questions:
            self.lookups.answers[wait.ticket] = min(found, self.lookups.questions.pop(wait.ticket))
        self._admit(req, 0)
        self._record(self.sched.build_connector_meta([]))

    @precondition(lambda self: self.lookups.questions)
    @rule(data=st.data())
    def answer(self, data):
        ticket = data.draw(st.sampled_from(sorted(self.lookups.questions)))
        self.lookups.answers[ticket] = data.draw(st.integers(0, self.lookups.questions.pop(ticket)))

    @rule(seconds=st.sampled_from([0.1, 2.0]))
    def time_passes(self, seconds):
        self.now[0] += seconds

    @precondition(lambda self: self.fetches)
    @rule(data=st.data(), fail=st.sampled_from(["none", "first", "some"]))
    def complete_fetch(self, data, fail):
        event = data.draw(st.sampled_from(sorted(self.fetches)))
        blocks = self.fetches.pop(event)
        failed = {"none": [], "first": blocks[:1],
                  "some": data.draw(st.lists(st.sampled_from(blocks), min_size=1, unique=True)) if blocks else []}[fail]
        self.sched.update_connector_output(
            self.every_rank(data, tiers=[TierReport(tier="remote", completed_fetch_events=[event],
                                                    failed_fetch_cpu_blocks=failed)]))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def abort_waiting(self, data):
        req = self.waiting.pop(data.draw(st.sampled_from(sorted(self.waiting))))
        assert self.sched.request_finished(req) == (False, None)

    @precondition(lambda self: self.allow_reset)
    @rule()
    def reset(self):
        if not self.sched.transfers.loads_to_send:
            self.sched.reset_cache()

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for req in self.waiting.values():
            self.sched.request_finished(req)
        self._record(self.sched.build_connector_meta([]))
        for event in list(self.fetches):
            self.sched.update_connector_output(
                [tier_report(rank=r, completed_fetch_events=[event]) for r in range(self.world_size)])
        self.fetches = {}
        assert self.sched.tiers["remote"].num_waiting == 0
        super().teardown()


RemoteMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestRemoteMachine = RemoteMachine.TestCase
