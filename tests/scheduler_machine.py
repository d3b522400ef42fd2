"""The scheduler-side state machine (Hypothesis), shared by the scheduler's and the remote tier's property
tests: random admissions (some in client sessions), steps, completions (in any order, some failing),
aborts, preemptions and session closes against the scheduler side, and two requests loading the same CPU
blocks across steps, with the load wait on or off and lazy's CPU pressure from the start or not. After every
rule: pools are consistent, no block with a transfer in flight is free, no store writes a CPU block a load
in flight reads, and when everything is drained all references are back to zero. On every CPU allocation:
no cached block is evicted while an empty block is free (a copy given up after a load or a session close
goes before older content, never ahead of free room)."""

from dataclasses import dataclass

import hypothesis.strategies as st
from helpers import FakeRequest, make_scheduler, put_under_pressure, report
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from offload_connector.hashing import with_group_id
from scheduler_side import StepRequest
from scheduler_side.admission.hints import session_params

BS = 4
PREFIXES = [list(range(100 * p, 100 * p + 12)) for p in range(3)]


@dataclass
class Running:
    req: FakeRequest
    gpu_ids: list
    computed: int
    loading: bool


class SchedulerMachine(RuleBasedStateMachine):
    # CPU tiers smaller than the working set, and larger (40..64 blocks: loads and session closes then give
    # up copies while the tier still has empty blocks); the load wait (`max_store_wait_steps`) 8 or 0 (a
    # request then hits blocks another request's load still reads)
    @initialize(policy=st.sampled_from(["eager", "lazy"]), world_size=st.sampled_from([1, 2]),
                num_cpu_blocks=st.one_of(st.integers(2, 12), st.integers(40, 64)),
                eviction=st.sampled_from(["lru", "arc"]), load_wait=st.booleans(), pressure=st.booleans())
    def setup(self, policy, world_size, num_cpu_blocks, eviction, load_wait, pressure):
        # pressure: lazy in its frontier mode from the start (it lends loaded slots to stores), its lookahead
        # the whole GPU pool (else a freed block lies past it until allocations move the frontier)
        self.sched, self.gpu = make_scheduler(num_gpu_blocks=24, num_cpu_blocks=num_cpu_blocks,
                                              block_size=BS, world_size=world_size, store_policy=policy,
                                              eviction=eviction, max_store_wait_steps=8 if load_wait else 0,
                                              lazy_lookahead_blocks=24 if pressure else None)
        if pressure and policy == "lazy":
            put_under_pressure(self.sched)
        self.world_size = world_size
        self.reqs: dict[str, Running] = {}
        self.sent_loads: list[str] = []  # requests whose load was handed to the workers
        self.load_reads: dict[str, set[int]] = {}  # sent load -> the CPU blocks it reads until it completes
        self.load_writes: dict[str, list[int]] = {}  # sent load -> the GPU blocks it writes
        self.stores: dict[int, list[int]] = {}  # store event -> GPU blocks
        self.next_id = 0
        self.watch_cpu_evictions()

    def watch_cpu_evictions(self):
        """Record every CPU allocation that evicts a cached block while an empty one is free."""
        self.evictions_with_room: list[str] = []
        pool = self.sched.cpu_pool
        allocate = pool.allocate

        def allocate_checked(num):
            empty, before = sum(1 for b in pool.free_queue if b.block_hash is None), pool.num_evictions
            out = allocate(num)
            if out is not None and pool.num_evictions - before > max(0, num - empty):
                self.evictions_with_room.append(f"{pool.num_evictions - before} cached blocks evicted for "
                                                f"{num} blocks while {empty} empty blocks were free")
            return out

        pool.allocate = allocate_checked

    # --- the engine side ---------------------------------------------------------------------
    @rule(prefix=st.integers(0, 2), extra=st.integers(0, 9), gpu_hit=st.booleans(),
          session=st.sampled_from([None, "s0", "s1"]))
    def admit(self, prefix, extra, gpu_hit, session):
        rid = f"r{self.next_id}"
        self.next_id += 1
        req = FakeRequest(rid, PREFIXES[prefix] + [7000 + self.next_id] * extra, BS)
        if session is not None:
            req.kv_transfer_params = session_params(session)
        self._admit(req, BS if gpu_hit else 0)

    @rule(data=st.data(), prefix=st.integers(0, 2), other=st.integers(5, 16))
    def load_a_prefix_twice_across_steps(self, data, prefix, other):
        """Loads across steps, under whatever else is in flight. If the CPU tier lacks the prefix, A computes
        it, finishes, and a step stores it (completed). Then B hits it while D (`other` tokens) is
        admitted; a step sends B's load (in flight from now on) and computes D; C hits the same CPU blocks
        (with the load wait on it waits instead) and D finishes, so the next step sends C's load while B's
        still reads those blocks, and stores D's blocks: that store must not take the slots they read."""
        tokens = PREFIXES[prefix]
        if prefix not in self.cached_prefixes():
            a = self.new_request(tokens + [9000 + self.next_id])
            self._admit(a, 0)
            if a.request_id not in self.reqs:
                return
            self.run_step(lambda r: r.req.num_tokens if r.req is a else None)
            self.finish_or_abort(data, a.request_id)
            events = set(self.stores)
            self.run_step(lambda r: None)
            for event in sorted(set(self.stores) - events):
                del self.stores[event]
                self.sched.update_connector_output(self.every_rank(data, completed_store_events=[event]))
        d = self.new_request(list(range(5000, 5000 + other)))
        for turn in range(2):
            self._admit(self.new_request(tokens + [9000 + self.next_id]), 0)
            if turn == 0:
                self._admit(d, 0)
            elif d.request_id in self.reqs:
                self.finish_or_abort(data, d.request_id)
            self.run_step(lambda r: r.req.num_tokens if r.req is d else None)

    def new_request(self, tokens: list[int]) -> FakeRequest:
        self.next_id += 1
        return FakeRequest(f"r{self.next_id - 1}", tokens, BS)

    def cached_prefixes(self) -> list[int]:
        """The prompts whose first block the CPU tier holds."""
        cached = self.sched.cpu_pool.cached
        return [i for i, tokens in enumerate(PREFIXES)
                if with_group_id(FakeRequest("-", tokens, BS).block_hashes[0], 0) in cached]

    def _admit(self, req, gpu_hit_tokens):
        hit, is_async = self.sched.get_num_new_matched_tokens(req, gpu_hit_tokens)
        blocks = self.gpu.allocate(-(-req.num_tokens // BS))
        if hit is None or blocks is None:
            if blocks:
                self.gpu.free(blocks)
            self.sched.request_finished(req)  # the engine gives up on it (abort while waiting)
            return
        ids = [b.block_id for b in blocks]
        self.sched.update_state_after_alloc(req, ids, hit)
        self.reqs[req.request_id] = Running(req, ids, gpu_hit_tokens + hit, loading=is_async)

    @rule(data=st.data())
    def step(self, data):
        self.run_step(lambda r: r.computed + data.draw(st.integers(1, 9)))

    def run_step(self, computed):
        """One engine step: each running request not loading and not done computes up to `computed(r)`
        tokens (None: not scheduled this step), then the connector's metadata."""
        steps = []
        for rid, r in self.reqs.items():
            if r.loading or r.computed >= r.req.num_tokens or (upto := computed(r)) is None:
                continue
            r.computed = min(r.req.num_tokens, upto)
            steps.append(StepRequest(rid, r.gpu_ids, r.computed, True))
        self._record(self.sched.build_connector_meta(steps))

    def _record(self, meta):
        """What the workers are handed: checked, then in flight until a completion rule reports it."""
        self.check_store_targets(meta)
        self.sent_loads.extend(meta.load_event_reqs)
        if meta.store_event is not None:
            self.stores[meta.store_event] = list(meta.store_gpu_blocks)
            assert len(meta.store_gpu_blocks) == len(meta.store_cpu_blocks)

    def check_store_targets(self, meta) -> None:
        """A store never writes a CPU block an earlier step's load still reads; it writes one this step's load
        reads only with store_after_load (the workers then order it after that load)."""
        written = set(meta.store_cpu_blocks)
        assert not any(written & reads for reads in self.load_reads.values())
        assert meta.store_after_load == bool(written & set(meta.load_cpu_blocks))
        start = 0
        for rid, n in zip(meta.load_event_reqs, meta.load_req_num_blocks, strict=True):
            self.load_reads[rid] = set(meta.load_cpu_blocks[start:start + n])
            self.load_writes[rid] = list(meta.load_gpu_blocks[start:start + n])
            start += n

    def every_rank(self, data, **fields) -> list:
        """One report per rank in a random order, with repeats from the same rank mixed in (ignored)."""
        ranks = data.draw(st.permutations(range(self.world_size)))
        repeats = data.draw(st.lists(st.sampled_from(ranks), max_size=2))
        return [report(rank=r, **fields) for r in [*repeats[:1], *ranks, *repeats[1:]]]

    @precondition(lambda self: self.stores)
    @rule(data=st.data(), failed=st.booleans())
    def complete_store(self, data, failed):
        event = data.draw(st.sampled_from(sorted(self.stores)))
        del self.stores[event]
        key = "failed_store_events" if failed else "completed_store_events"
        self.sched.update_connector_output(self.every_rank(data, **{key: [event]}))

    @precondition(lambda self: self.sent_loads)
    @rule(data=st.data(), failed=st.booleans())
    def complete_load(self, data, failed):
        rid = data.draw(st.sampled_from(self.sent_loads))
        self.sent_loads.remove(rid)
        self.load_reads.pop(rid, None)
        writes = self.load_writes.pop(rid, [])
        bad = data.draw(st.lists(st.sampled_from(writes), max_size=len(writes))) if failed and writes else []
        self.sched.update_connector_output(
            self.every_rank(data, finished_load_reqs=[rid], failed_load_gpu_blocks=bad))
        if rid in self.reqs:
            self.reqs[rid].loading = False

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish_or_abort(self, data, rid=None):
        rid = rid or data.draw(st.sampled_from(sorted(self.reqs)))
        r = self.reqs.pop(rid)
        assert self.sched.request_finished(r.req) == (False, None)
        if not r.loading:  # the engine's prefix cache keeps its computed full blocks (lazy stores them)
            for i in range(min(r.computed // BS, len(r.req.block_hashes))):
                self.gpu.cache(self.gpu.blocks[r.gpu_ids[i]], with_group_id(r.req.block_hashes[i], 0))
        self.gpu.free([self.gpu.blocks[i] for i in reversed(r.gpu_ids)])

    @precondition(lambda self: any(not r.loading for r in self.reqs.values()))
    @rule(data=st.data())
    def preempt_and_resume(self, data):
        rid = data.draw(st.sampled_from(sorted(k for k, r in self.reqs.items() if not r.loading)))
        r = self.reqs.pop(rid)
        self.sched.request_preempted(rid)
        self.gpu.free([self.gpu.blocks[i] for i in reversed(r.gpu_ids)])
        self._admit(r.req, 0)

    @rule(session=st.sampled_from(["s0", "s1"]))
    def close_session(self, session):
        """The client says the session ended: its CPU copies move to the eviction end."""
        self.sched.close_session(session)

    # --- invariants --------------------------------------------------------------------------
    @invariant()
    def no_cached_block_evicted_while_an_empty_one_is_free(self):
        assert not self.evictions_with_room, self.evictions_with_room[0]
        first_cached = None  # and none would be: every empty free block comes first in eviction order
        for block in self.sched.cpu_pool.free_queue:
            if block.block_hash is not None:
                first_cached = first_cached or block
            else:
                assert first_cached is None, f"cached {first_cached} is evicted before the empty {block}"

    @invariant()
    def pools_consistent(self):
        self.sched.check_integrity()
        self.gpu.check_integrity()

    @invariant()
    def inflight_blocks_are_never_free(self):
        for gpu_ids in self.stores.values():
            assert all(self.gpu.blocks[i].ref_cnt > 0 for i in gpu_ids)

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for r in self.reqs.values():  # the engine finishes everything ...
            self.sched.request_finished(r.req)
            self.gpu.free([self.gpu.blocks[i] for i in reversed(r.gpu_ids)])
        for _ in range(5):  # ... and keeps stepping while transfers are queued or in flight
            meta = self.sched.build_connector_meta([])
            self.sent_loads.extend(meta.load_event_reqs)
            if meta.store_event is not None:
                self.stores[meta.store_event] = list(meta.store_gpu_blocks)
            for event in list(self.stores):
                self.sched.update_connector_output(
                    [report(rank=r, completed_store_events=[event]) for r in range(self.world_size)])
            for rid in self.sent_loads:
                self.sched.update_connector_output(
                    [report(rank=r, finished_load_reqs=[rid]) for r in range(self.world_size)])
            self.stores, self.sent_loads = {}, []
            if self.sched.num_inflight_transfers == 0:
                break
        assert self.sched.is_idle()
        self.sched.check_integrity()
        assert self.sched.cpu_pool.num_held_blocks() == 0
        assert self.gpu.num_held_blocks() == 0
